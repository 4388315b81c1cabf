"""GPT-2: Q/K live in the fused ``c_attn`` Conv1D of each block, as ``[queries | keys | values]`` columns."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from transformers import (
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    PreTrainedConfig,
    PreTrainedModel,
)

from ..models.grown_gpt2 import (
    GrownGPT2Config,
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownGPT2PreTrainedModel,
)
from .base import ArchitectureAdapter, merge_heads, split_heads


def _qk_width(attention: nn.Module) -> int:
    return attention.num_heads * getattr(attention, "qk_head_dim", attention.head_dim)


class GPT2Adapter(ArchitectureAdapter):
    model_types = ("gpt2", "grown_gpt2")
    grown_config_class = GrownGPT2Config
    grown_base_class = GrownGPT2PreTrainedModel
    grown_classes = {
        GPT2Model: GrownGPT2Model,
        GPT2LMHeadModel: GrownGPT2LMHeadModel,
        GPT2DoubleHeadsModel: GrownGPT2DoubleHeadsModel,
        GPT2ForSequenceClassification: GrownGPT2ForSequenceClassification,
        GPT2ForTokenClassification: GrownGPT2ForTokenClassification,
        GPT2ForQuestionAnswering: GrownGPT2ForQuestionAnswering,
    }

    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        return [block.attn for block in model.base_model.h]

    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        return attention.c_attn

    def scaling(self, config: PreTrainedConfig, layer: int, scale_dim: int) -> float:
        scaling = scale_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer + 1)
        return scaling

    def read_qk(self, attention: nn.Module, source: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        width = _qk_width(attention)
        source = source or dict(attention.named_parameters())
        weight = source["c_attn.weight"].detach().to(torch.float64)
        bias = source["c_attn.bias"].detach().to(torch.float64)
        query = split_heads(weight[:, :width], bias[:width], attention.num_heads)
        key = split_heads(weight[:, width : 2 * width], bias[width : 2 * width], attention.num_heads)
        return query, key

    def qk_parameters(
        self, attention: nn.Module, query: Tensor, key: Tensor, source: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        source = source or dict(attention.named_parameters())
        old_weight, old_bias = source["c_attn.weight"].detach(), source["c_attn.bias"].detach()
        values = slice(2 * _qk_width(attention), None)
        (query_weight, query_bias), (key_weight, key_bias) = merge_heads(query), merge_heads(key)
        weight = torch.cat([query_weight.to(old_weight), key_weight.to(old_weight), old_weight[:, values]], dim=1)
        bias = torch.cat([query_bias.to(old_bias), key_bias.to(old_bias), old_bias[values]])
        return {"c_attn.weight": weight, "c_attn.bias": bias}

    def qk_parameter_names(self, attention: nn.Module) -> list[str]:
        return ["c_attn.weight", "c_attn.bias"]

    def set_qk_head_dim(
        self, attention: nn.Module, config: PreTrainedConfig, layer: int, qk_head_dim: int, scale_dim: int
    ) -> None:
        attention.qk_head_dim = qk_head_dim
        attention.split_size = [attention.num_heads * qk_head_dim] * 2 + [attention.embed_dim]
        attention.scaling = self.scaling(config, layer, scale_dim)
        attention.c_attn.nf = sum(attention.split_size)

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        return isinstance(model, (GPT2LMHeadModel, GPT2DoubleHeadsModel))
