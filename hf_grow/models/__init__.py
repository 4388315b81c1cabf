"""Grown model types, registered with the transformers Auto classes when hf_grow is imported.

Each `grown_*` package here (a self-contained config file, modeling file and, for decoders, paged-cache file) is
found by name and registered: each exports ``AUTO_MAP``, the Auto classes its checkpoints declare for
`trust_remote_code`, and the same table registers them here, so that checkpoints load with the plain Auto classes
wherever hf_grow is imported. The packages' classes are re-exported here, written out (a new package's must be
added; tests/test_layout.py names any left out).
"""

import importlib
import pkgutil
from types import ModuleType

import transformers

# Written out, not built at import, so that editors and type checkers see them.
from .grown_bert import (
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
from .grown_llama import (
    GrownLlamaConfig,
    GrownLlamaForCausalLM,
    GrownLlamaForQuestionAnswering,
    GrownLlamaForSequenceClassification,
    GrownLlamaForTokenClassification,
    GrownLlamaModel,
    GrownLlamaPreTrainedModel,
)


#: The `grown_*` packages, in name order.
GROWN_PACKAGES: tuple[ModuleType, ...] = tuple(
    importlib.import_module(f"{__name__}.{module.name}")
    for module in pkgutil.iter_modules(__path__)
    if module.ispkg and module.name.startswith("grown_")
)


def _register(package: ModuleType) -> None:
    classes = {
        auto_name: getattr(package, reference.split(".")[-1]) for auto_name, reference in package.AUTO_MAP.items()
    }
    config_class = classes.pop("AutoConfig")
    transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for auto_name, model_class in classes.items():
        getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)


for _package in GROWN_PACKAGES:
    _register(_package)

__all__ = [
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
    "GrownGPT2Config",
    "GrownGPT2DoubleHeadsModel",
    "GrownGPT2ForQuestionAnswering",
    "GrownGPT2ForSequenceClassification",
    "GrownGPT2ForTokenClassification",
    "GrownGPT2LMHeadModel",
    "GrownGPT2Model",
    "GrownGPT2PreTrainedModel",
    "GrownLlamaConfig",
    "GrownLlamaForCausalLM",
    "GrownLlamaForQuestionAnswering",
    "GrownLlamaForSequenceClassification",
    "GrownLlamaForTokenClassification",
    "GrownLlamaModel",
    "GrownLlamaPreTrainedModel",
]
