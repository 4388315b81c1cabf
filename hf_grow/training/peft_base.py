"""The grown base model of a PEFT model, saved to resume a run past a growth: a PEFT model's checkpoints hold its
adapter alone, and its base model's own state dict holds the adapter's layers."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn


def save_grown_base(peft_model: nn.Module, folder: str | os.PathLike) -> None:
    """Save the base model inside ``peft_model``, grown as it is and without the adapter, to ``folder``.

    Resume with ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), checkpoint,
    is_trainable=True)``. ``peft_model.get_base_model().save_pretrained`` would save the adapter's layers
    (``base_layer``, ``lora_*``), whose modules do not load into the model (they came back random), and
    ``unload()`` puts the trained copies of ``modules_to_save`` in place of the frozen originals. Here each wrapped
    module is saved under its own name from the weights the adapter wraps, without copying the model.
    """
    base = peft_model.get_base_model()
    with torch.device("meta"):
        names = set(type(base)(copy.deepcopy(base.config)).state_dict())
    state = {}
    for key, value in base.state_dict().items():
        name = key.replace(".base_layer.", ".").replace(".original_module.", ".")
        if name in names and ".modules_to_save." not in key:
            state[name] = value
    missing = sorted(names - set(state))
    if missing:
        raise ValueError(
            f"cannot find the base weights {missing[:3]} in {type(peft_model).__name__}: its adapter wraps them in a "
            "way this does not know; save peft_model.merge_and_unload() instead (the adapter merged in)"
        )
    base.save_pretrained(folder, state_dict=state)
