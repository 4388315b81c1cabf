"""Llama family (Llama, Mistral, Qwen2): Q/K live in the ``q_proj`` and ``k_proj`` Linear layers of each layer's
``self_attn``, with rotary position embeddings and grouped-query attention.

Rotary embeddings rotate each head's `head_dim` query/key dims by position, so their scores are no position-free
bilinear form of the layer input and cannot be refactored; growth appends unrotated content dims after them
(`GrownLlamaConfig.qk_nope_dims`), whose scores are X Q_i K_g^T X^T. The key heads of a group are shared by its
`num_attention_heads // num_key_value_heads` query heads: augmented keys have `num_key_value_heads` heads.
Without Q/K biases (Llama, Mistral) the weights have no bias row, and the statistics' ones column is unused.

Mistral (without a sliding window) and Qwen2 (Q/K/V biases, no output bias; without sliding-window layers) use
Llama's modules under the same parameter names, and grow into the same grown Llama type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers import (
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    MistralForCausalLM,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)

from ..models.grown_llama import (
    GrownLlamaConfig,
    GrownLlamaForCausalLM,
    GrownLlamaForQuestionAnswering,
    GrownLlamaForSequenceClassification,
    GrownLlamaForTokenClassification,
    GrownLlamaModel,
    GrownLlamaPreTrainedModel,
)
from .base import ArchitectureAdapter, merge_heads, split_heads
from .building import CONFIG_KEYS_NOT_INHERITED, attention_scale_entry


def _head_dim(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAdapter(ArchitectureAdapter):
    model_types = ("llama", "mistral", "qwen2", "grown_llama")
    growth_modes = ("append",)
    grown_config_class = GrownLlamaConfig
    grown_base_class = GrownLlamaPreTrainedModel
    # MistralForQuestionAnswering keeps its body under ``model``, not Llama's ``transformer``: not mapped
    grown_classes = {
        LlamaModel: GrownLlamaModel,
        LlamaForCausalLM: GrownLlamaForCausalLM,
        LlamaForSequenceClassification: GrownLlamaForSequenceClassification,
        LlamaForTokenClassification: GrownLlamaForTokenClassification,
        LlamaForQuestionAnswering: GrownLlamaForQuestionAnswering,
        MistralModel: GrownLlamaModel,
        MistralForCausalLM: GrownLlamaForCausalLM,
        MistralForSequenceClassification: GrownLlamaForSequenceClassification,
        MistralForTokenClassification: GrownLlamaForTokenClassification,
        Qwen2Model: GrownLlamaModel,
        Qwen2ForCausalLM: GrownLlamaForCausalLM,
        Qwen2ForSequenceClassification: GrownLlamaForSequenceClassification,
        Qwen2ForTokenClassification: GrownLlamaForTokenClassification,
        Qwen2ForQuestionAnswering: GrownLlamaForQuestionAnswering,
    }
    refused_mode_reason = (
        "rotary position embeddings rotate the existing query/key dims by position, so their scores are no "
        "position-free bilinear form to rewrite"
    )

    def position_limit(self, config: PreTrainedConfig) -> None:
        """Rotary positions are computed for any length: ``max_position_embeddings`` is the trained context, not a
        table's size (and rope scaling exists to run past it)."""
        return None

    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        return [layer.self_attn for layer in model.base_model.layers]

    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        return attention.q_proj

    def num_key_value_heads(self, config: PreTrainedConfig) -> int:
        return config.num_key_value_heads or config.num_attention_heads

    def qk_head_dims(self, config: PreTrainedConfig) -> list[int]:
        nope = getattr(config, "qk_nope_dims", None) or [0] * config.num_hidden_layers
        return [_head_dim(config) + dim for dim in nope]

    def read_qk(self, attention: nn.Module, source: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        config = attention.config
        source = source or dict(attention.named_parameters())
        heads = {"q_proj": config.num_attention_heads, "k_proj": self.num_key_value_heads(config)}
        weights = []
        for name, num_heads in heads.items():
            bias = source.get(f"{name}.bias")
            weight = source[f"{name}.weight"].detach().to(torch.float64, copy=True)  # a copy even in float64
            weights.append(split_heads(weight.mT, None if bias is None else bias.detach().to(torch.float64), num_heads))
        return weights[0], weights[1]

    def qk_parameters(
        self, attention: nn.Module, query: Tensor, key: Tensor, source: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        source = source or dict(attention.named_parameters())
        parameters = {}
        for name, weights in (("q_proj", query), ("k_proj", key)):
            has_bias = f"{name}.bias" in source
            columns, bias = merge_heads(weights, has_bias)
            parameters[f"{name}.weight"] = columns.mT.contiguous().to(source[f"{name}.weight"])
            if has_bias:
                parameters[f"{name}.bias"] = bias.to(source[f"{name}.bias"])
        return parameters

    def qk_parameter_names(self, attention: nn.Module) -> list[str]:
        # the weights always (a wrapped projection, e.g. PEFT's LoRA, lacks them: refused by name), biases where the
        # projections have them (Qwen2, attention_bias=True)
        return [
            name
            for projection in ("q_proj", "k_proj")
            for name in (f"{projection}.weight", f"{projection}.bias")
            if name.endswith("weight") or getattr(getattr(attention, projection), "bias", None) is not None
        ]

    def set_qk_head_dim(
        self, attention: nn.Module, config: PreTrainedConfig, layer: int, qk_head_dim: int, scale_dim: int
    ) -> None:
        attention.qk_head_dim = qk_head_dim
        attention.qk_nope_dim = qk_head_dim - attention.head_dim
        attention.scaling = self.scaling(config, layer, scale_dim)
        attention.q_proj.out_features = config.num_attention_heads * qk_head_dim
        attention.k_proj.out_features = self.num_key_value_heads(config) * qk_head_dim

    def grown_config(
        self, config: PreTrainedConfig, qk_head_dims: Sequence[int], attention_scale_dims: Sequence[int] | None = None
    ) -> PreTrainedConfig:
        skipped = (*CONFIG_KEYS_NOT_INHERITED, "qk_nope_dims", "qkv_bias", "head_dim")
        inherited = {k: v for k, v in config.to_dict().items() if k not in skipped}
        head_dim = _head_dim(config)
        qkv_bias = getattr(config, "qkv_bias", None)
        if config.model_type == "qwen2":  # biases on Q/K/V, none on the output projection
            inherited["attention_bias"], qkv_bias = False, True
        return self.grown_config_class(
            **inherited,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            qk_nope_dims=[dim - head_dim for dim in qk_head_dims],
            attention_scale_dims=attention_scale_entry(qk_head_dims, attention_scale_dims),
        )

    def check_supported(self, model: PreTrainedModel) -> None:
        config = model.config
        if getattr(config, "sliding_window", None) is not None and (
            config.model_type == "mistral" or "sliding_attention" in (getattr(config, "layer_types", None) or [])
        ):
            raise ValueError(
                f"{type(model).__name__} uses sliding-window attention (sliding_window={config.sliding_window}), "
                "which the grown Llama type does not implement: grow a model loaded without it (a Mistral with "
                "from_pretrained(..., sliding_window=None), a Qwen2 with from_pretrained(..., use_sliding_window="
                "False, layer_types=['full_attention'] * num_hidden_layers); for hf-grow, save it so loaded and give "
                "the command its folder), whose function differs on sequences longer than the window."
            )
        super().check_supported(model)

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        return isinstance(model, (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM))
