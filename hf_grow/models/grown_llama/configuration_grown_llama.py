# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""Configuration of a Llama whose attention heads carry unrotated "content" query/key dims beside the rotary ones.

This file is self-contained (torch, transformers and its dependency huggingface_hub only) so that it can be
copied next to a checkpoint and loaded with `trust_remote_code=True` where hf_grow is not installed.
"""

import torch
from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, DynamicLayer, StaticLayer


class GrownStaticLayer(StaticLayer):
    """A `StaticLayer` whose keys are `key_head_dim` wide, whatever width it is first initialized with.

    transformers allocates static caches ahead of time (`early_initialization`, for chunked prefill and for
    `torch.export`) from one head width for keys and values, the value width; grown keys are wider.
    """

    key_head_dim: int

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        key_states = key_states.new_empty((*key_states.shape[:-1], self.key_head_dim))
        super().lazy_initialization(key_states, value_states)


def cache_layer_type(key_head_dim: int, value_head_dim: int) -> str:
    """The layer type from which transformers' caches build the cache of a layer with these key and value widths.

    `full_attention` where they are equal; else `grown_attention_qk{key_head_dim}`, whose static and dynamic cache
    layer classes are registered here on first use (`CacheLayerMixin` files subclasses that set `_layer_type` in
    transformers' layer type mappings).
    """
    if key_head_dim == value_head_dim:
        return "full_attention"
    layer_type = f"grown_attention_qk{key_head_dim}"
    if layer_type not in STATIC_LAYER_TYPE_MAPPING:
        for name, base, attributes in (
            (f"GrownStaticLayerQK{key_head_dim}", GrownStaticLayer, {"key_head_dim": key_head_dim}),
            (f"GrownDynamicLayerQK{key_head_dim}", DynamicLayer, {}),
        ):
            # named in this module, where pickle looks a cache's layer classes up (`__getattr__` below)
            attributes = {**attributes, "_layer_type": layer_type, "__module__": __name__, "__qualname__": name}
            globals()[name] = type(name, (base,), attributes)
    return layer_type


def __getattr__(name: str) -> type:
    """A cache layer class of `cache_layer_type` by its name, made where this process has not yet made it: a
    pickled cache (`torch.save` of a model's outputs) loads in a fresh process."""
    kind, _, width = name.removeprefix("Grown").partition("LayerQK")
    if kind not in ("Static", "Dynamic") or not width.isdigit():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    layer_type = cache_layer_type(int(width), -1)  # made here, or already by another grown model's module
    return (STATIC_LAYER_TYPE_MAPPING if kind == "Static" else DYNAMIC_LAYER_TYPE_MAPPING)[layer_type]


def check_given_layer_types(config_name: str, types: list[str] | None) -> None:
    """Layer types given to a grown config, which derives its own from its widths (`cache_layer_type`): a loading
    call may pass a source's (README's Qwen2 recipe, all "full_attention"), ignored; any other type is refused, as
    grown models run full attention."""
    if types is not None and any(kind != "full_attention" and not kind.startswith("grown_attention_qk")
                                 for kind in types):
        raise ValueError(
            f"{config_name} takes full attention layers only, not layer_types {sorted(set(types))}: it derives "
            "layer_types from qk_head_dims (leave the argument out)."
        )


@strict
class GrownLlamaConfig(LlamaConfig):
    r"""
    A [`LlamaConfig`] whose query/key heads hold `head_dim` rotary dims plus a per-layer number of content dims.

    qk_nope_dims (`list[int]`, *optional*):
        Query/key dims per head that carry no rotary position embedding ("NoPE" or content dims, as DeepSeek-V3's
        `qk_nope_head_dim`), one entry per layer, after the `head_dim` rotary dims of each head. Values keep
        `head_dim` dims. Defaults to 0 in every layer (a plain Llama).
    qkv_bias (`bool`, *optional*):
        Whether the query, key and value projections have a bias; `None` (default) follows `attention_bias`,
        as Llama does. Qwen2 checkpoints set it to `True` with `attention_bias=False` (no output bias).

    attention_scale_dims (`list[int]`, *optional*):
        The width whose attention scale each layer keeps, one entry per layer: a growth that keeps the old scale
        (hf_grow's `keep_attention_scale`) records the old width here. `None` (default): every layer's scale
        follows its own query/key width.

    The attention scale is `1 / sqrt(attention_scale_dim(layer))`, by default `1 / sqrt(head_dim +
    qk_nope_dims[layer])`: Llama's rule applied to the query/key width.
    `qk_head_dims` (read and set) is that width per layer.
    """

    model_type = "grown_llama"
    qk_nope_dims: list[int] | None = None
    qkv_bias: bool | None = None
    attention_scale_dims: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.qk_nope_dims is None:
            self.qk_nope_dims = [0] * self.num_hidden_layers
        self.qk_nope_dims = [int(dim) for dim in self.qk_nope_dims]
        if self.attention_scale_dims is not None:
            self.attention_scale_dims = [int(dim) for dim in self.attention_scale_dims]
        super().__post_init__(**kwargs)

    @property
    def qk_head_dims(self) -> list[int]:
        """Query/key width of the heads of each layer: the rotary `head_dim` plus the layer's content dims."""
        return [self.head_dim + dim for dim in self.qk_nope_dims]

    @qk_head_dims.setter
    def qk_head_dims(self, dims: list[int]) -> None:
        self.qk_nope_dims = [int(dim) - self.head_dim for dim in dims]

    @property
    def layer_types(self) -> list[str]:
        """Each layer's cache layer type (`cache_layer_type`): how transformers' caches learn its key width."""
        return [cache_layer_type(dim, self.head_dim) for dim in self.qk_head_dims]

    @layer_types.setter
    def layer_types(self, types: list[str] | None) -> None:
        """Derived from the widths, so not set (`check_given_layer_types`)."""
        check_given_layer_types(type(self).__name__, types)

    def validate_layer_type(self):
        """Part of `@strict` validation, replaced: `layer_types` is derived from the widths, so it is valid, but
        transformers' check allows only its own layer types and would refuse the grown ones."""

    def attention_scale_dim(self, layer: int) -> int:
        """The width whose attention scale `layer` takes: `attention_scale_dims[layer]`, else its query/key width."""
        return self.attention_scale_dims[layer] if self.attention_scale_dims else self.qk_head_dims[layer]

    def validate_architecture(self):
        """Part of `@strict` validation: Llama's checks, and one non-negative content width per layer."""
        super().validate_architecture()
        if len(self.qk_nope_dims) != self.num_hidden_layers:
            raise ValueError(
                f"qk_nope_dims has {len(self.qk_nope_dims)} entries but the model has "
                f"num_hidden_layers={self.num_hidden_layers} layers."
            )
        if any(dim < 0 for dim in self.qk_nope_dims):
            raise ValueError(f"Every entry of qk_nope_dims must be >= 0, got {self.qk_nope_dims}.")
        scale_dims = self.attention_scale_dims
        layers = self.num_hidden_layers
        if scale_dims is not None and (len(scale_dims) != layers or any(dim <= 0 for dim in scale_dims)):
            raise ValueError(
                f"attention_scale_dims must hold one positive width per layer ({layers} layers), got "
                f"{scale_dims}."
            )


__all__ = ["GrownLlamaConfig"]
