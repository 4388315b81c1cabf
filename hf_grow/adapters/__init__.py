"""Architecture adapters, looked up by `config.model_type`.

Each adapter module's `ArchitectureAdapter` subclass registers itself when the module is imported below; the
import order is the lookup order and the order the supported model types are listed in.
"""

from __future__ import annotations

import sys
from typing import Any

from transformers import PreTrainedConfig, PreTrainedModel

from .gpt2 import GPT2Adapter
from .bert import BertAdapter
from .llama import LlamaAdapter
from .base import ArchitectureAdapter, scale_dims_after_growth


ADAPTERS: tuple[ArchitectureAdapter, ...] = tuple(adapter() for adapter in ArchitectureAdapter.registered)


def supported_model_types() -> list[str]:
    """The `config.model_type` values some adapter handles, in lookup order (for error messages)."""
    return [model_type for adapter in ADAPTERS for model_type in adapter.model_types]


def _adapter_for(model_type: str | None) -> ArchitectureAdapter | None:
    """The first adapter that handles ``model_type`` (lookup order), or None."""
    return next((adapter for adapter in ADAPTERS if model_type in adapter.model_types), None)


def position_limit(config: PreTrainedConfig) -> int | None:
    """The longest sequence a model of ``config`` can embed (`ArchitectureAdapter.position_limit`; None: any)."""
    adapter = _adapter_for(config.model_type)
    return getattr(config, "max_position_embeddings", None) if adapter is None else adapter.position_limit(config)


def is_sentence_transformer(model: Any) -> bool:
    """Whether ``model`` is a `sentence_transformers.SentenceTransformer` (without importing the package): a wrapper
    around a transformers model, which `get_adapter` refuses and `grow_model` and `push_to_hub` take whole."""
    package = sys.modules.get("sentence_transformers")
    return package is not None and isinstance(model, package.SentenceTransformer)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (peft imported: a PeftModel implies it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def get_adapter(model: PreTrainedModel) -> ArchitectureAdapter:
    """The adapter for ``model``, or a ValueError naming the supported architectures."""
    if is_sentence_transformer(model):
        raise ValueError(
            "a SentenceTransformer is taken whole by grow_model and push_to_hub only: pass its transformers model "
            "(model[0].auto_model), with hf_grow.SentenceLoss(loss) as loss_fn."
        )
    if is_peft_model(model):
        raise ValueError(
            f"{type(model).__name__} wraps PEFT adapters: pass the transformers model that is grown: for grow_model, "
            "the copy it grows, copy.deepcopy(peft_model).merge_and_unload() (.unload() with the adapters disabled); "
            "for grow_in_training and GrowthCallback, which grow it in place, peft_model.get_base_model()."
        )
    if isinstance(getattr(model, "_orig_mod", None), PreTrainedModel):  # torch.compile's wrapper
        raise ValueError(
            f"{type(model).__name__} is a compiled model: pass the model it compiles (model._orig_mod); grow_model "
            "and grow_in_training take the compiled one whole"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    adapter = _adapter_for(model_type)
    if adapter is None:
        raise ValueError(
            f"hf_grow cannot grow {type(model).__name__} (model_type={model_type!r}); "
            f"supported model types: {', '.join(supported_model_types())}."
        )
    adapter.check_supported(model)
    return adapter


__all__ = [
    "ArchitectureAdapter",
    "BertAdapter",
    "GPT2Adapter",
    "LlamaAdapter",
    "get_adapter",
    "is_peft_model",
    "is_sentence_transformer",
    "position_limit",
    "scale_dims_after_growth",
    "supported_model_types",
]
