"""BERT: Q/K live in the ``query`` and ``key`` Linear layers of each layer's ``attention.self``."""

from __future__ import annotations

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

    def read_qk(self, attention: nn.Module) -> tuple[Tensor, Tensor]:
        heads = attention.num_attention_heads
        augmented = []
        for projection in (attention.query, attention.key):
            weight = projection.weight.detach().to(torch.float64)
            augmented.append(split_heads(weight.mT, projection.bias.detach().to(torch.float64), heads))
        return augmented[0], augmented[1]

    def qk_parameters(self, attention: nn.Module, query: Tensor, key: Tensor) -> dict[str, Tensor]:
        parameters = {}
        for name, augmented in (("query", query), ("key", key)):
            old = getattr(attention, name)
            weight, bias = merge_heads(augmented)
            parameters[f"{name}.weight"] = weight.mT.to(old.weight).contiguous()
            parameters[f"{name}.bias"] = bias.to(old.bias)
        return parameters

    def grown_init_kwargs(self, model: PreTrainedModel) -> dict:
        if isinstance(model, BertModel):
            return {"add_pooling_layer": model.pooler is not None}
        return {}

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        return isinstance(model, BertLMHeadModel)
