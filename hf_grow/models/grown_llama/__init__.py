"""The grown Llama model type (config and modeling files are self-contained for trust_remote_code)."""

from .configuration_grown_llama import GrownLlamaConfig
from .modeling_grown_llama import (
    AUTO_MAP,
    GrownLlamaForCausalLM,
    GrownLlamaForQuestionAnswering,
    GrownLlamaForSequenceClassification,
    GrownLlamaForTokenClassification,
    GrownLlamaModel,
    GrownLlamaPreTrainedModel,
)


__all__ = [
    "AUTO_MAP",
    "GrownLlamaConfig",
    "GrownLlamaForCausalLM",
    "GrownLlamaForQuestionAnswering",
    "GrownLlamaForSequenceClassification",
    "GrownLlamaForTokenClassification",
    "GrownLlamaModel",
    "GrownLlamaPreTrainedModel",
]
