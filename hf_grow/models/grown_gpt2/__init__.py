from .configuration_grown_gpt2 import GrownGPT2Config
from .modeling_grown_gpt2 import (
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownGPT2PreTrainedModel,
)
