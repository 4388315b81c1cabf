"""Building the grown model type from a plain (or grown) model: its config, its class and its weights.

`GrownModelBuilder` is the part of `hf_grow.adapters.base.ArchitectureAdapter` that makes grown models; it reads
the Q/K layout through the adapter's own `attention_modules` and `qk_parameters`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedConfig, PreTrainedModel

from ..version import __version__

logger = logging.getLogger(__name__)

# Config entries that describe a checkpoint rather than the architecture, or that grown configs derive from their
# query/key widths (`layer_types`, e.g. Qwen2's): the grown config sets its own.
CONFIG_KEYS_NOT_INHERITED = (
    "model_type", "qk_head_dims", "attention_scale_dims", "architectures", "auto_map", "transformers_version",
    "layer_types", "hf_grow_version",
)


def grown_attention(attention: str | None) -> str | None:
    """The attention implementation a grown model takes over from its source: flash and flex kernels take no
    query/key width other than the value width, so a source running one (as an 8B model loaded for a GPU does)
    gives a grown model running sdpa, with a warning, rather than an error after the statistics and the solve."""
    if attention is None or not any(kernel in attention for kernel in ("flash", "flex")):
        return attention
    logger.warning("the grown model runs attention with 'sdpa', not the source's %r: grown models run eager or sdpa "
                   "attention (their query/key heads may differ in width from their value heads, which flash and flex "
                   "attention kernels do not take)", attention)
    return "sdpa"


def attention_scale_entry(qk_head_dims: Sequence[int], scale_dims: Sequence[int] | None) -> list[int] | None:
    """A grown config's ``attention_scale_dims``: None where every layer's scale follows its query/key width."""
    if scale_dims is None or list(scale_dims) == list(qk_head_dims):
        return None
    return [int(dim) for dim in scale_dims]


class GrownModelBuilder:
    """Makes the grown model of an architecture; mixed into `ArchitectureAdapter`, which supplies
    ``attention_modules`` and ``qk_parameters``."""

    #: The config class of the grown model type.
    grown_config_class: type[PreTrainedConfig]
    #: The base class of the grown model classes (a grown model grows into its own class).
    grown_base_class: type[PreTrainedModel]
    #: Plain model class -> grown model class.
    grown_classes: Mapping[type[PreTrainedModel], type[PreTrainedModel]] = {}

    def grown_config(
        self, config: PreTrainedConfig, qk_head_dims: Sequence[int], attention_scale_dims: Sequence[int] | None = None
    ) -> PreTrainedConfig:
        """The config of the grown model type with the given per-layer query/key widths, and the widths whose
        attention scale each layer takes (None: its query/key width)."""
        inherited = {k: v for k, v in config.to_dict().items() if k not in CONFIG_KEYS_NOT_INHERITED}
        return self.grown_config_class(
            **inherited,
            qk_head_dims=list(qk_head_dims),
            attention_scale_dims=attention_scale_entry(qk_head_dims, attention_scale_dims),
        )

    def grown_class(self, model: PreTrainedModel) -> type[PreTrainedModel]:
        """The grown model class matching the class of ``model`` (its own class for grown models)."""
        if isinstance(model, self.grown_base_class):
            return type(model)
        for cls in type(model).__mro__:
            if cls in self.grown_classes:
                return self.grown_classes[cls]
        supported = ", ".join(cls.__name__ for cls in self.grown_classes)
        raise ValueError(f"{type(model).__name__} cannot be grown; supported classes: {supported}.")

    def grown_init_kwargs(self, model: PreTrainedModel) -> dict:
        """Keyword arguments, beside the config, that build a grown model shaped like ``model``."""
        return {}

    def grown_state_dict(
        self, model: PreTrainedModel, qk_weights: Mapping[int, tuple[Tensor, Tensor]]
    ) -> dict[str, Tensor]:
        """The state dict of ``model`` with new augmented Q/K weights for the given layers.

        Its other entries are ``model``'s own tensors, to be copied from (`build_grown_model` loads them into
        the grown model's storage): a clone would hold a third copy of the weights while the grown model is
        filled (at the Llama-3.2-1B shape, 5.7 GiB more, tied embeddings cloned twice).
        """
        state_dict = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        module_names = {module: name for name, module in model.named_modules()}
        attentions = self.attention_modules(model)
        for layer, (query, key) in qk_weights.items():
            prefix = module_names[attentions[layer]]
            for name, value in self.qk_parameters(attentions[layer], query, key).items():
                state_dict[f"{prefix}.{name}"] = value
        return state_dict

    def build_grown_model(
        self,
        model: PreTrainedModel,
        qk_head_dims: Sequence[int],
        qk_weights: Mapping[int, tuple[Tensor, Tensor]],
        attention_scale_dims: Sequence[int] | None = None,
    ) -> PreTrainedModel:
        """A new grown model: ``model``'s weights, with the given augmented Q/K weights per layer (and the widths
        whose attention scale each layer takes, as in `grown_config`).

        Built on the meta device and filled by copying from the state dict, so no time is spent on random
        init, no storage is shared with ``model``, and no third copy of the weights is made.
        """
        config = self.grown_config(model.config, qk_head_dims, attention_scale_dims)
        config.hf_grow_version = __version__  # what grew it (an adapter's own grown_config need not say)
        if _head_untied(model):  # a head given its own weights, the config not edited: tying would drop them
            config.tie_word_embeddings = False
        config._attn_implementation_internal = grown_attention(model.config._attn_implementation)
        state_dict = self.grown_state_dict(model, qk_weights)
        with torch.device("meta"):
            grown = self.grown_class(model)(config, **self.grown_init_kwargs(model))
        grown = grown.to_empty(device=next(model.parameters()).device)
        source_buffers = dict(model.named_buffers())
        source_dtypes = {name: tensor.dtype for name, tensor in [*model.state_dict().items(), *source_buffers.items()]}
        with torch.no_grad():
            # each tensor in its source's dtype: float32 norms or rotary frequencies beside bfloat16 weights stay so
            for name, tensor in [*grown.named_parameters(), *grown.named_buffers()]:
                if source_dtypes.get(name, tensor.dtype) != tensor.dtype:
                    tensor.data = tensor.data.to(source_dtypes[name])
            grown.load_state_dict(state_dict, strict=True)
            # Non-persistent buffers (e.g. BERT's position_ids) are not in state dicts: copy them from the source.
            for name, buffer in grown.named_buffers():
                if name in state_dict:
                    continue
                if name not in source_buffers or source_buffers[name].shape != buffer.shape:
                    raise RuntimeError(f"the grown model's buffer {name} has no counterpart in {type(model).__name__}")
                buffer.copy_(source_buffers[name])
        _copy_rotary_state(model, grown)
        grown.tie_weights()
        grown.train(model.training)
        # what the model was set up with stays: frozen parameters frozen, its generation settings
        frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
        for name, parameter in grown.named_parameters():
            parameter.requires_grad_(name not in frozen)
        if getattr(model, "generation_config", None) is not None and grown.can_generate():
            grown.generation_config = copy.deepcopy(model.generation_config)
        _copy_activation_checkpointing(model, grown)
        return grown


#: What a rotary embedding module holds beside its buffers about the sequence length its frequencies are set for
#: (transformers' dynamic and long-context rope update them in the forward: copied, the grown module resets them
#: for short inputs as the source's does), also per layer type (``{layer_type}_max_seq_len_cached``).
_ROTARY_STATE = ("max_seq_len_cached", "attention_scaling", "long_inv_freq")


def _head_untied(model: PreTrainedModel) -> bool:
    """Whether the output embeddings hold weights of their own although the config ties them to the input
    embeddings (a head untied by hand to train it apart, as transformers' save and load keep it)."""
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False)
    return bool(tied) and output is not None and embeddings is not None and output.weight is not embeddings.weight


def _copy_rotary_state(model: PreTrainedModel, grown: PreTrainedModel) -> None:
    """The source's rotary frequency state (`_ROTARY_STATE`) on the grown model's rotary modules."""
    modules = dict(grown.named_modules())
    for name, module in model.named_modules():
        if name in modules and hasattr(module, "max_seq_len_cached"):
            for key, value in vars(module).items():
                if key.endswith(_ROTARY_STATE):
                    setattr(modules[name], key, value.clone() if isinstance(value, Tensor) else value)


def _copy_activation_checkpointing(model: PreTrainedModel, grown: PreTrainedModel) -> None:
    """The source's activation (gradient) checkpointing on the grown model, module by module: which layers recompute
    (``every_n_layers``), with its checkpoint function (its kwargs, offloading), and the input-gradient hook that
    reentrant checkpointing and PEFT need."""
    modules = dict(grown.named_modules())
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) and name in modules:
            modules[name].gradient_checkpointing = True
            modules[name]._gradient_checkpointing_func = module._gradient_checkpointing_func
    if getattr(model, "_require_grads_hook", None) is not None:
        grown.enable_input_require_grads()
