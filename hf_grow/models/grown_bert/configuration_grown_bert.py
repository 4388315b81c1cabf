# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""Configuration of a BERT whose attention heads have their own query/key width.

This file is self-contained (transformers and its own dependency huggingface_hub only) so that it can be
copied next to a checkpoint and loaded with `trust_remote_code=True` where hf_grow is not installed.
"""

from huggingface_hub.dataclasses import strict
from transformers import BertConfig


@strict
class GrownBertConfig(BertConfig):
    r"""
    A [`BertConfig`] with a query/key head width per layer.

    qk_head_dims (`list[int]`, *optional*):
        Width of the query and key of every head, one entry per layer. Values keep
        `hidden_size // num_attention_heads`, which stays the width of every value head. Defaults to that
        width in every layer (a plain BERT).

    attention_scale_dims (`list[int]`, *optional*):
        The width whose attention scale each layer keeps, one entry per layer: a growth that keeps the old scale
        (hf_grow's `keep_attention_scale`) records the old width here. `None` (default): every layer's scale
        follows its own query/key width.

    The attention scale is `1 / sqrt(attention_scale_dim(layer))`: BERT's rule, applied by default to the query/key
    width.
    """

    model_type = "grown_bert"
    qk_head_dims: list[int] | None = None
    attention_scale_dims: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.qk_head_dims is None:
            self.qk_head_dims = [self.hidden_size // self.num_attention_heads] * self.num_hidden_layers
        self.qk_head_dims = [int(dim) for dim in self.qk_head_dims]
        if self.attention_scale_dims is not None:
            self.attention_scale_dims = [int(dim) for dim in self.attention_scale_dims]
        super().__post_init__(**kwargs)

    @property
    def add_cross_attention(self) -> bool:
        """Always False: grown BERT layers are self-attention only."""
        return False

    @add_cross_attention.setter
    def add_cross_attention(self, value: bool) -> None:
        """Refuse cross-attention however it is asked for (constructor, attribute, saved config): the layers
        would be built without it and fail at the first `encoder_hidden_states`."""
        if value:
            raise ValueError(
                "GrownBertConfig does not support add_cross_attention=True: grown BERT layers are self-attention only. "
                "Leave add_cross_attention False, or use a plain BertConfig for a decoder that attends to an encoder."
            )

    def attention_scale_dim(self, layer: int) -> int:
        """The width whose attention scale `layer` takes: `attention_scale_dims[layer]`, else its query/key width."""
        return self.attention_scale_dims[layer] if self.attention_scale_dims else self.qk_head_dims[layer]

    def validate_architecture(self):
        """Part of `@strict` validation: one positive query/key width per layer."""
        super().validate_architecture()
        if len(self.qk_head_dims) != self.num_hidden_layers:
            raise ValueError(
                f"qk_head_dims has {len(self.qk_head_dims)} entries but the model has "
                f"num_hidden_layers={self.num_hidden_layers} layers."
            )
        if any(dim <= 0 for dim in self.qk_head_dims):
            raise ValueError(f"Every entry of qk_head_dims must be positive, got {self.qk_head_dims}.")
        scale_dims = self.attention_scale_dims
        layers = self.num_hidden_layers
        if scale_dims is not None and (len(scale_dims) != layers or any(dim <= 0 for dim in scale_dims)):
            raise ValueError(
                f"attention_scale_dims must hold one positive width per layer ({layers} layers), got "
                f"{scale_dims}."
            )


__all__ = ["GrownBertConfig"]
