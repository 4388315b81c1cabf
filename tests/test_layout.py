"""The package's layering, read from its sources: no import cycles, pure linear algebra without transformers,
grown model files that import only what a `trust_remote_code` user has, and the style limits of pyproject.toml."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_grow
from hf_grow.models import GROWN_PACKAGES


PACKAGE = Path(hf_grow.__file__).parent
REPOSITORY = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _relative_base(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a relative ``from`` import of ``path`` names (its package with ``from . import x``)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def defining_module(package: str, name: str) -> str:
    """The module that holds ``name`` imported from ``package``: its submodule of that name, else the module its
    ``__init__`` re-exports ``name`` from (followed through nested packages), else the package itself."""
    if f"{package}.{name}" in MODULES:
        return f"{package}.{name}"
    path = MODULES[package]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module is not None:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _relative_base(path, node)
                    return defining_module(source, alias.name) if source in PACKAGES else source
    return package


def imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports anywhere in it (under ``TYPE_CHECKING`` too). A name taken
    from one of hf_grow's packages (``from .statistics import parse_bytes``) counts as an import of the module
    that holds it (`defining_module`), so that the dependency is on that module, not on the package's
    ``__init__``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _relative_base(path, node) if node.level else node.module
            if node.module is None:  # `from . import linalg`: the modules named
                names.update(f"{source}.{alias.name}" for alias in node.names)
            elif source in PACKAGES:
                names.update(defining_module(source, alias.name) for alias in node.names)
            else:
                names.add(source)
    return names


def test_modules_import_each_other_without_cycles():
    """A module never reaches itself through the modules it imports, names taken from a package counted as imports
    of the modules that hold them (a package's ``__init__`` as one module, for the names it defines)."""
    graph = {name: {dep for dep in imports(path) if dep in MODULES and dep != name}
             for name, path in MODULES.items()}
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


@pytest.mark.parametrize("module", ["hf_grow.linalg", "hf_grow.lapack", "hf_grow.subspace", "hf_grow.compact"])
def test_pure_linear_algebra_imports_no_transformers(module):
    assert all(not name.startswith("transformers") for name in imports(MODULES[module]))


def test_grown_model_files_import_only_torch_transformers_and_their_siblings():
    for path in (PACKAGE / "models").glob("grown_*/*_grown_*.py"):
        siblings = {f"{module_name(path).rsplit('.', 1)[0]}.{other.stem}" for other in path.parent.glob("*.py")}
        foreign = {name for name in imports(path) if name not in siblings}
        allowed = ("torch", "transformers", "huggingface_hub", "__future__", "math", "copy", "shutil", "pathlib",
                   "typing", "collections", "dataclasses", "functools")
        assert all(name.split(".")[0] in allowed for name in foreign), (path.name, foreign)


#: The grown decoder packages (those with a paged-cache file): each holds a copy of the same code, as a
#: `trust_remote_code` folder cannot import a shared module.
FIRST_DECODER, *OTHER_DECODERS = sorted(
    path.parent.name.removeprefix("grown_") for path in (PACKAGE / "models").glob("grown_*/paged_*.py")
)
#: Every grown package: each configuration file holds a copy of the cache layer types of wider keys (a BERT
#: decoder's static cache needs them too).
OTHER_PACKAGES = sorted(
    path.parent.name.removeprefix("grown_") for path in (PACKAGE / "models").glob("grown_*/configuration_*.py")
    if path.parent.name != f"grown_{FIRST_DECODER}"
)
#: The copied files, the packages that copy the first decoder's, and the lines where a copy may differ from the
#: first's (the model's name, its value width; its config class).
COPIED_FILES = {"paged": ("paged_grown_{}.py", OTHER_DECODERS, {2, 25}),
                "cache_layers": ("configuration_grown_{}.py", OTHER_PACKAGES, {2, 10})}
TWINS = [
    pytest.param(f"grown_{FIRST_DECODER}/{file.format(FIRST_DECODER)}", f"grown_{other}/{file.format(other)}",
                 differing, id=f"{kind}-{other}")
    for kind, (file, others, differing) in COPIED_FILES.items()
    for other in others
]


def shared_lines(path: Path) -> list[str]:
    """The lines of ``path`` that its twin repeats: a configuration file's up to its config class (the cache
    layer types of wider keys), any other file's whole."""
    lines = path.read_text().splitlines()
    config_class = [number for number, line in enumerate(lines) if re.match(r"class Grown\w+Config\(", line)]
    return lines[: config_class[0]] if config_class else lines


@pytest.mark.parametrize("first_copy, other_copy, differing", TWINS)
def test_copies_in_the_grown_model_folders_stay_the_same(first_copy, other_copy, differing):
    """A fix in one folder's copy must reach the others: the twins agree line by line but where they may differ."""
    first, second = (shared_lines(PACKAGE / "models" / name) for name in (first_copy, other_copy))
    assert len(first) == len(second)
    assert [number for number, (a, b) in enumerate(zip(first, second), 1) if a != b and number not in differing] == []


def attention_checks(path: Path) -> list[str]:
    """A modeling file's copy of the attention refusal (`_UNSUPPORTED_ATTENTION`) and of its pretrained class's
    methods from ``post_init`` to the end of ``create_masks_for_generate`` (the model tags, flash and flex refused,
    one causal mask for static caches)."""
    lines = path.read_text().splitlines()
    constant = lines.index("_UNSUPPORTED_ATTENTION = (")
    start = lines.index("    def post_init(self):")
    masks = lines.index("    def create_masks_for_generate(")
    return lines[constant : lines.index(")", constant) + 1] + lines[start : lines.index("        )", masks) + 1]


def test_the_modeling_files_refuse_flash_attention_alike():
    """Each grown modeling file holds its own copy of the attention refusal, the tags and the static caches' mask
    (an exported folder cannot import a shared module): a fix in one must reach the others."""
    copies = [attention_checks(path) for path in sorted((PACKAGE / "models").glob("grown_*/modeling_grown_*.py"))]
    assert len(copies) == len(GROWN_PACKAGES) and len(copies[0]) == 52 and all(copy == copies[0] for copy in copies)


def saving_code(path: Path) -> list[str]:
    """A modeling file's copy of ``_PUSH_KWARGS`` and of its pretrained class's `save_pretrained` (the source
    files, `auto_map` and growth report written beside the weights)."""
    lines = path.read_text().splitlines()
    push = [line for line in lines if line.startswith("_PUSH_KWARGS = ")]
    start = lines.index("    def save_pretrained(")
    end = next(number for number in range(start + 1, len(lines)) if re.match(r"(class |    def )", lines[number]))
    return push + [line for line in lines[start:end] if line]


def test_the_modeling_files_save_alike():
    """Each grown modeling file holds its own copy of `save_pretrained` (an exported folder cannot import a
    shared module): a fix in one must reach the others."""
    copies = [saving_code(path) for path in sorted((PACKAGE / "models").glob("grown_*/modeling_grown_*.py"))]
    assert len(copies) == len(GROWN_PACKAGES) and len(copies[0]) > 20 and all(copy == copies[0] for copy in copies)


def test_sources_keep_the_style_limits():
    """`ruff check` with pyproject.toml's settings (pycodestyle and pyflakes, lines of at most 120 characters)
    passes on the package, the recipes and the tests."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "hf_grow", "recipes", "tests"],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


#: Classes over `MAX_CLASS_LINES`, and why: a dataclass whose fields (with their help texts) are one list of options.
LONG_CLASSES = {"hf_grow.config.GrowthConfig": "23 options, each with the help text `hf-grow --help` shows"}
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 150


def test_modules_and_classes_stay_small():
    """The guide's rooms: modules ≲ 500 lines and classes ≲ 150; a change that would pass them splits first."""
    long_modules, long_classes = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(module_name(path))
        for node in ast.walk(ast.parse(source)):
            name = f"{module_name(path)}.{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes.append(name)
    assert long_modules == []
    assert sorted(long_classes) == sorted(LONG_CLASSES)


@pytest.mark.parametrize("module", ["hf_grow.config", "hf_grow.option_values", "hf_grow.files"])
def test_options_and_files_import_nothing_that_runs_a_growth(module):
    """The options (and the values they take, and the file helpers) sit below the statistics, the growth, the Hub
    code and the models: nothing they import, directly or through other modules, is transformers or those."""
    layers = ("hf_grow.statistics", "hf_grow.growth", "hf_grow.card", "hf_grow.hub", "hf_grow.models", "transformers")
    reached, todo = set(), [module]
    while todo:
        for name in imports(MODULES[todo.pop()]) - reached:
            reached.add(name)
            if name in MODULES:
                todo.append(name)
    assert not [name for name in reached if name.startswith(layers)]


def test_every_grown_class_is_exported_at_the_top_level():
    """hf_grow's and hf_grow.models' exports are written out (for editors and type checkers): a new grown
    package's classes must be added to both, its `*PreTrainedModel` base class to hf_grow.models only."""
    import hf_grow
    from hf_grow import models

    in_packages = {name for package in models.GROWN_PACKAGES for name in package.__all__ if name != "AUTO_MAP"}
    assert set(models.__all__) == in_packages
    grown = {name for name in in_packages if not name.endswith("PreTrainedModel")}
    exported = {name for name in hf_grow.__all__ if name.startswith("Grown")}
    assert exported == grown
    assert all(getattr(hf_grow, name) is getattr(models, name) for name in grown)


def test_every_adapter_module_registers_one_adapter_and_intermediates_register_none():
    """Each module of hf_grow/adapters but the shared ones defines the adapter that is looked up for its model types;
    a class without model types of its own (an abstract intermediate, a subclass that inherits them) joins
    nothing."""
    from abc import ABC

    from hf_grow import adapters
    from hf_grow.adapters.base import ArchitectureAdapter

    modules = {path.stem for path in (PACKAGE / "adapters").glob("*.py")} - {"__init__", "base", "building"}
    assert {type(adapter).__module__.rsplit(".", 1)[1] for adapter in adapters.ADAPTERS} == modules
    assert all(getattr(adapters, type(adapter).__name__) is type(adapter) for adapter in adapters.ADAPTERS)
    registered = list(ArchitectureAdapter.registered)
    try:
        type("Intermediate", (ArchitectureAdapter, ABC), {})
        type("Variant", (adapters.GPT2Adapter,), {})
        assert ArchitectureAdapter.registered == registered
        new = type("NewArchitecture", (adapters.GPT2Adapter,), {"model_types": ("new_architecture",)})
        assert ArchitectureAdapter.registered == [*registered, new]
    finally:
        ArchitectureAdapter.registered[:] = registered
