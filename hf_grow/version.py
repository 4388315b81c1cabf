"""hf_grow's version, in a module of its own: the package metadata (pyproject.toml) and what records it (the growth
report, the grown config) read it from here without importing the package."""

__version__ = "0.1.0"
