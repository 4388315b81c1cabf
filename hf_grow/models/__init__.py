"""Grown model types, registered with the transformers Auto classes when hf_grow is imported.

Each `grown_*` package here (a self-contained config file, modeling file and, for decoders, paged-cache file) is
found by name, so that adding a model type edits nothing in this file. Each exports ``AUTO_MAP``, the Auto classes
its checkpoints declare for `trust_remote_code`; the same table registers them here, so that checkpoints load
with the plain Auto classes wherever hf_grow is imported. The packages' other exports are re-exported here.
"""

import importlib
import pkgutil
from types import ModuleType

import transformers


#: The `grown_*` packages, in name order.
GROWN_PACKAGES: tuple[ModuleType, ...] = tuple(
    importlib.import_module(f"{__name__}.{module.name}")
    for module in pkgutil.iter_modules(__path__)
    if module.ispkg and module.name.startswith("grown_")
)


def _register(package: ModuleType) -> None:
    classes = {
        auto_name: getattr(package, reference.split(".")[-1]) for auto_name, reference in package.AUTO_MAP.items()
    }
    config_class = classes.pop("AutoConfig")
    transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for auto_name, model_class in classes.items():
        getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)


for _package in GROWN_PACKAGES:
    _register(_package)

#: Every package's exports but its ``AUTO_MAP`` (each package has one): configs, models and their base classes.
_EXPORTS = {
    name: getattr(package, name) for package in GROWN_PACKAGES for name in package.__all__ if name != "AUTO_MAP"
}
globals().update(_EXPORTS)
__all__ = sorted(_EXPORTS)
