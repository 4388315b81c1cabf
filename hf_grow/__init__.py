"""hf_grow: widen the query/key dimension of attention heads with weights solved from first-order loss statistics.

Importing hf_grow registers the grown model types with the transformers Auto classes.
"""

from .adapters import get_adapter, supported_model_types
from .config import GrowthConfig
from .growth import DEFAULT_TRUNCATION, evaluate_loss, grow_model
from .card import model_card
from .hub import push_to_hub
from .inspection import GrowthInspection, inspect_growth
# Written out, not built from `hf_grow.models` at import, so that editors and type checkers see them
# (tests/test_layout.py checks that every grown package's classes are here).
from .models import (
    GrownBertConfig,
    GrownBertForMaskedLM,
    GrownBertForMultipleChoice,
    GrownBertForPreTraining,
    GrownBertForQuestionAnswering,
    GrownBertForSequenceClassification,
    GrownBertForTokenClassification,
    GrownBertLMHeadModel,
    GrownBertModel,
    GrownGPT2Config,
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownLlamaConfig,
    GrownLlamaForCausalLM,
    GrownLlamaForQuestionAnswering,
    GrownLlamaForSequenceClassification,
    GrownLlamaForTokenClassification,
    GrownLlamaModel,
)
from .report import GrowthReport, load_growth_report
from .sentence import SentenceLoss
from .statistics import GrowthStatistics, collect_statistics
from .training import GROWTH_MODES, GrowthCallback, grow_in_training, resize_qk_, save_grown_base, to_grown_model
from .version import __version__


__all__ = [
    "DEFAULT_TRUNCATION",
    "GROWTH_MODES",
    "GrowthCallback",
    "GrowthConfig",
    "GrowthInspection",
    "GrowthReport",
    "GrowthStatistics",
    "GrownBertConfig",
    "GrownBertForMaskedLM",
    "GrownBertForMultipleChoice",
    "GrownBertForPreTraining",
    "GrownBertForQuestionAnswering",
    "GrownBertForSequenceClassification",
    "GrownBertForTokenClassification",
    "GrownBertLMHeadModel",
    "GrownBertModel",
    "GrownGPT2Config",
    "GrownGPT2DoubleHeadsModel",
    "GrownGPT2ForQuestionAnswering",
    "GrownGPT2ForSequenceClassification",
    "GrownGPT2ForTokenClassification",
    "GrownGPT2LMHeadModel",
    "GrownGPT2Model",
    "GrownLlamaConfig",
    "GrownLlamaForCausalLM",
    "GrownLlamaForQuestionAnswering",
    "GrownLlamaForSequenceClassification",
    "GrownLlamaForTokenClassification",
    "GrownLlamaModel",
    "SentenceLoss",
    "collect_statistics",
    "evaluate_loss",
    "get_adapter",
    "grow_in_training",
    "grow_model",
    "inspect_growth",
    "load_growth_report",
    "model_card",
    "push_to_hub",
    "resize_qk_",
    "save_grown_base",
    "supported_model_types",
    "to_grown_model",
    "__version__",
]
