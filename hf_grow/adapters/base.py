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


class ArchitectureAdapter(ABC):
    """Per-architecture knowledge. Subclasses set ``model_types`` and implement the abstract methods."""

    #: `config.model_type` values handled: the plain architecture and its grown counterpart.
    model_types: tuple[str, ...] = ()

    @abstractmethod
    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        """The self-attention module of every layer, in order."""

    @abstractmethod
    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        """The module whose input is X, the input of the query and key projections of ``attention``."""

    @abstractmethod
    def num_heads(self, config: PreTrainedConfig) -> int: ...

    @abstractmethod
    def hidden_size(self, config: PreTrainedConfig) -> int: ...

    @abstractmethod
    def qk_head_dims(self, config: PreTrainedConfig) -> list[int]:
        """The query/key width of the heads of each layer."""

    @abstractmethod
    def scaling(self, config: PreTrainedConfig, layer: int, qk_head_dim: int) -> float:
        """The factor the attention applies to Q K^T in ``layer`` when its heads have ``qk_head_dim`` dims."""

    @abstractmethod
    def read_qk(self, attention: nn.Module) -> tuple[Tensor, Tensor]:
        """Augmented query and key weights ``(heads, d_e + 1, d_k)`` of one layer, as float64 copies."""

    @abstractmethod
    def write_qk(self, attention: nn.Module, query: Tensor, key: Tensor) -> None:
        """Set a layer's query and key weights, in place, from augmented weights of its current width."""

    @abstractmethod
    def grown_config(self, config: PreTrainedConfig, qk_head_dims: Sequence[int]) -> PreTrainedConfig:
        """The config of the grown model type with the given per-layer query/key widths."""

    @abstractmethod
    def grown_class(self, model: PreTrainedModel) -> type[PreTrainedModel]:
        """The grown model class matching the class of ``model`` (its own class for grown models)."""

    @abstractmethod
    def grown_state_dict(
        self, model: PreTrainedModel, qk_weights: Mapping[int, tuple[Tensor, Tensor]]
    ) -> dict[str, Tensor]:
        """The state dict of ``model`` with new augmented Q/K weights for the given layers (new tensors)."""

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        """Whether the model's loss predicts token t+1 from position t (causal language modelling)."""
        return False

    def check_supported(self, model: PreTrainedModel) -> None:
        """Raise a ValueError, before any work, for configurations of the architecture that cannot grow."""

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

        Built on the meta device and filled from the state dict, so no time is spent on random init and no
        storage is shared with ``model``.
        """
        config = self.grown_config(model.config, qk_head_dims)
        config._attn_implementation_internal = model.config._attn_implementation
        state_dict = self.grown_state_dict(model, qk_weights)
        reference = next(model.parameters())
        with torch.device("meta"):
            grown = self.grown_class(model)(config)
        grown = grown.to_empty(device=reference.device).to(dtype=reference.dtype)
        grown.load_state_dict(state_dict, strict=True)
        missing_buffers = [name for name, _ in grown.named_buffers() if name not in state_dict]
        if missing_buffers:
            raise RuntimeError(f"grown model has buffers that are not in the state dict: {missing_buffers}")
        grown.tie_weights()
        grown.train(model.training)
        return grown
