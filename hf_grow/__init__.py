"""hf_grow: widen the query/key dimension of attention heads with weights solved from first-order loss statistics.

Importing hf_grow registers the grown model types with the transformers Auto classes.
"""

from . import models
from .adapters import get_adapter, supported_model_types
from .config import GrowthConfig
from .growth import DEFAULT_TRUNCATION, evaluate_loss, grow_model
from .hub import model_card, push_to_hub
from .inspection import GrowthInspection, inspect_growth
from .report import GrowthReport, load_growth_report
from .sentence import SentenceLoss
from .statistics import GrowthStatistics, collect_statistics
from .training import GROWTH_MODES, GrowthCallback, grow_in_training, resize_qk_, to_grown_model


__version__ = "0.1.0"

#: The grown config and model classes (`hf_grow.models`' exports but the `*PreTrainedModel` base classes, which
#: stay in `hf_grow.models`): a new grown model package is exported without edits here.
_GROWN_CLASSES = [name for name in models.__all__ if not name.endswith("PreTrainedModel")]
globals().update({name: getattr(models, name) for name in _GROWN_CLASSES})

__all__ = [
    "DEFAULT_TRUNCATION",
    "GROWTH_MODES",
    "GrowthCallback",
    "GrowthConfig",
    "GrowthInspection",
    "GrowthReport",
    "GrowthStatistics",
    *_GROWN_CLASSES,
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
    "supported_model_types",
    "to_grown_model",
    "__version__",
]
