# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""BERT whose attention heads have a query/key width of their own, per layer.

Everything except the query and key projections is BERT as shipped by transformers: the classes below
subclass the BERT classes and only build a `GrownBertModel` backbone whose self-attention projects queries
and keys to `config.qk_head_dims[layer]` dimensions per head (values keep `hidden_size // num_attention_heads`).
All `forward` methods except the self-attention's are inherited unchanged, so losses, masks, pooling and
outputs behave exactly as in BERT.

This file imports only torch and transformers, so that `save_pretrained` can copy it next to the weights and
people without hf_grow can load the checkpoint with `trust_remote_code=True`.
"""

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.generation import GenerationConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertEmbeddings,
    BertEncoder,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertIntermediate,
    BertLayer,
    BertLMHeadModel,
    BertModel,
    BertOnlyMLMHead,
    BertOutput,
    BertPooler,
    BertPreTrainedModel,
    BertPreTrainingHeads,
    BertSelfOutput,
    eager_attention_forward,
)
from transformers.utils import hub as transformers_hub

from .configuration_grown_bert import GrownBertConfig


#: `push_to_hub`'s options that `save_pretrained(push_to_hub=True, ...)` passes on to it.
_PUSH_KWARGS = ("commit_message", "commit_description", "private", "revision", "create_pr", "tags")

AUTO_MAP = {
    "AutoConfig": "configuration_grown_bert.GrownBertConfig",
    "AutoModel": "modeling_grown_bert.GrownBertModel",
    "AutoModelForPreTraining": "modeling_grown_bert.GrownBertForPreTraining",
    "AutoModelForMaskedLM": "modeling_grown_bert.GrownBertForMaskedLM",
    "AutoModelForCausalLM": "modeling_grown_bert.GrownBertLMHeadModel",
    "AutoModelForSequenceClassification": "modeling_grown_bert.GrownBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_grown_bert.GrownBertForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_grown_bert.GrownBertForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_grown_bert.GrownBertForMultipleChoice",
}


class GrownBertSelfAttention(nn.Module):
    """BERT self-attention with `qk_head_dim` query/key dimensions per head and `hidden_size // heads` value dims.

    Parameter names and layouts are BERT's (`query`, `key`, `value` linear layers, head-major outputs); only the
    output width of `query` and `key` is `num_attention_heads * qk_head_dim`.
    """

    def __init__(self, config: GrownBertConfig, is_causal: bool = False, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.qk_head_dim = config.qk_head_dims[layer_idx]
        self.scaling = config.attention_scale_dim(layer_idx) ** -0.5

        self.query = nn.Linear(config.hidden_size, self.num_attention_heads * self.qk_head_dim)
        self.key = nn.Linear(config.hidden_size, self.num_attention_heads * self.qk_head_dim)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

        self.is_decoder = config.is_decoder
        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs.pop("encoder_hidden_states", None)
        input_shape = hidden_states.shape[:-1]
        qk_shape = (*input_shape, self.num_attention_heads, self.qk_head_dim)
        value_shape = (*input_shape, self.num_attention_heads, self.attention_head_size)

        query_layer = self.query(hidden_states).view(qk_shape).transpose(1, 2)
        key_layer = self.key(hidden_states).view(qk_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(value_shape).transpose(1, 2)

        # ``past_key_values``, the name ``cache`` had before 5.24 (the blocks still rename it, until 5.40), given to
        # the attention itself would otherwise reach the attention function unused, and the cache would stay empty.
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if cache is not None:
            if isinstance(cache, EncoderDecoderCache):
                cache = cache.self_attention_cache
            key_layer, value_layer = cache.update(key_layer, value_layer, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_layer,
            key_layer,
            value_layer,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return attn_output, attn_weights


class GrownBertAttention(BertAttention):
    """`BertAttention` around a `GrownBertSelfAttention`; `forward` is BERT's."""

    def __init__(self, config: GrownBertConfig, is_causal: bool = False, layer_idx: int | None = None):
        nn.Module.__init__(self)  # BertAttention.__init__ would build a plain BertSelfAttention
        self.is_cross_attention = False
        self.self = GrownBertSelfAttention(config, is_causal=is_causal, layer_idx=layer_idx)
        self.output = BertSelfOutput(config)


class GrownBertLayer(BertLayer):
    """A BERT layer with `GrownBertAttention`; `forward` is BERT's."""

    def __init__(self, config: GrownBertConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # BertLayer.__init__ would build a plain BertAttention
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.attention = GrownBertAttention(config, is_causal=config.is_decoder, layer_idx=layer_idx)
        self.is_decoder = config.is_decoder
        self.add_cross_attention = False
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)


class GrownBertEncoder(BertEncoder):
    def __init__(self, config: GrownBertConfig):
        nn.Module.__init__(self)
        self.config = config
        self.layer = nn.ModuleList([GrownBertLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])


#: Why a grown model refuses flash and flex attention (transformers' own message asks to request support).
_UNSUPPORTED_ATTENTION = (
    "{} cannot run attn_implementation={!r}: its query/key heads differ in width from its value "
    "heads (config.qk_head_dims), which flash-attention kernels do not take; use 'sdpa' (the default) or 'eager'."
)


class GrownBertPreTrainedModel(BertPreTrainedModel):
    config_class = GrownBertConfig
    _no_split_modules = ["BertEmbeddings", "GrownBertLayer"]
    # Flash-attention kernels need equal query/key and value widths; eager and sdpa handle different widths.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_record_outputs = {"hidden_states": GrownBertLayer, "attentions": GrownBertSelfAttention}

    def post_init(self):
        super().post_init()
        self.add_model_tags(["hf_grow", "grown-attention"])  # on the card transformers' push_to_hub writes

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        raise ValueError(_UNSUPPORTED_ATTENTION.format(type(self).__name__, f"flash_attention_{flash_attn_version}"))

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        raise ValueError(_UNSUPPORTED_ATTENTION.format(type(self).__name__, "flex_attention"))

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, *args, **kwargs) -> Any:
        """transformers' cache for `generate`, a quantized one (`cache_implementation="quantized"`) included.

        transformers' `QuantizedCache` takes layers of type "full_attention" only, and a grown config names a layer
        type per key width (for static caches); quantized layers store keys of any width, so the cache is built
        from a config whose layers are all "full_attention" (unless `cache_config` gives its own `config`).
        """
        cache_config = generation_config.cache_config or {}
        if generation_config.cache_implementation == "quantized" and "config" not in cache_config:
            layers = self.config.get_text_config(decoder=True).num_hidden_layers
            view = PreTrainedConfig(num_hidden_layers=layers, layer_types=["full_attention"] * layers)
            generation_config = copy.copy(generation_config)  # the caller's, whose cache_config generate copies
            generation_config.cache_config = {**cache_config, "config": view}
        return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)

    @staticmethod
    def create_masks_for_generate(
        config: PreTrainedConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor | None = None,
        block_sequence_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | None:
        """The mask `generate` prepares for static caches: one causal mask, since every layer attends causally.

        transformers' default would read `config.layer_types` and build a mask per layer type (or pass the 2D
        mask on for the grown ones), which the inherited `forward` does not expect.
        """
        return create_causal_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            block_sequence_ids=block_sequence_ids,
        )

    def init_continuous_batching(self, *args, **kwargs):
        """Refused: continuous batching (`generate_batch`, `transformers serve`) does not run BERT (a plain
        `BertLMHeadModel`'s requests fail in the manager's thread, and generate_batch returns empty outputs)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot generate with continuous batching (transformers' paged cache does not run "
            "BERT, grown or not): generate with generate() (dynamic or static cache) instead."
        )

    def save_pretrained(
        self, save_directory, is_main_process: bool = True, *args, push_to_hub: bool = False, **kwargs
    ):
        """`PreTrainedModel.save_pretrained`, plus what a grown checkpoint carries beside the weights.

        The two source files and `auto_map` (for `trust_remote_code`), and `growth_report.json` when the
        model holds the report of the growth that made it (`model.growth_report`, set by hf_grow; one left there by an
        earlier save or push is removed where a later growth cleared it). With
        ``push_to_hub``, the files this save wrote in ``save_directory`` are uploaded once all are written
        (transformers' own upload inside `save_pretrained` would run before these files are), as transformers
        uploads them, with a ``README.md`` already there as the card (else transformers' card, written there).
        """
        self.config.auto_map = dict(AUTO_MAP)
        if push_to_hub:
            repo_id = kwargs.pop("repo_id", Path(save_directory).name)
            hub_kwargs = {key: kwargs.pop(key) for key in _PUSH_KWARGS if key in kwargs}
            before = self._get_files_timestamps(save_directory) if Path(save_directory).is_dir() else {}
        super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if not self.should_save_on_this_rank(is_main_process):
            return
        here = Path(__file__)
        for source in [here, *map(Path, get_relative_import_files(str(here)))]:
            shutil.copyfile(source, Path(save_directory) / source.name)
        report = getattr(self, "growth_report", None)
        # cleared by a growth that leaves no report (a baseline's): one saved or pushed before describes other weights
        cleared = report is None and "growth_report" in self.__dict__
        if report is not None:
            report.to_json_file(Path(save_directory) / "growth_report.json")
        elif cleared:
            (Path(save_directory) / "growth_report.json").unlink(missing_ok=True)
        if push_to_hub:
            token, private, tags = kwargs.get("token"), hub_kwargs.pop("private", None), hub_kwargs.pop("tags", None)
            api = transformers_hub.hf_api()
            repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
            card = Path(save_directory) / "README.md"
            if not card.is_file():
                tags = [tags] if isinstance(tags, str) else tags or []  # a tag, or tags
                tags = sorted(set(self.model_tags or []) | set(tags))  # as transformers' own push_to_hub
                transformers_hub.create_and_tag_model_card(repo_id, tags, token=token).save(card)
            before.pop(card.name, None)  # the card is uploaded whenever it was written
            self._upload_modified_files(save_directory, repo_id, before, token=token, **hub_kwargs)
            revision, create_pr = hub_kwargs.get("revision"), hub_kwargs.get("create_pr")
            if cleared and api.file_exists(repo_id, "growth_report.json", revision=revision, token=token):
                api.delete_file("growth_report.json", repo_id, token=token, revision=revision, create_pr=create_pr,
                                commit_message="Remove the report of an earlier growth")


class GrownBertModel(GrownBertPreTrainedModel, BertModel):
    """`BertModel` built from `GrownBertLayer`s."""

    def __init__(self, config: GrownBertConfig, add_pooling_layer: bool = True):
        GrownBertPreTrainedModel.__init__(self, config)  # BertModel.__init__ would build plain layers
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(config)
        self.encoder = GrownBertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()


# Each task model below is its BERT counterpart with a GrownBertModel backbone: `__init__` repeats the
# counterpart's (which would build a plain BertModel), `forward` and everything else are inherited.


def _classifier_dropout(config: GrownBertConfig) -> nn.Dropout:
    dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(dropout)


class GrownBertForPreTraining(GrownBertPreTrainedModel, BertForPreTraining):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.bert = GrownBertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()


class GrownBertLMHeadModel(GrownBertPreTrainedModel, BertLMHeadModel):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.bert = GrownBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class GrownBertForMaskedLM(GrownBertPreTrainedModel, BertForMaskedLM):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.bert = GrownBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class GrownBertForSequenceClassification(GrownBertPreTrainedModel, BertForSequenceClassification):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.bert = GrownBertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class GrownBertForMultipleChoice(GrownBertPreTrainedModel, BertForMultipleChoice):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.bert = GrownBertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()


class GrownBertForTokenClassification(GrownBertPreTrainedModel, BertForTokenClassification):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = GrownBertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class GrownBertForQuestionAnswering(GrownBertPreTrainedModel, BertForQuestionAnswering):
    def __init__(self, config: GrownBertConfig):
        GrownBertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = GrownBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


__all__ = [
    "GrownBertSelfAttention",
    "GrownBertLayer",
    "GrownBertPreTrainedModel",
    "GrownBertModel",
    "GrownBertForPreTraining",
    "GrownBertLMHeadModel",
    "GrownBertForMaskedLM",
    "GrownBertForSequenceClassification",
    "GrownBertForMultipleChoice",
    "GrownBertForTokenClassification",
    "GrownBertForQuestionAnswering",
]
