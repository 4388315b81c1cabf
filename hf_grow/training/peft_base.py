"""The grown base model of a PEFT model, saved to resume a run past a growth: a PEFT model's checkpoints hold its
adapter alone, and its base model's own state dict holds the adapter's layers."""

from __future__ import annotations

import os

from torch import Tensor, nn


def save_grown_base(peft_model: nn.Module, folder: str | os.PathLike) -> None:
    """Save the base model inside ``peft_model``, grown as it is and without the adapter, to ``folder``.

    Resume with ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), checkpoint,
    is_trainable=True)``. ``peft_model.get_base_model().save_pretrained`` would save the adapter's layers
    (``base_layer``, ``lora_*``), whose modules do not load into the model (they came back random), and
    ``unload()`` puts the trained copies of ``modules_to_save`` in place of the frozen originals. Here each module
    an adapter wraps is saved under its own name from the module it wraps (`_wrapped`), without copying the model.
    """
    base = peft_model.get_base_model()
    # a merged adapter's delta sits in its base layer's weights: saved so, resuming would add it a second time
    merged = [name for name, module in base.named_modules() if getattr(module, "merged", None) is True]
    if merged:
        raise ValueError(f"the adapter is merged into {len(merged)} layers ({merged[0]}, ...): call "
                         "peft_model.unmerge_adapter() first, so that the base saved holds its own weights alone")
    state: dict[str, Tensor] = {}
    _collect_base_state(base, "", state)
    base.save_pretrained(folder, state_dict=state)


def _collect_base_state(module: nn.Module, prefix: str, state: dict[str, Tensor]) -> None:
    """``module``'s parameters and persistent buffers into ``state`` by name, those of the modules PEFT wrappers
    hold in place of the wrappers."""
    module = _wrapped(module)
    for name, tensor in module._parameters.items():
        if tensor is not None:
            state[prefix + name] = tensor.detach()
    for name, tensor in module._buffers.items():
        if tensor is not None and name not in module._non_persistent_buffers_set:
            state[prefix + name] = tensor
    for name, child in module._modules.items():
        if child is not None:
            _collect_base_state(child, f"{prefix}{name}.", state)


def _wrapped(module: nn.Module) -> nn.Module:
    """The module a PEFT wrapper holds (a tuner layer's base layer: LoRA, IA3, trainable tokens, ...; the original of
    `modules_to_save` and of trainable tokens' wrapper), or ``module`` where it is no wrapper."""
    while True:
        if callable(getattr(module, "get_base_layer", None)) and module.get_base_layer() is not module:
            module = module.get_base_layer()
        elif isinstance(getattr(module, "original_module", None), nn.Module):
            module = module.original_module
        else:
            return module
