"""The grown BERT model type (config and modeling files are self-contained for trust_remote_code)."""

from .configuration_grown_bert import GrownBertConfig
from .modeling_grown_bert import (
    AUTO_MAP,
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


__all__ = [
    "AUTO_MAP",
    "GrownBertConfig",
    "GrownBertForMaskedLM",
    "GrownBertForMultipleChoice",
    "GrownBertForPreTraining",
    "GrownBertForQuestionAnswering",
    "GrownBertForSequenceClassification",
    "GrownBertForTokenClassification",
    "GrownBertLMHeadModel",
    "GrownBertModel",
    "GrownBertPreTrainedModel",
]
