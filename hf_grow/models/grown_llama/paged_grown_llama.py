# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""Continuous batching (`generate_batch`, `transformers serve`) of a grown Llama whose keys are wider than values.

transformers' `PagedAttentionCache` stores the keys and values of every layer in pages of one head width, read
from the config (`config.head_dim`), and groups the layers by `config.layer_types`, knowing only "full_attention"
and "sliding_attention"; a grown config names a layer type per key width (for static caches). So the manager is
given the model through `PagedModelView`, whose config (`PagedCacheConfig`) has every layer full attention and one
head width wide enough for every layer's keys and values, and the attention zero-pads keys and values to that
width before writing them and reads them back at their own widths (`update_paged_cache`): the scores and outputs
are unchanged, the cost is the padding in the cache.

Like the modeling file, this file imports only torch and transformers (`trust_remote_code`).
"""

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation.continuous_batching import PagedAttentionCache


def cache_head_dim(config: PreTrainedConfig) -> int:
    """The head width of the paged cache: the widest query/key head of any layer, or the value width if wider."""
    return max(config.head_dim, *config.qk_head_dims)


def update_paged_cache(
    cache: PagedAttentionCache,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    layer_idx: int,
    width: int,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cache.update` with keys and values zero-padded to the cache's head `width`, the keys and values of the layer
    (cached and new) returned at their own widths. Zero columns add nothing to query-key products and are dropped."""
    key_dim, value_dim = key_states.shape[-1], value_states.shape[-1]
    key_states, value_states = (
        torch.nn.functional.pad(states, (0, width - states.shape[-1])) if states.shape[-1] < width else states
        for states in (key_states, value_states)
    )
    key_states, value_states = cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    return key_states[..., :key_dim], value_states[..., :value_dim]


class PagedCacheConfig:
    """The config as transformers' paged cache should read it: every layer "full_attention" and `head_dim` the
    cache's width (`cache_head_dim`); every other attribute is read from the config itself, when it is read, so the
    attention implementation continuous batching switches to is seen."""

    def __init__(self, config: PreTrainedConfig):
        self._config = config
        self.head_dim = cache_head_dim(config)
        self.layer_types = ["full_attention"] * config.num_hidden_layers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> "PagedCacheConfig":
        return self


class PagedModelView:
    """The model as transformers' continuous batching manager is given it: its `config` is the `PagedCacheConfig`,
    and every other attribute, attribute assignment and call is the model's (so the forward passes run the model).
    The manager keeps what `model.eval()` returns, hence `eval` returns the view."""

    def __init__(self, model: PreTrainedModel):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "config", PagedCacheConfig(model.config))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)

    def __call__(self, *args, **kwargs) -> Any:
        return self._model(*args, **kwargs)

    def eval(self) -> "PagedModelView":
        self._model.eval()
        return self
