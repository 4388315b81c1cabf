"""What hf_grow needs to know about an architecture: where Q/K live, how heads are laid out, how to grow.

An adapter converts between a model's own Q/K parameters and the augmented per-head weights of
`hf_grow.linalg` (shape ``(heads, d_e + 1, d_k)``, the bias as the last row), and builds the grown model
type. Supporting a new architecture means writing one adapter and one grown model file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedConfig, PreTrainedModel


# Config entries that describe a checkpoint rather than the architecture, or that grown configs derive from their
# query/key widths (`layer_types`, e.g. Qwen2's): the grown config sets its own.
_CONFIG_KEYS_NOT_INHERITED = (
    "model_type", "qk_head_dims", "architectures", "auto_map", "transformers_version", "layer_types"
)


def split_heads(columns: Tensor, bias: Tensor, num_heads: int) -> Tensor:
    """(d_e, heads * d_k) projection columns and their bias -> augmented (heads, d_e + 1, d_k)."""
    d_e = columns.shape[0]
    weight = columns.reshape(d_e, num_heads, -1).permute(1, 0, 2)
    return torch.cat([weight, bias.reshape(num_heads, 1, -1)], dim=1)


def merge_heads(augmented: Tensor) -> tuple[Tensor, Tensor]:
    """Augmented (heads, d_e + 1, d_k) -> (d_e, heads * d_k) projection columns and their bias."""
    num_heads, d_aug, qk_dim = augmented.shape
    weight = augmented[:, :-1, :].permute(1, 0, 2).reshape(d_aug - 1, num_heads * qk_dim)
    return weight, augmented[:, -1, :].reshape(num_heads * qk_dim)


class ArchitectureAdapter(ABC):
    """Per-architecture knowledge. Subclasses set the class attributes and implement the abstract methods."""

    #: `config.model_type` values handled: the plain architecture and its grown counterpart.
    model_types: tuple[str, ...] = ()
    #: The config class of the grown model type.
    grown_config_class: type[PreTrainedConfig]
    #: The base class of the grown model classes (a grown model grows into its own class).
    grown_base_class: type[PreTrainedModel]
    #: Plain model class -> grown model class.
    grown_classes: Mapping[type[PreTrainedModel], type[PreTrainedModel]] = {}
    #: The growth modes the architecture supports (see `hf_grow.growth.problem.MODES`); the first is the default.
    growth_modes: tuple[str, ...] = ("refactor", "append")
    #: Why a mode outside `growth_modes` cannot work, for the error message.
    refused_mode_reason: str = ""

    @abstractmethod
    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        """The self-attention module of every layer, in order."""

    @abstractmethod
    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        """The module whose input is X, the input of the query and key projections of ``attention``."""

    @abstractmethod
    def read_qk(self, attention: nn.Module, source: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Augmented query and key weights ``(heads, d_e + 1, d_k)`` of one layer, as float64 copies.

        Architectures without Q/K biases may return ``(heads, d_e, d_k)`` (no bias row: the solve then drops
        the statistics' ones column), and keys may have fewer heads than queries (grouped-query attention:
        consecutive query heads share a key head).

        ``source`` maps the `qk_parameter_names` to tensors shaped like those parameters (e.g. optimizer
        moments) to read instead of the parameters themselves.
        """

    @abstractmethod
    def qk_parameters(
        self, attention: nn.Module, query: Tensor, key: Tensor, source: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The parameters of ``attention`` (names relative to it) that hold augmented ``query`` and ``key``.

        New tensors in the dtype of the current parameters (of ``source``'s tensors when given, which then
        also supply any entries that are not Q/K, e.g. GPT-2's fused values); their shapes follow the width
        of ``query``.
        """

    @abstractmethod
    def qk_parameter_names(self, attention: nn.Module) -> list[str]:
        """The names (relative to ``attention``) of the parameters that hold query or key weights."""

    @abstractmethod
    def set_qk_head_dim(self, attention: nn.Module, config: PreTrainedConfig, layer: int, qk_head_dim: int) -> None:
        """Make a grown attention module compute with ``qk_head_dim`` query/key dims per head (parameters
        already resized): its split sizes and scaling. For growth in place, during training."""

    def num_heads(self, config: PreTrainedConfig) -> int:
        return config.num_attention_heads

    def check_mode(self, model: PreTrainedModel, mode: str | None) -> str:
        """The growth mode to run: ``mode``, or the architecture's default when None; a ValueError, before any
        work, for a mode the architecture cannot grow by."""
        if mode is None:
            return self.growth_modes[0]
        if mode not in self.growth_modes:
            raise ValueError(
                f"{type(model).__name__} cannot grow by mode {mode!r}: {self.refused_mode_reason}. "
                f"Use mode {' or '.join(map(repr, self.growth_modes))} (the default for this architecture)."
            )
        return mode

    def hidden_size(self, config: PreTrainedConfig) -> int:
        return config.hidden_size

    def qk_head_dims(self, config: PreTrainedConfig) -> list[int]:
        """The query/key width of the heads of each layer."""
        default = config.hidden_size // config.num_attention_heads
        return list(getattr(config, "qk_head_dims", None) or [default] * config.num_hidden_layers)

    def scaling(self, config: PreTrainedConfig, layer: int, qk_head_dim: int) -> float:
        """The factor the attention applies to Q K^T in ``layer`` when its heads have ``qk_head_dim`` dims."""
        return qk_head_dim**-0.5

    def write_qk(self, attention: nn.Module, query: Tensor, key: Tensor) -> None:
        """Set a layer's query and key weights, in place, from augmented weights of its current width."""
        parameters = dict(attention.named_parameters())
        with torch.no_grad():
            for name, value in self.qk_parameters(attention, query, key).items():
                if value.shape != parameters[name].shape:
                    raise ValueError(
                        f"Q/K weights of shape {tuple(query.shape)} do not fit {name} of shape "
                        f"{tuple(parameters[name].shape)}"
                    )
                parameters[name].copy_(value)

    def grown_config(self, config: PreTrainedConfig, qk_head_dims: Sequence[int]) -> PreTrainedConfig:
        """The config of the grown model type with the given per-layer query/key widths."""
        inherited = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_KEYS_NOT_INHERITED}
        return self.grown_config_class(**inherited, qk_head_dims=list(qk_head_dims))

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

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        """Whether the model's loss predicts token t+1 from position t (causal language modelling)."""
        return False

    def check_supported(self, model: PreTrainedModel) -> None:
        """Raise a ValueError, before any work, for configurations of the architecture that cannot grow."""
        if getattr(model.config, "add_cross_attention", False):
            raise ValueError(
                f"{type(model).__name__} with add_cross_attention=True cannot be grown: the cross-attention "
                "queries and keys come from different inputs. Grow a model without cross-attention."
            )
        self.grown_class(model)

    def loss_weight(self, model: PreTrainedModel, batch: Mapping[str, Tensor]) -> int:
        """How many loss terms ``batch`` averages over, to weight batch losses exactly.

        Token-level labels count their non-ignored (-100) entries, shifted for causal LMs; otherwise each
        example counts once.
        """
        labels = batch.get("labels")
        inputs = batch.get("input_ids", batch.get("inputs_embeds"))
        if isinstance(labels, Tensor) and inputs is not None and labels.shape == inputs.shape[: labels.dim()]:
            if labels.dim() >= 2:
                valid = labels != -100
                if self.shifts_labels(model):
                    valid = valid[..., 1:]
                return int(valid.sum())
        first = next(value for value in batch.values() if isinstance(value, Tensor))
        return int(first.shape[0])

    def build_grown_model(
        self, model: PreTrainedModel, qk_head_dims: Sequence[int], qk_weights: Mapping[int, tuple[Tensor, Tensor]]
    ) -> PreTrainedModel:
        """A new grown model: ``model``'s weights, with the given augmented Q/K weights per layer.

        Built on the meta device and filled by copying from the state dict, so no time is spent on random
        init, no storage is shared with ``model``, and no third copy of the weights is made.
        """
        config = self.grown_config(model.config, qk_head_dims)
        config._attn_implementation_internal = model.config._attn_implementation
        state_dict = self.grown_state_dict(model, qk_weights)
        reference = next(model.parameters())
        with torch.device("meta"):
            grown = self.grown_class(model)(config, **self.grown_init_kwargs(model))
        grown = grown.to_empty(device=reference.device).to(dtype=reference.dtype)
        grown.load_state_dict(state_dict, strict=True)
        # Non-persistent buffers (e.g. BERT's position_ids) are not in state dicts: copy them from the source.
        source_buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, buffer in grown.named_buffers():
                if name in state_dict:
                    continue
                if name not in source_buffers or source_buffers[name].shape != buffer.shape:
                    raise RuntimeError(f"the grown model's buffer {name} has no counterpart in {type(model).__name__}")
                buffer.copy_(source_buffers[name])
        grown.tie_weights()
        grown.train(model.training)
        return grown
