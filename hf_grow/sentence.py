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
import csv
import io
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel

from .adapters import is_sentence_transformer
from .statistics.batches import restore_modes


LABEL_KEYS = ("label", "labels")


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
        sentence_model = built_on(loss)
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
        # The other modules in eval mode (hf_grow sets the transformers models' own modes, which keep gradient
        # checkpointing during the statistics): a Dropout module after the pooling, left training (as
        # sentence-transformers' trainer leaves a model), made every loss random.
        transformers_modules = {id(module) for inner in (transformer_module(self.sentence_model).model, model)
                                for module in inner.modules()}
        others = [module for module in self.sentence_model.modules() if id(module) not in transformers_modules]
        modes = [(module, module.training) for module in others]
        for module in others:
            module.training = False
        try:
            with running(self.sentence_model, model):
                loss = self.loss(features, labels)
        except (AttributeError, TypeError) as error:
            if labels is None and "NoneType" in str(error) and _raised_in_sentence_transformers(error):
                # a sentence-transformers loss that reads its labels (CoSENTLoss: labels.numel())
                raise self._without_labels(f" ({error})") from error
            raise
        finally:
            restore_modes(modes)
        if labels is None and isinstance(loss, tuple):  # SoftmaxLoss: its embeddings and logits, no loss, unlabelled
            raise self._without_labels("")
        return loss

    def _without_labels(self, detail: str) -> ValueError:
        return ValueError(
            f"{type(self.loss).__name__} takes labels, and the batch has none{detail}: put a 'label' tensor (one value "
            "per row, e.g. similarity scores) in each batch, or use a loss without labels such as "
            "MultipleNegativesRankingLoss."
        )

    def __repr__(self) -> str:
        return f"SentenceLoss({type(self.loss).__name__})"


def _raised_in_sentence_transformers(error: BaseException) -> bool:
    """Whether ``error`` came from sentence-transformers' own code (not from a user's loss around it)."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and f"{os.sep}sentence_transformers{os.sep}" in frame.tb_frame.f_code.co_filename


def default_loss(sentence_model: nn.Module) -> SentenceLoss:
    """`MultipleNegativesRankingLoss`, all-MiniLM-L6-v2's own training loss: anchor i must pick positive i."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    return SentenceLoss(MultipleNegativesRankingLoss(sentence_model))


def as_loss_fn(loss: Any, sentence_model: nn.Module) -> Any:
    """The loss_fn for growing ``sentence_model``: `MultipleNegativesRankingLoss` for None, a sentence-transformers
    loss object wrapped in `SentenceLoss`, or a callable ``loss_fn(model, batch)`` as given."""
    if loss is None:
        return default_loss(sentence_model)
    if isinstance(loss, nn.Module) and is_sentence_transformer(built_on(loss)):
        loss = SentenceLoss(loss)
    if isinstance(loss, SentenceLoss) and any(model is not sentence_model for model in _all_built_on(loss.loss)):
        # its modules (pooling, normalization) would run around the grown model's: the statistics of another model
        raise ValueError(
            f"loss_fn {type(loss.loss).__name__} is built on another SentenceTransformer than the one grown: build it "
            "on the model you grow, e.g. MultipleNegativesRankingLoss(model)."
        )
    return loss


def built_on(loss: nn.Module) -> Any:
    """The model a sentence-transformers loss is built on: its ``.model`` (``.sentence_embedder`` for the batch
    triplet losses); None for another object."""
    return getattr(loss, "model", None) if hasattr(loss, "model") else getattr(loss, "sentence_embedder", None)


def _all_built_on(loss: nn.Module) -> list[nn.Module]:
    """The SentenceTransformers a loss and the losses inside it (MatryoshkaLoss's) are built on (`built_on`; a
    guide or a teacher model is none of them)."""
    return [built_on(module) for module in loss.modules()
            if not is_sentence_transformer(module) and is_sentence_transformer(built_on(module))]


def with_grown_model(sentence_model: nn.Module, grown: PreTrainedModel) -> nn.Module:
    """A new `SentenceTransformer`: copies of ``sentence_model``'s modules, ``grown`` as its transformers model."""
    with running(sentence_model, grown):
        result = copy.deepcopy(sentence_model, memo={id(grown): grown})
    result.growth_report = getattr(grown, "growth_report", None)
    return result


def tokenize_pairs(
    pairs: Sequence[tuple[str, ...]],
    sentence_model: nn.Module,
    batch_size: int,
    columns: tuple[str, ...] | None = None,
    what: str = "batches of pairs",
) -> list[dict]:
    """Batches ``{"anchor": features, "positive": features}`` of ``batch_size`` text pairs (with a third
    ``"negative"`` column for (anchor, positive, hard negative) triplets, which MultipleNegativesRankingLoss takes;
    ``columns`` names them otherwise), tokenized by the model's own tokenizer (its maximum sequence length, padded per
    column). A last pair left alone joins the batch before it: with MultipleNegativesRankingLoss a batch of one pair
    has a loss of 0 whatever the weights. A batch that holds a text twice in a column is warned about (``what``: the
    batches' name in the warning)."""
    lengths = sorted({len(pair) for pair in pairs})
    if columns is None:
        columns = ("anchor", "positive", "negative")[: lengths[0]] if lengths in ([2], [3]) else ()
    if lengths and lengths != [len(columns)]:
        raise ValueError(
            f"tokenize_pairs got tuples of {' and '.join(map(str, lengths))} texts: pass (anchor, positive) pairs or "
            "(anchor, positive, negative) triplets, all of one length, or name a column per text with columns="
        )
    starts = list(range(0, len(pairs), batch_size))
    if len(starts) > 1 and len(pairs) - starts[-1] == 1:
        starts.pop()
    batches, repeating = [], 0
    for start, end in zip(starts, [*starts[1:], len(pairs)]):
        chunk = pairs[start:end]
        repeating += any(len({pair[index] for pair in chunk}) < len(chunk) for index in range(len(columns)))
        batches.append(
            {
                name: dict(sentence_model.preprocess([pair[index] for pair in chunk]))
                for index, name in enumerate(columns)
            }
        )
    if repeating:
        warnings.warn(
            f"{repeating} of {len(batches)} {what} hold a text twice in a column: in-batch losses "
            "(MultipleNegativesRankingLoss) count its copy as a negative; drop duplicates or shuffle them apart",
            stacklevel=2,
        )
    return batches


def read_pairs(
    source: str, columns: Sequence[str] | None = None, split: str = "train", streaming: bool = False,
    config: str | None = None,
) -> list[tuple[str, ...]]:
    """Text pairs (anchor, positive) from a file or a datasets dataset; (anchor, positive, negative) triplets where
    three ``columns`` are named.

    A ``.tsv`` file holds two tab-separated fields a line (no header; a field in quotes with its own quotes doubled,
    as csv writers quote, is unquoted); ``.jsonl`` one object a line; ``.csv`` a
    header row, then one pair a row. ``.jsonl``, ``.csv`` and datasets take the two or three ``columns`` named, by
    default their first two (of a ``.jsonl`` file, its first line's, wherever later lines put them; a warning names
    the columns left out). Any other
    ``source`` that is not a file is a datasets name (its ``config`` and ``split``). Raises ValueError naming the
    file and line of a pair it cannot read.
    """
    if columns is not None and len(columns) not in (2, 3):
        raise ValueError(f"name two columns (anchor, positive) or three (anchor, positive, negative), got "
                         f"{len(columns)}: {', '.join(map(str, columns))}")
    path = Path(source)
    if not path.exists() and path.suffix.lower() in (".tsv", ".jsonl", ".csv"):
        raise ValueError(f"no file at {source!r}: pairs are read from .tsv, .jsonl or .csv files (or a datasets name)")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in (".tsv", ".jsonl", ".csv"):
            raise ValueError(f"{source}: pairs are read from .tsv, .jsonl or .csv files (or a datasets name)")
        if suffix == ".tsv" and columns:
            raise ValueError(f"{source}: a .tsv file has no column names (two texts a line, no header); name columns "
                             "in a .jsonl or .csv file")
        with io.StringIO(_utf8_text(path), newline="") as file:
            if suffix == ".tsv":
                rows = [
                    (number, line.rstrip("\r\n").split("\t")) for number, line in enumerate(file, 1) if line.strip()
                ]
                pairs = [_tab_separated_pair(fields, f"{source} line {number}") for number, fields in rows]
            elif suffix == ".jsonl":
                records = [(number, _json_line(line, f"{source} line {number}"))
                           for number, line in enumerate(file, 1) if line.strip()]
                if columns is None and records and isinstance(records[0][1], Mapping):
                    _warn_of_columns_left_out(list(records[0][1]), columns, source)
                    columns = list(records[0][1])[:2]  # the file's columns: its first line's, on every line
                pairs = [_column_pair(record, columns, f"{source} line {number}") for number, record in records]
            else:
                reader = csv.DictReader(file)
                _warn_of_columns_left_out(reader.fieldnames or [], columns, source)
                pairs = _csv_pairs(reader, columns, source)
    else:
        import datasets

        dataset = datasets.load_dataset(source, config, split=split, streaming=streaming)
        _warn_of_columns_left_out(dataset.column_names or [], columns, source)
        pairs = [
            _column_pair(record, columns, f"{source} ({split}) row {number}") for number, record in enumerate(dataset)
        ]
    if not pairs:
        raise ValueError(f"{source} holds no pairs")
    return pairs


def _warn_of_columns_left_out(names: Sequence[str], columns: Sequence[str] | None, source: str) -> None:
    """A warning naming the columns (``names``: the source's) that the default pair (its first two) leaves out: a
    third column of hard negatives would be dropped without a word. Called from `read_pairs`, whose caller it
    names."""
    left_out = list(names)[2:] if columns is None else []
    if left_out:
        warnings.warn(f"{source}: the pairs are its first two columns ({', '.join(map(str, names[:2]))}); "
                      f"left out: {', '.join(map(str, left_out))} (to take a column of hard negatives, name three "
                      "columns, anchor, positive and negative: --pair-columns A P --negative-column N, or columns=)",
                      stacklevel=3)


def _csv_pairs(reader: csv.DictReader, columns: Sequence[str] | None, source: str) -> list[tuple[str, ...]]:
    """The pairs of a .csv file's records, each named by the line it ends on (a quoted text may span lines); a record
    of more fields than the header names is refused (an unquoted comma split a text, and the rest was dropped)."""
    pairs = []
    for record in reader:
        where = f"{source} line {reader.line_num}"
        if any(field.strip() for field in record.get(None, ())):  # empty ones: a line ending in a comma
            raise ValueError(f"{where}: {len(reader.fieldnames) + len(record[None])} comma-separated fields, where "
                             f"the header names {len(reader.fieldnames)}; put texts with commas in quotes (\"a, b\")")
        pairs.append(_column_pair(record, columns, where))
    return pairs


def _tab_separated_pair(fields: list[str], where: str) -> tuple[str, str]:
    """A .tsv line's two texts; a text in quotes as csv writers quote it (pandas' ``to_csv(sep="\\t")``, Python's
    csv: the whole field quoted, its own quotes doubled) is unquoted."""
    while len(fields) > 2 and not fields[-1]:  # trailing tabs
        fields = fields[:-1]
    if len(fields) > 2:  # the rest would be dropped: a text with tabs in it
        raise ValueError(f"{where}: {len(fields)} tab-separated fields, where a .tsv pair line holds two; texts with "
                         "tabs in them, or triplets with hard negatives, go in a .jsonl or .csv file")
    fields = [_unquoted(field) for field in fields]
    if len(fields) < 2 and fields[0].startswith('"'):  # a quote a csv writer opened, closed on a later line
        raise ValueError(f"{where}: one field, which opens a quote: a text spanning lines (quoted so by pandas or "
                         "Python's csv) cannot be read from a .tsv file; write the pairs to a .csv or .jsonl file")
    return _pair(fields, where)


def _unquoted(field: str) -> str:
    """``field`` without the quotes a csv writer puts around a text holding a quote (its own quotes doubled)."""
    inner = field[1:-1]
    if len(field) >= 2 and field[0] == field[-1] == '"' and '"' not in inner.replace('""', ""):
        return inner.replace('""', '"')
    return field


def _utf8_text(path: Path) -> str:
    """The file's text; a byte-order mark (Excel's "CSV UTF-8") is no text; bytes that are not UTF-8 are named by
    their line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: byte {data[error.start]:#04x} is not UTF-8 text; save the file as "
                         "UTF-8") from None


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON object ({error.msg} at column {error.colno})") from None


def _column_pair(record: Any, columns: Sequence[str] | None, where: str) -> tuple[str, ...]:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object with the pair's columns, got {type(record).__name__}")
    names = list(columns) if columns else list(record)[:2]
    missing = [name for name in names if name not in record]
    if not missing and len(names) < 2:
        raise ValueError(f"{where}: one column ({', '.join(map(str, record))}), where a pair takes two: the anchor's "
                         "text and the positive's")
    if missing:
        raise ValueError(f"{where}: no column {missing[0]!r} (columns: "
                         f"{', '.join(map(str, record))}); name the pair's columns with --pair-columns")
    not_texts = [name for name in names if not (isinstance(record[name], str) and record[name].strip())]
    if not_texts:
        kind = type(record[not_texts[0]]).__name__
        held = "an empty text" if kind == "str" else f"a value of type {kind}"
        raise ValueError(f"{where}: column {not_texts[0]!r} holds {held}, not a text (columns: "
                         f"{', '.join(map(str, record))}); name the pair's columns with --pair-columns")
    return tuple(record[name] for name in names)


def _pair(fields: Sequence[Any], where: str) -> tuple[str, str]:
    if len(fields) < 2 or not all(isinstance(field, str) and field.strip() for field in fields[:2]):
        raise ValueError(f"{where}: expected two non-empty texts, got {list(fields)[:3]!r}")
    return fields[0], fields[1]
