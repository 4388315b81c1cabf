"""The grown GPT-2 model type (config and modeling files are self-contained for trust_remote_code)."""

from .configuration_grown_gpt2 import GrownGPT2Config
from .modeling_grown_gpt2 import (
    AUTO_MAP,
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownGPT2PreTrainedModel,
)


__all__ = [
    "AUTO_MAP",
    "GrownGPT2Config",
    "GrownGPT2DoubleHeadsModel",
    "GrownGPT2ForQuestionAnswering",
    "GrownGPT2ForSequenceClassification",
    "GrownGPT2ForTokenClassification",
    "GrownGPT2LMHeadModel",
    "GrownGPT2Model",
    "GrownGPT2PreTrainedModel",
]
