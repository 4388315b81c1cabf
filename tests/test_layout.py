"""The package's layering, read from its sources: no import cycles, pure linear algebra without transformers, and
grown model files that import only what a `trust_remote_code` user has."""

import ast
from pathlib import Path

import pytest

import hf_grow


PACKAGE = Path(hf_grow.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports anywhere in it (under ``TYPE_CHECKING`` too)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            if node.module is None:  # `from . import linalg`: the modules named
                names.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                names.add(base)
    return names


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def test_modules_import_each_other_without_cycles():
    """A module never reaches itself through the modules it imports (packages' re-exports left aside, as the
    cycle would then run through an ``__init__``)."""
    graph = {name: {dep for dep in imports(path) if dep in MODULES and dep not in PACKAGES and dep != name}
             for name, path in MODULES.items() if name not in PACKAGES}
    cycles = []
    for start in graph:
        stack = [(start, (start,))]
        while stack:
            module, path = stack.pop()
            for dep in graph[module]:
                if dep == start:
                    cycles.append(" -> ".join((*path, dep)))
                elif dep not in path:
                    stack.append((dep, (*path, dep)))
    assert not cycles, cycles


@pytest.mark.parametrize("module", ["hf_grow.linalg", "hf_grow.compact"])
def test_pure_linear_algebra_imports_no_transformers(module):
    assert all(not name.startswith("transformers") for name in imports(MODULES[module]))


def test_grown_model_files_import_only_torch_transformers_and_their_siblings():
    for path in (PACKAGE / "models").glob("grown_*/*_grown_*.py"):
        siblings = {f"{module_name(path).rsplit('.', 1)[0]}.{other.stem}" for other in path.parent.glob("*.py")}
        foreign = {name for name in imports(path) if name not in siblings}
        allowed = ("torch", "transformers", "huggingface_hub", "__future__", "math", "shutil", "pathlib", "typing",
                   "collections", "dataclasses", "functools")
        assert all(name.split(".")[0] in allowed for name in foreign), (path.name, foreign)
