"""sentence-transformers models: grow the transformer inside a `SentenceTransformer`, with its own losses.

A `SentenceTransformer` is a sequence of modules (Transformer, Pooling, Normalize, ...) whose Transformer module
holds a transformers model. hf_grow grows that model and returns a new `SentenceTransformer` with the grown model
in its place and copies of the other modules, so ``save`` writes the usual folder (modules.json, pooling and
normalization config, tokenizer) with the grown model's weights, config and modeling files.

The growth loss is a sentence-transformers loss object (`MultipleNegativesRankingLoss` by default), run through
`SentenceLoss`: hf_grow calls ``loss_fn(model, batch)`` with the original model for the statistics and with grown
candidates for the line search, so the adapter puts the model it is given into the loss's `SentenceTransformer`
for the call. Batches hold one tokenized feature dict per text column (``{"anchor": tokenizer(anchors),
"positive": tokenizer(positives)}``, in the loss's column order), and optionally ``"label"`` for losses that take
labels; the loss runs the model once per column.

sentence-transformers is an optional dependency (``pip install "hf_grow[sentence-transformers]"``): this module
imports it only when given a `SentenceTransformer`.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel


LABEL_KEYS = ("label", "labels")


def is_sentence_transformer(model: Any) -> bool:
    """Whether ``model`` is a `sentence_transformers.SentenceTransformer` (without importing the package)."""
    package = sys.modules.get("sentence_transformers")
    return package is not None and isinstance(model, package.SentenceTransformer)


def transformer_module(sentence_model: nn.Module) -> nn.Module:
    """The module of ``sentence_model`` that holds the transformers model (``.model``, a `PreTrainedModel`)."""
    found = [
        module for module in sentence_model.children() if isinstance(getattr(module, "model", None), PreTrainedModel)
    ]
    if len(found) != 1:
        names = ", ".join(type(module).__name__ for module in sentence_model.children())
        raise ValueError(
            f"hf_grow grows a SentenceTransformer with exactly one transformers model module; this one has "
            f"{len(found)} among its modules ({names})."
        )
    return found[0]


@contextlib.contextmanager
def running(sentence_model: nn.Module, model: PreTrainedModel) -> Iterator[None]:
    """``sentence_model`` with ``model`` as its transformers model for the block; the original is put back."""
    transformer = transformer_module(sentence_model)
    original = transformer.model
    transformer.model = model
    try:
        yield
    finally:
        transformer.model = original


def sentence_features(batch: Any) -> tuple[list[dict], Tensor | None]:
    """The per-column feature dicts of a batch and its labels (None where it has none).

    A batch is a dict of columns (feature dicts, in the loss's order) with an optional ``"label"``/``"labels"``
    tensor, or a list or tuple of feature dicts. Copies of the feature dicts are returned: sentence-transformers
    modules write their outputs into the dict they are given, and held-out batches are read many times.
    """
    if isinstance(batch, Mapping):
        labels = next((batch[key] for key in LABEL_KEYS if key in batch), None)
        columns = [value for key, value in batch.items() if key not in LABEL_KEYS]
    elif isinstance(batch, (list, tuple)):
        labels, columns = None, list(batch)
    else:
        columns, labels = [], None
    if not columns or not all(isinstance(column, Mapping) and "input_ids" in column for column in columns):
        from .statistics import describe

        raise ValueError(
            f"a sentence-transformers loss needs batches of tokenized text columns, e.g. {{'anchor': "
            f"tokenizer(anchors), 'positive': tokenizer(positives)}} (optionally a 'label' tensor); got "
            f"{describe(batch)}."
        )
    return [dict(column) for column in columns], labels


class SentenceLoss:
    """A sentence-transformers loss object (e.g. ``MultipleNegativesRankingLoss(model)``) as hf_grow's
    ``loss_fn(model, batch)``: the loss runs with the given transformers model inside its `SentenceTransformer`.

    `grow_model` wraps a loss object passed as ``loss_fn`` for a `SentenceTransformer` itself; wrap it by hand to
    use it with `collect_statistics`, `evaluate_loss` or `inspect_growth` on the transformers model.
    """

    def __init__(self, loss: nn.Module):
        sentence_model = getattr(loss, "model", None)
        if not is_sentence_transformer(sentence_model):
            raise TypeError(
                f"{type(loss).__name__} has no SentenceTransformer as its .model: pass a sentence-transformers loss "
                "object, e.g. MultipleNegativesRankingLoss(model), or a loss_fn(model, batch) -> Tensor."
            )
        self.loss = loss
        self.sentence_model = sentence_model
        transformer_module(sentence_model)  # one transformers model to grow, or a clear error now

    def __call__(self, model: PreTrainedModel, batch: Any) -> Tensor:
        features, labels = sentence_features(batch)
        with running(self.sentence_model, model):
            return self.loss(features, labels)

    def __repr__(self) -> str:
        return f"SentenceLoss({type(self.loss).__name__})"


def default_loss(sentence_model: nn.Module) -> SentenceLoss:
    """`MultipleNegativesRankingLoss`, all-MiniLM-L6-v2's own training loss: anchor i must pick positive i."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    return SentenceLoss(MultipleNegativesRankingLoss(sentence_model))


def as_loss_fn(loss: Any, sentence_model: nn.Module) -> Any:
    """The loss_fn for growing ``sentence_model``: `MultipleNegativesRankingLoss` for None, a sentence-transformers
    loss object wrapped in `SentenceLoss`, or a callable ``loss_fn(model, batch)`` as given."""
    if loss is None:
        return default_loss(sentence_model)
    if isinstance(loss, nn.Module) and is_sentence_transformer(getattr(loss, "model", None)):
        return SentenceLoss(loss)
    return loss


def with_grown_model(sentence_model: nn.Module, grown: PreTrainedModel) -> nn.Module:
    """A new `SentenceTransformer`: copies of ``sentence_model``'s modules, ``grown`` as its transformers model."""
    with running(sentence_model, grown):
        result = copy.deepcopy(sentence_model, memo={id(grown): grown})
    result.growth_report = getattr(grown, "growth_report", None)
    return result


def tokenize_pairs(
    pairs: Sequence[tuple[str, str]], sentence_model: nn.Module, batch_size: int, columns: tuple[str, str] = ("anchor", "positive")
) -> list[dict]:
    """Batches ``{"anchor": features, "positive": features}`` of ``batch_size`` text pairs, tokenized by the
    model's own tokenizer (its maximum sequence length, padded per column)."""
    batches = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batches.append(
            {name: dict(sentence_model.preprocess([pair[index] for pair in chunk])) for index, name in enumerate(columns)}
        )
    return batches
