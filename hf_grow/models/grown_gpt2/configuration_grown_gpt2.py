# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""Configuration of a GPT-2 whose attention heads have their own query/key width.

This file is self-contained (transformers and its own dependency huggingface_hub only) so that it can be
copied next to a checkpoint and loaded with `trust_remote_code=True` where hf_grow is not installed.
"""

from huggingface_hub.dataclasses import strict
from transformers import GPT2Config


@strict
class GrownGPT2Config(GPT2Config):
    r"""
    A [`GPT2Config`] with a query/key head width per layer.

    qk_head_dims (`list[int]`, *optional*):
        Width of the query and key of every head, one entry per layer. Values keep `n_embd // n_head`, which
        stays the width of every value head. Defaults to `n_embd // n_head` in every layer (a plain GPT-2).

    The attention scale is `1 / sqrt(qk_head_dims[layer])` (when `scale_attn_weights`), further divided by
    `layer + 1` when `scale_attn_by_inverse_layer_idx`: the same rule as GPT-2, applied to the query/key width.
    """

    model_type = "grown_gpt2"
    qk_head_dims: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.qk_head_dims is None:
            self.qk_head_dims = [self.n_embd // self.n_head] * self.n_layer
        self.qk_head_dims = [int(dim) for dim in self.qk_head_dims]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation: one positive query/key width per layer, no cross-attention."""
        if len(self.qk_head_dims) != self.n_layer:
            raise ValueError(
                f"qk_head_dims has {len(self.qk_head_dims)} entries but the model has n_layer={self.n_layer} layers."
            )
        if any(dim <= 0 for dim in self.qk_head_dims):
            raise ValueError(f"Every entry of qk_head_dims must be positive, got {self.qk_head_dims}.")
        if self.add_cross_attention:
            raise ValueError("GrownGPT2Config does not support add_cross_attention=True.")


__all__ = ["GrownGPT2Config"]
