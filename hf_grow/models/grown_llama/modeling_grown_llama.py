# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""Llama whose query/key heads hold unrotated content dims beside the rotary ones, a number of its own per layer.

Each query and key head is `[head_dim rotary dims | qk_nope_dims[layer] content dims]`: rotary position embeddings
rotate the first part only, so the content part adds a position-free bilinear form of the layer input to the
scores (DeepSeek-V3's split into `qk_rope_head_dim` and `qk_nope_head_dim`). Values, the output projection, the
rotary frequencies, grouped-query attention and everything outside the attention are Llama's as shipped by
transformers: the classes below subclass the Llama classes and only build `GrownLlamaAttention`; all `forward`
methods above the attention are inherited, so losses, generation, caching and outputs behave as in Llama.

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
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.generation import GenerationConfig
from transformers.generation.continuous_batching import (
    ContinuousBatchingManager,
    ContinuousMixin,
    PagedAttentionCache,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils import hub as transformers_hub

from .configuration_grown_llama import GrownLlamaConfig
from .paged_grown_llama import PagedModelView, cache_head_dim, update_paged_cache


#: `push_to_hub`'s options that `save_pretrained(push_to_hub=True, ...)` passes on to it.
_PUSH_KWARGS = ("commit_message", "commit_description", "private", "revision", "create_pr", "tags")

AUTO_MAP = {
    "AutoConfig": "configuration_grown_llama.GrownLlamaConfig",
    "AutoModel": "modeling_grown_llama.GrownLlamaModel",
    "AutoModelForCausalLM": "modeling_grown_llama.GrownLlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_grown_llama.GrownLlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_grown_llama.GrownLlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_grown_llama.GrownLlamaForQuestionAnswering",
}


class GrownLlamaAttention(LlamaAttention):
    """Llama attention whose query/key heads have `head_dim` rotary dims followed by `qk_nope_dim` content dims.

    `q_proj` and `k_proj` output `heads * qk_head_dim` features, head-major (each head's rotary dims, then its
    content dims); `v_proj` and `o_proj` are Llama's.
    """

    def __init__(self, config: GrownLlamaConfig, layer_idx: int):
        nn.Module.__init__(self)  # LlamaAttention.__init__ would build projections of the wrong width
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.qk_nope_dim = config.qk_nope_dims[layer_idx]
        self.qk_head_dim = self.head_dim + self.qk_nope_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.attention_scale_dim(layer_idx) ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        qkv_bias = config.attention_bias if config.qkv_bias is None else config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.qk_head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.qk_head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        qk_shape = (*input_shape, -1, self.qk_head_dim)

        query_states = self.q_proj(hidden_states).view(qk_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(qk_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        split = [self.head_dim, self.qk_nope_dim]
        query_rope, query_content = query_states.split(split, dim=-1)
        key_rope, key_content = key_states.split(split, dim=-1)
        query_rope, key_rope = apply_rotary_pos_emb(query_rope, key_rope, cos, sin)
        query_states = torch.cat([query_rope, query_content], dim=-1)
        key_states = torch.cat([key_rope, key_content], dim=-1)

        # Older transformers pass the layer's cache as ``past_key_values``; it would otherwise stay empty.
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if isinstance(cache, PagedAttentionCache):  # continuous batching: one width for all keys and values
            width = cache_head_dim(self.config)
            key_states, value_states = update_paged_cache(
                cache, key_states, value_states, self.layer_idx, width, kwargs
            )
        elif cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class GrownLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with `GrownLlamaAttention`; `forward` is Llama's."""

    def __init__(self, config: GrownLlamaConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # LlamaDecoderLayer.__init__ would build a plain LlamaAttention
        self.hidden_size = config.hidden_size
        self.self_attn = GrownLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


#: Why a grown model refuses flash and flex attention (transformers' own message asks to request support).
_UNSUPPORTED_ATTENTION = (
    "{} cannot run attn_implementation={!r}: its query/key heads differ in width from its value "
    "heads (config.qk_head_dims), which flash-attention kernels do not take; use 'sdpa' (the default) or 'eager'."
)


class GrownLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = GrownLlamaConfig
    config: GrownLlamaConfig
    _no_split_modules = ["GrownLlamaDecoderLayer"]
    # Flash-attention kernels need equal query/key and value widths; eager and sdpa handle different widths.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_record_outputs = {
        "hidden_states": GrownLlamaDecoderLayer,
        "attentions": GrownLlamaAttention,
    }

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

    def init_continuous_batching(self, *args, **kwargs) -> ContinuousBatchingManager:
        """transformers' continuous batching (`generate_batch`, `transformers serve`), keys wider than values included.

        Where some layer's keys and values differ in width, transformers' manager is given the model through
        `PagedModelView`, whose config sizes the paged cache at one head width for all keys and values (the
        attention pads them to it: `paged_grown_llama`).
        """
        if any(kind != "full_attention" for kind in self.config.layer_types):
            return ContinuousMixin.init_continuous_batching(PagedModelView(self), *args, **kwargs)
        return super().init_continuous_batching(*args, **kwargs)

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


class GrownLlamaModel(GrownLlamaPreTrainedModel, LlamaModel):
    """`LlamaModel` built from `GrownLlamaDecoderLayer`s."""

    def __init__(self, config: GrownLlamaConfig):
        GrownLlamaPreTrainedModel.__init__(self, config)  # LlamaModel.__init__ would build plain layers
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [GrownLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


# Each task model below is its Llama counterpart with a GrownLlamaModel backbone: `__init__` repeats the
# counterpart's (which would build a plain LlamaModel), `forward` and everything else are inherited.


class GrownLlamaForCausalLM(GrownLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: GrownLlamaConfig):
        GrownLlamaPreTrainedModel.__init__(self, config)
        self.model = GrownLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class GrownLlamaForSequenceClassification(GrownLlamaPreTrainedModel, LlamaForSequenceClassification):
    def __init__(self, config: GrownLlamaConfig):
        GrownLlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = GrownLlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class GrownLlamaForTokenClassification(GrownLlamaPreTrainedModel, LlamaForTokenClassification):
    def __init__(self, config: GrownLlamaConfig):
        GrownLlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = GrownLlamaModel(config)
        if getattr(config, "classifier_dropout", None) is not None:
            classifier_dropout = config.classifier_dropout
        elif getattr(config, "hidden_dropout", None) is not None:
            classifier_dropout = config.hidden_dropout
        else:
            classifier_dropout = 0.1
        self.dropout = nn.Dropout(classifier_dropout)
        bias = getattr(config, "token_classification_bias", True)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=bias)
        self.post_init()


class GrownLlamaForQuestionAnswering(GrownLlamaPreTrainedModel, LlamaForQuestionAnswering):
    base_model_prefix = "transformer"  # Llama's, kept for checkpoints of LlamaForQuestionAnswering

    def __init__(self, config: GrownLlamaConfig):
        GrownLlamaPreTrainedModel.__init__(self, config)
        self.transformer = GrownLlamaModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "GrownLlamaAttention",
    "GrownLlamaDecoderLayer",
    "GrownLlamaPreTrainedModel",
    "GrownLlamaModel",
    "GrownLlamaForCausalLM",
    "GrownLlamaForSequenceClassification",
    "GrownLlamaForTokenClassification",
    "GrownLlamaForQuestionAnswering",
]
