"""BERT: Q/K live in the ``query`` and ``key`` Linear layers of each layer's ``attention.self``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from transformers import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    PreTrainedConfig,
    PreTrainedModel,
)

from ..models.grown_bert import (
    GrownBertConfig,
    GrownBertForMaskedLM,
    GrownBertForMultipleChoice,
    GrownBertForPreTraining,
    GrownBertForQuestionAnswering,
    GrownBertForSequenceClassification,
    GrownBertForTokenClassification,
    GrownBertLMHeadModel,
    GrownBertModel,
    GrownBertPreTrainedModel,
)
from .base import ArchitectureAdapter, merge_heads, split_heads


class BertAdapter(ArchitectureAdapter):
    model_types = ("bert", "grown_bert")
    grown_config_class = GrownBertConfig
    grown_base_class = GrownBertPreTrainedModel
    grown_classes = {
        BertModel: GrownBertModel,
        BertForPreTraining: GrownBertForPreTraining,
        BertLMHeadModel: GrownBertLMHeadModel,
        BertForMaskedLM: GrownBertForMaskedLM,
        BertForSequenceClassification: GrownBertForSequenceClassification,
        BertForMultipleChoice: GrownBertForMultipleChoice,
        BertForTokenClassification: GrownBertForTokenClassification,
        BertForQuestionAnswering: GrownBertForQuestionAnswering,
    }

    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        return [layer.attention.self for layer in model.base_model.encoder.layer]

    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        return attention.query

    def read_qk(self, attention: nn.Module, source: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        heads = attention.num_attention_heads
        source = source or dict(attention.named_parameters())
        augmented = []
        for name in ("query", "key"):
            weight = source[f"{name}.weight"].detach().to(torch.float64)
            augmented.append(split_heads(weight.mT, source[f"{name}.bias"].detach().to(torch.float64), heads))
        return augmented[0], augmented[1]

    def qk_parameters(
        self, attention: nn.Module, query: Tensor, key: Tensor, source: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        source = source or dict(attention.named_parameters())
        parameters = {}
        for name, augmented in (("query", query), ("key", key)):
            weight, bias = merge_heads(augmented)
            parameters[f"{name}.weight"] = weight.mT.to(source[f"{name}.weight"]).contiguous()
            parameters[f"{name}.bias"] = bias.to(source[f"{name}.bias"])
        return parameters

    def qk_parameter_names(self, attention: nn.Module) -> list[str]:
        return ["query.weight", "query.bias", "key.weight", "key.bias"]

    def set_qk_head_dim(
        self, attention: nn.Module, config: PreTrainedConfig, layer: int, qk_head_dim: int, scale_dim: int
    ) -> None:
        attention.qk_head_dim = qk_head_dim
        attention.scaling = self.scaling(config, layer, scale_dim)
        attention.query.out_features = attention.key.out_features = attention.num_attention_heads * qk_head_dim

    def grown_init_kwargs(self, model: PreTrainedModel) -> dict:
        if isinstance(model, BertModel):
            return {"add_pooling_layer": model.pooler is not None}
        return {}

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        return isinstance(model, BertLMHeadModel)
