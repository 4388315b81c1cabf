"""Batches and losses as the statistics and the line search see them: dicts on the model's device, their tokens,
loss terms and losses, and the train/eval flags restored around them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter


LossFn = Callable[[PreTrainedModel, Mapping[str, Tensor]], Tensor]


def iterate_batches(dataloader: Iterable[Mapping[str, Tensor]], model: PreTrainedModel) -> Iterator[dict[str, Tensor]]:
    """Batches as dicts on the model's device; a clear error for anything that is not a dict or is longer than
    the model's positions (which would otherwise fail deep inside the embedding lookup)."""
    device = next(model.parameters()).device
    positions = getattr(model.config, "max_position_embeddings", None)
    for index, batch in enumerate(dataloader):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch {index} is a {type(batch).__name__}; hf_grow expects dict batches passed as model(**batch), "
                "e.g. from a DataLoader with transformers' DataCollatorForLanguageModeling."
            )
        tokens = token_shape(batch)
        length = tokens[-1] if tokens is not None and len(tokens) >= 2 else None
        if positions is not None and length is not None and length > positions:
            raise ValueError(
                f"batch {index} holds sequences of {length} tokens, but the model has {positions} positions "
                "(config.max_position_embeddings): cut the sequences to at most that many tokens."
            )
        yield {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}


def token_shape(batch: Mapping[str, Tensor]) -> torch.Size | None:
    """The (..., s) shape of a batch's tokens: ``input_ids``' shape, or ``inputs_embeds``' without the embedding
    dimension (e.g. (b, choices, s) for multiple choice). None where the batch holds neither."""
    if isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"].shape
    if isinstance(batch.get("inputs_embeds"), Tensor):
        return batch["inputs_embeds"].shape[:-1]
    return None


def batch_loss_weight(
    adapter: ArchitectureAdapter, model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None
) -> int:
    """How many loss terms the batch's loss averages over (`ArchitectureAdapter.loss_weight`); with a custom
    ``loss_fn``, whose normalization hf_grow cannot see, its number of sequences."""
    if loss_fn is None:
        return adapter.loss_weight(model, batch)
    return len(next(value for value in batch.values() if isinstance(value, Tensor)))


def compute_loss(model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None) -> Tensor:
    """``loss_fn(model, batch)``, or the model's own ``outputs.loss``."""
    if loss_fn is not None:
        return loss_fn(model, batch)
    loss = model(**batch).loss
    if loss is None:
        raise ValueError(
            "the model returned no loss: put labels in the batches (e.g. labels=input_ids for a causal LM) "
            "or pass loss_fn(model, batch) -> Tensor."
        )
    return loss


def module_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every submodule's own train/eval flag (a dropout turned off inside a training model, say)."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Set back the flags `module_modes` took: ``model.train(flag)`` would set one flag on every submodule."""
    for module, training in modes:
        module.training = training
