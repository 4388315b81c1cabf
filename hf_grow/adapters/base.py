"""What hf_grow needs to know about an architecture: where Q/K live, how heads are laid out, how to grow.

An adapter converts between a model's own Q/K parameters and the augmented per-head weights of
`hf_grow.linalg` (shape ``(heads, d_e + 1, d_k)``, the bias as the last row), and builds the grown model
type. Supporting a new architecture means writing one adapter module (an `ArchitectureAdapter` subclass, which
registers itself; `hf_grow.adapters` imports the module) and one grown model package under `hf_grow.models`
(config, modeling and, for decoders, paged-cache files), which registers itself too; its classes are then added
to the names `hf_grow` exports (written out for editors and type checkers; a layout test names any missing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import PreTrainedConfig, PreTrainedModel

from ..option_values import SOLVED_MODES
from .building import GrownModelBuilder




def split_heads(columns: Tensor, bias: Tensor | None, num_heads: int) -> Tensor:
    """(d_e, heads * d_k) projection columns and their bias -> augmented (heads, d_e + 1, d_k), the bias as the last
    row; without a bias (None), (heads, d_e, d_k)."""
    d_e = columns.shape[0]
    weight = columns.reshape(d_e, num_heads, -1).permute(1, 0, 2)
    if bias is None:
        return weight
    return torch.cat([weight, bias.reshape(num_heads, 1, -1)], dim=1)


def merge_heads(augmented: Tensor, has_bias: bool = True) -> tuple[Tensor, Tensor | None]:
    """Augmented (heads, d_e + 1, d_k) -> (d_e, heads * d_k) projection columns and their bias; without a bias row
    (``has_bias`` False: (heads, d_e, d_k)), the columns and None."""
    num_heads, rows, qk_dim = augmented.shape
    inputs = rows - 1 if has_bias else rows
    weight = augmented[:, :inputs, :].permute(1, 0, 2).reshape(inputs, num_heads * qk_dim)
    return weight, augmented[:, -1, :].reshape(num_heads * qk_dim) if has_bias else None


def scale_dims_after_growth(
    qk_dims_before: Sequence[int], scale_dims_before: Sequence[int], qk_dims_after: Sequence[int], keep_scale: bool
) -> list[int]:
    """Each layer's `ArchitectureAdapter.attention_scale_dims` after growing to ``qk_dims_after``: a grown
    layer's scale follows its new width, or stays with ``keep_scale``; layers that do not grow keep theirs."""
    pairs = zip(qk_dims_before, scale_dims_before, qk_dims_after)
    return [scale if keep_scale or after == before else after for before, scale, after in pairs]


class ArchitectureAdapter(GrownModelBuilder, ABC):
    """Per-architecture knowledge. Subclasses set the class attributes (also `GrownModelBuilder`'s) and implement the
    abstract methods."""

    #: `config.model_type` values handled: the plain architecture and its grown counterpart.
    model_types: tuple[str, ...] = ()
    #: The growth modes the architecture supports (of `SOLVED_MODES`); the first is the default.
    growth_modes: tuple[str, ...] = SOLVED_MODES
    #: Why a mode outside `growth_modes` cannot work, for the error message.
    refused_mode_reason: str = ""
    #: Every adapter class, in the order they were defined; `hf_grow.adapters` instantiates them.
    registered: ClassVar[list[type[ArchitectureAdapter]]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register each adapter class that names its own model types as it is defined, so that supporting an
        architecture edits no list (an abstract intermediate or a subclass that inherits its types is not one)."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("model_types"):
            ArchitectureAdapter.registered.append(cls)

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
    def set_qk_head_dim(
        self, attention: nn.Module, config: PreTrainedConfig, layer: int, qk_head_dim: int, scale_dim: int
    ) -> None:
        """Make a grown attention module compute with ``qk_head_dim`` query/key dims per head (parameters
        already resized), at the attention scale of ``scale_dim`` (`scaling`): its split sizes and scaling. For
        growth in place, during training."""

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

    def attention_scale_dims(self, config: PreTrainedConfig) -> list[int]:
        """The width whose attention scale (`scaling`) each layer takes: its query/key width, unless a growth
        kept an older width's scale (a grown config's ``attention_scale_dims``)."""
        return list(getattr(config, "attention_scale_dims", None) or self.qk_head_dims(config))

    def current_scaling(self, config: PreTrainedConfig, layer: int) -> float:
        """The factor the attention of ``layer`` applies to Q K^T under ``config``."""
        return self.scaling(config, layer, self.attention_scale_dims(config)[layer])

    def scaling(self, config: PreTrainedConfig, layer: int, scale_dim: int) -> float:
        """The factor the attention applies to Q K^T in ``layer`` at the scale of ``scale_dim`` dims (by default
        its query/key width; `attention_scale_dims`)."""
        return scale_dim**-0.5

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

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        """Whether the model's loss predicts token t+1 from position t (causal language modelling)."""
        return False

    def position_limit(self, config: PreTrainedConfig) -> int | None:
        """The longest sequence the model can embed: the size of a learned position table
        (``config.max_position_embeddings``); None where positions are computed for any length (rotary)."""
        return getattr(config, "max_position_embeddings", None)

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
