# Copyright 2026 The hf_grow authors. Licensed under the Apache License, Version 2.0.
"""GPT-2 whose attention heads have a query/key width of their own, per layer.

Everything except the attention projection is GPT-2 as shipped by transformers: the classes below subclass
the GPT-2 classes and only build a `GrownGPT2Model` backbone whose attention projects queries and keys to
`config.qk_head_dims[layer]` dimensions per head (values keep `n_embd // n_head`). All `forward` methods
are inherited unchanged, so losses, generation, caching and outputs behave exactly as in GPT-2.

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
from transformers.generation.continuous_batching import (
    ContinuousBatchingManager,
    ContinuousMixin,
    PagedAttentionCache,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import (
    GPT2Attention,
    GPT2Block,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2MLP,
    GPT2Model,
    GPT2PreTrainedModel,
    GPT2SequenceSummary,
    eager_attention_forward,
)
from transformers.pytorch_utils import Conv1D
from transformers.utils import hub as transformers_hub
from transformers.utils.output_capturing import OutputRecorder

from .configuration_grown_gpt2 import GrownGPT2Config
from .paged_grown_gpt2 import PagedModelView, cache_head_dim, update_paged_cache


#: `push_to_hub`'s options that `save_pretrained(push_to_hub=True, ...)` passes on to it.
_PUSH_KWARGS = ("commit_message", "commit_description", "private", "revision", "create_pr", "tags")

AUTO_MAP = {
    "AutoConfig": "configuration_grown_gpt2.GrownGPT2Config",
    "AutoModel": "modeling_grown_gpt2.GrownGPT2Model",
    "AutoModelForCausalLM": "modeling_grown_gpt2.GrownGPT2LMHeadModel",
    "AutoModelForSequenceClassification": "modeling_grown_gpt2.GrownGPT2ForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_grown_gpt2.GrownGPT2ForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_grown_gpt2.GrownGPT2ForQuestionAnswering",
}


class GrownGPT2Attention(GPT2Attention):
    """GPT-2 self-attention with `qk_head_dim` query/key dimensions per head and `n_embd // n_head` value dims.

    The fused `c_attn` projection keeps GPT-2's layout, `[queries | keys | values]` along its output, head-major
    within each block: output width `2 * n_head * qk_head_dim + n_embd`.
    """

    def __init__(self, config: GrownGPT2Config, layer_idx: int):
        nn.Module.__init__(self)  # GPT2Attention.__init__ would build a projection of the wrong width
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.qk_head_dim = config.qk_head_dims[layer_idx]
        self.split_size = [self.num_heads * self.qk_head_dim] * 2 + [self.embed_dim]
        self.scale_attn_weights = config.scale_attn_weights
        self.scale_attn_by_inverse_layer_idx = config.scale_attn_by_inverse_layer_idx
        self.reorder_and_upcast_attn = config.reorder_and_upcast_attn
        self.is_cross_attention = False
        self.layer_idx = layer_idx

        self.scaling = config.attention_scale_dim(layer_idx) ** -0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(self.layer_idx + 1)

        self.c_attn = Conv1D(sum(self.split_size), self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.is_causal = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("GrownGPT2Attention is self-attention only; cross-attention is not supported.")
        kwargs.pop("encoder_hidden_states", None)
        kwargs.pop("encoder_attention_mask", None)
        kwargs.pop("output_attentions", None)

        query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
        batch_and_seq = hidden_states.shape[:-1]
        query_states = query_states.view(*batch_and_seq, self.num_heads, self.qk_head_dim).transpose(1, 2)
        key_states = key_states.view(*batch_and_seq, self.num_heads, self.qk_head_dim).transpose(1, 2)
        value_states = value_states.view(*batch_and_seq, self.num_heads, self.head_dim).transpose(1, 2)

        # ``past_key_values``, the name ``cache`` had before 5.24 (the blocks still rename it, until 5.40), given to
        # the attention itself would otherwise reach the attention function unused, and the cache would stay empty.
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        if isinstance(cache, PagedAttentionCache):  # continuous batching: one width for all keys and values
            width = cache_head_dim(self.config)
            key_states, value_states = update_paged_cache(
                cache, key_states, value_states, self.layer_idx, width, kwargs
            )
        elif cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        if self.config._attn_implementation == "eager" and self.reorder_and_upcast_attn:
            attn_output, attn_weights = self._upcast_and_reordered_attn(
                query_states, key_states, value_states, attention_mask
            )
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=self.attn_dropout.p if self.training else 0.0,
                scaling=self.scaling,
                **kwargs,
            )

        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)
        return attn_output, attn_weights


class GrownGPT2Block(GPT2Block):
    """A GPT-2 block with `GrownGPT2Attention`; `forward` is GPT-2's."""

    def __init__(self, config: GrownGPT2Config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # GPT2Block.__init__ would build a plain GPT2Attention
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GrownGPT2Attention(config=config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)


#: Why a grown model refuses flash and flex attention (transformers' own message asks to request support).
_UNSUPPORTED_ATTENTION = (
    "{} cannot run attn_implementation={!r}: its query/key heads differ in width from its value "
    "heads (config.qk_head_dims), which flash-attention kernels do not take; use 'sdpa' (the default) or 'eager'."
)


class GrownGPT2PreTrainedModel(GPT2PreTrainedModel):
    config_class = GrownGPT2Config
    _no_split_modules = ["GrownGPT2Block"]
    # Flash-attention kernels need equal query/key and value widths; eager and sdpa handle different widths.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_record_outputs = {
        "hidden_states": GrownGPT2Block,
        "attentions": OutputRecorder(GrownGPT2Attention, layer_name=".attn", index=1),
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

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        """transformers' weight initialization, as for the built-in GPT-2 (`is_custom_code=False`).

        For a class outside `transformers.`, transformers marks a module initialized, unvisited, once all its own
        parameters are, a guard for remote code that writes weights in place. GPT-2's attention and MLP own no
        parameters (their `Conv1D`s do, and are initialized first), so that guard would skip GPT-2's scaled
        initialization of `c_proj` (std `initializer_range / sqrt(2 * n_layer)`). `_init_weights` is GPT-2's and
        uses `transformers.initialization`, which marks every tensor it sets, so the guard is not needed.
        """
        super()._initialize_weights(module, is_custom_code=False)

    def init_continuous_batching(self, *args, **kwargs) -> ContinuousBatchingManager:
        """transformers' continuous batching (`generate_batch`, `transformers serve`), keys wider than values included.

        Where some layer's keys and values differ in width, transformers' manager is given the model through
        `PagedModelView`, whose config sizes the paged cache at one head width for all keys and values (the
        attention pads them to it: `paged_grown_gpt2`).
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


class GrownGPT2Model(GrownGPT2PreTrainedModel, GPT2Model):
    """`GPT2Model` built from `GrownGPT2Block`s."""

    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)  # GPT2Model.__init__ would build plain blocks
        self.embed_dim = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GrownGPT2Block(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self._attn_implementation = config._attn_implementation
        self.post_init()


# Each task model below is its GPT-2 counterpart with a GrownGPT2Model backbone: `__init__` repeats the
# counterpart's (which would build a plain GPT2Model), `forward` and everything else are inherited.


class GrownGPT2LMHeadModel(GrownGPT2PreTrainedModel, GPT2LMHeadModel):
    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)
        self.transformer = GrownGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()


class GrownGPT2DoubleHeadsModel(GrownGPT2PreTrainedModel, GPT2DoubleHeadsModel):
    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)
        config.num_labels = 1
        self.transformer = GrownGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.multiple_choice_head = GPT2SequenceSummary(config)
        self.post_init()


class GrownGPT2ForSequenceClassification(GrownGPT2PreTrainedModel, GPT2ForSequenceClassification):
    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.transformer = GrownGPT2Model(config)
        self.score = nn.Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()


class GrownGPT2ForTokenClassification(GrownGPT2PreTrainedModel, GPT2ForTokenClassification):
    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.transformer = GrownGPT2Model(config)
        if getattr(config, "classifier_dropout", None) is not None:
            classifier_dropout = config.classifier_dropout
        elif getattr(config, "hidden_dropout", None) is not None:
            classifier_dropout = config.hidden_dropout
        else:
            classifier_dropout = 0.1
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class GrownGPT2ForQuestionAnswering(GrownGPT2PreTrainedModel, GPT2ForQuestionAnswering):
    def __init__(self, config: GrownGPT2Config):
        GrownGPT2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.transformer = GrownGPT2Model(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "GrownGPT2Attention",
    "GrownGPT2Block",
    "GrownGPT2PreTrainedModel",
    "GrownGPT2Model",
    "GrownGPT2LMHeadModel",
    "GrownGPT2DoubleHeadsModel",
    "GrownGPT2ForSequenceClassification",
    "GrownGPT2ForTokenClassification",
    "GrownGPT2ForQuestionAnswering",
]
