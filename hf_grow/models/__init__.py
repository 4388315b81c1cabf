"""Grown model types, registered with the transformers Auto classes when hf_grow is imported."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .grown_gpt2 import (
    GrownGPT2Config,
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownGPT2PreTrainedModel,
)


def _register() -> None:
    AutoConfig.register(GrownGPT2Config.model_type, GrownGPT2Config, exist_ok=True)
    for auto_class, model_class in (
        (AutoModel, GrownGPT2Model),
        (AutoModelForCausalLM, GrownGPT2LMHeadModel),
        (AutoModelForSequenceClassification, GrownGPT2ForSequenceClassification),
        (AutoModelForTokenClassification, GrownGPT2ForTokenClassification),
        (AutoModelForQuestionAnswering, GrownGPT2ForQuestionAnswering),
    ):
        auto_class.register(GrownGPT2Config, model_class, exist_ok=True)


_register()

__all__ = [
    "GrownGPT2Config",
    "GrownGPT2DoubleHeadsModel",
    "GrownGPT2ForQuestionAnswering",
    "GrownGPT2ForSequenceClassification",
    "GrownGPT2ForTokenClassification",
    "GrownGPT2LMHeadModel",
    "GrownGPT2Model",
    "GrownGPT2PreTrainedModel",
]
