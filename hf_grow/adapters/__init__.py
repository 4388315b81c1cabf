"""Architecture adapters, looked up by `config.model_type`."""

from __future__ import annotations

from transformers import PreTrainedModel

from .base import ArchitectureAdapter, scale_dims_after_growth
from .bert import BertAdapter
from .gpt2 import GPT2Adapter
from .llama import LlamaAdapter


ADAPTERS: tuple[ArchitectureAdapter, ...] = (GPT2Adapter(), BertAdapter(), LlamaAdapter())


def supported_model_types() -> list[str]:
    return [model_type for adapter in ADAPTERS for model_type in adapter.model_types]


def get_adapter(model: PreTrainedModel) -> ArchitectureAdapter:
    """The adapter for ``model``, or a ValueError naming the supported architectures."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            adapter.check_supported(model)
            return adapter
    raise ValueError(
        f"hf_grow cannot grow {type(model).__name__} (model_type={model_type!r}); "
        f"supported model types: {', '.join(supported_model_types())}."
    )


__all__ = ["ArchitectureAdapter", "get_adapter", "scale_dims_after_growth", "supported_model_types"]
