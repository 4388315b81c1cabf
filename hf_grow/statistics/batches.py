"""Batches and losses as the statistics and the line search see them: (nested) batches on the model's device,
their tokens, loss terms and losses, and the train/eval flags restored around them.

A batch is a dict passed as ``model(**batch)``, or, for a ``loss_fn`` that runs the model several times (one
forward pass per text column, as sentence-transformers' losses do), any nesting of dicts (also
`BatchEncoding`), lists and tuples whose leaves are tensors, or plain values (strings, numbers, None) that are
passed through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.utils import find_labels

from ..adapters import ArchitectureAdapter, position_limit


LossFn = Callable[[PreTrainedModel, Any], Tensor]

_PLAIN_LEAVES = (str, bytes, int, float, bool, type(None))
_TOKEN_KEYS = ("input_ids", "inputs_embeds")


def check_loss_fn(loss_fn: Any) -> None:
    """A ValueError, before any work, for a ``loss_fn`` that cannot be called as ``loss_fn(model, batch)``."""
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(model, batch) -> scalar Tensor, got {loss_fn!r}")


def describe(value: Any) -> str:
    """A short description of a batch's structure for error messages, e.g. ``dict(a: BatchEncoding, b: list)``."""
    if isinstance(value, Mapping):
        items = ", ".join(f"{key}: {type(item).__name__}" for key, item in list(value.items())[:6])
        return f"{type(value).__name__}({items}{', ...' if len(value) > 6 else ''})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def walk_tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    """Every tensor of a nested batch with its path (``batch['a']['input_ids']``), depth first in order.

    Raises a TypeError naming the path and type of anything that is neither a dict, list, tuple, tensor nor a
    plain value: hf_grow could not move it to the model's device or count its tokens.
    """
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from walk_tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from walk_tensors(value, f"{path}[{index}]")
    elif not isinstance(batch, _PLAIN_LEAVES):
        raise TypeError(
            f"{path} is a {type(batch).__module__}.{type(batch).__qualname__}: hf_grow handles batches of dicts "
            "(also BatchEncoding), lists and tuples of tensors; convert it to tensors (e.g. torch.as_tensor) "
            "or build the batch from such containers."
        )


def map_tensors(batch: Any, function: Callable[[Tensor], Tensor]) -> Any:
    """The batch with ``function`` applied to every tensor, its containers' types kept where they can be."""
    if isinstance(batch, Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        mapped = {key: map_tensors(value, function) for key, value in batch.items()}
        if type(batch) is dict:
            return mapped
        try:
            return type(batch)(mapped)  # BatchEncoding, UserDict, OrderedDict ...
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(value, function) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, function) for value in batch)
    return batch


def token_shapes(batch: Any) -> list[torch.Size]:
    """The (..., s) shapes of every token input in a nested batch: each ``input_ids``, and each ``inputs_embeds``
    without the embedding dimension (e.g. (b, choices, s) for multiple choice)."""
    shapes: list[torch.Size] = []
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            if key in _TOKEN_KEYS and isinstance(value, Tensor):
                shapes.append(value.shape if key == "input_ids" else value.shape[:-1])
            else:
                shapes.extend(token_shapes(value))
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            shapes.extend(token_shapes(value))
    return shapes


def is_flat(batch: Any) -> bool:
    """Whether ``batch`` is a dict of tensors and plain values, as ``model(**batch)`` takes."""
    return isinstance(batch, Mapping) and not any(isinstance(value, (Mapping, list, tuple)) for value in batch.values())


def iterate_batches(dataloader: Iterable[Any], model: PreTrainedModel) -> Iterator[Any]:
    """Batches on the model's device, each checked first (`check_batch`)."""
    device = next(model.parameters()).device
    for index, batch in enumerate(dataloader):
        check_batch(batch, f"batch {index}", model)
        yield map_tensors(batch, lambda tensor: tensor.to(device))


def check_batch(batch: Any, name: str, model: PreTrainedModel) -> None:
    """A clear error, naming the batch (``name``), for a batch that is not a dict (or a list or tuple of them), for
    leaves that are not tensors, and for sequences longer than the model's positions (which would otherwise fail
    deep inside the embedding lookup)."""
    if not isinstance(batch, (Mapping, list, tuple)):
        raise TypeError(
            f"{name} is a {type(batch).__name__}; hf_grow expects dict batches passed as model(**batch), "
            "e.g. from a DataLoader with transformers' DataCollatorForLanguageModeling (or, for a loss_fn, "
            "dicts, lists and tuples of them)."
        )
    for _ in walk_tensors(batch, name):
        pass  # an unhandled leaf is a TypeError naming it, before the model runs
    if isinstance(batch, Mapping):
        _check_padding_mask(name, batch)
    for path, key, value in _model_inputs(batch, name):
        _check_model_input(path, key, value)
    shapes = token_shapes(batch)
    if any(len(shape) < 2 for shape in shapes):
        raise ValueError(
            f"{name} holds token inputs without a batch dimension (shape {tuple(min(shapes, key=len))}): these look "
            "like rows of a dataset; batch them with a DataLoader and a collator, e.g. DataLoader(dataset, "
            "batch_size=8, collate_fn=DataCollatorWithPadding(tokenizer))."
        )
    _check_token_ids(batch, name, model)
    positions = position_limit(model.config)
    lengths = [shape[-1] for shape in shapes]
    if positions is not None and lengths and max(lengths) > positions:
        raise ValueError(
            f"{name} holds sequences of {max(lengths)} tokens, but the model has {positions} positions "
            "(config.max_position_embeddings): cut the sequences to at most that many tokens."
        )


def _check_token_ids(batch: Any, name: str, model: PreTrainedModel) -> None:
    """Token ids outside the model's embedding table (another model's tokenizer), or token type (segment) ids
    outside BERT's ``type_vocab_size``: an IndexError on the CPU, a device-side assert that ends the process's CUDA
    context on a GPU."""
    tables = {"input_ids": (getattr(model.get_input_embeddings(), "num_embeddings", None), "token id",
                            "embeddings: tokenize with the model's own tokenizer")}
    token_types = getattr(getattr(model.base_model, "embeddings", None), "token_type_embeddings", None)
    if token_types is not None:
        tables["token_type_ids"] = (token_types.num_embeddings, "token type id",
                                    "token types (config.type_vocab_size): drop token_type_ids, or tokenize so")
    else:  # GPT-2 embeds token types as tokens
        tables["token_type_ids"] = (tables["input_ids"][0], "token type id", "embeddings, where it embeds token types")
    for path, key, value in _model_inputs(batch, name):
        size, what, advice = tables.get(key, (None, "", ""))
        if size is not None and isinstance(value, Tensor) and value.numel():
            low, high = int(value.min()), int(value.max())
            if low < 0 or high >= size:
                raise ValueError(f"{path} holds {what} {high if high >= size else low}, outside the model's {size} "
                                 f"{advice}.")


def check_labels(batch: Any, name: str, model: PreTrainedModel, loss_fn: LossFn | None) -> None:
    """Without a ``loss_fn``, a flat batch must hold what the model computes its loss from (``labels``, or a
    question-answering head's ``start_positions``...): found before the statistics pass, not in the line search."""
    if loss_fn is not None or not is_flat(batch):
        return
    names = find_labels(type(model))  # none where forward does not name them (**kwargs): the line search decides
    if names and not any(label in batch for label in names):
        raise ValueError(
            f"{name} holds no {' or '.join(names)}, so the model computes no loss from it: put labels in the "
            "batches (e.g. labels=input_ids for a causal LM, with DataCollatorForLanguageModeling), or pass loss_fn."
        )


def _model_inputs(batch: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(path, key, value)`` of every entry of the dicts in a nested batch."""
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            yield f"{path}[{key!r}]", key, value
            yield from _model_inputs(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _model_inputs(value, f"{path}[{index}]")


def _check_model_input(path: str, key: str, value: Any) -> None:
    """Inputs that would fail inside the model, or mislead the statistics, refused with what to pass instead."""
    if (key in (*_TOKEN_KEYS, "attention_mask") and isinstance(value, (list, tuple))
            and not any(isinstance(item, Tensor) for item in value)):  # a loss_fn's batch may hold lists of tensors
        raise TypeError(f"{path} is a {type(value).__name__}, not a tensor: call the tokenizer with "
                        "return_tensors='pt', or batch rows with a DataLoader and a collator.")
    if key == "return_dict" and value is False:
        raise ValueError(f"{path} is False: hf_grow reads the model's outputs.loss; leave return_dict out.")
    if isinstance(value, Mapping):
        _check_padding_mask(path, value)


def _check_padding_mask(path: str, inputs: Mapping[str, Any]) -> None:
    """An ``attention_mask`` beside token inputs must have their shape (a padding mask): hf_grow counts tokens with
    it. (A multiple-choice mask is (batch, choices, sequence), as its tokens.)"""
    mask = inputs.get("attention_mask")
    tokens = token_shapes({key: inputs[key] for key in _TOKEN_KEYS if key in inputs})
    if isinstance(mask, Tensor) and tokens and mask.shape != tokens[0]:
        raise ValueError(
            f"{path}['attention_mask'] has shape {tuple(mask.shape)} against the tokens' {tuple(tokens[0])}: hf_grow "
            "counts tokens with a padding mask of the tokens' shape, and a 4-D mask (packed sequences, custom "
            "attention) is not supported: pass the sequences unpacked, padded, with a padding mask."
        )


def batch_loss_weight(adapter: ArchitectureAdapter, model: PreTrainedModel, batch: Any, loss_fn: LossFn | None) -> int:
    """How many loss terms the batch's loss averages over (`ArchitectureAdapter.loss_weight`); with a custom
    ``loss_fn``, whose normalization hf_grow cannot see, its number of examples: the length of the first tensor
    in the batch (depth first; for a batch of text columns, the rows every column shares)."""
    if loss_fn is None:
        if not is_flat(batch):
            listed = sorted(key for key, value in batch.items() if isinstance(value, (list, tuple))) if isinstance(
                batch, Mapping) else []
            stack = f"stack {listed} into tensors (a DataLoader with a collator does), or " if listed else ""
            raise TypeError(
                f"a batch of {describe(batch)} cannot be passed as model(**batch): {stack}pass loss_fn(model, batch), "
                "which runs the model on each part (e.g. hf_grow.SentenceLoss for a sentence-transformers loss)."
            )
        return adapter.loss_weight(model, batch)
    for _, tensor in walk_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    raise ValueError(
        f"a batch of {describe(batch)} holds no tensor with a batch dimension: hf_grow weights a loss_fn's batches "
        "by their number of examples, the length of their first tensor. Put the inputs' tensors in the batch."
    )


def compute_loss(model: PreTrainedModel, batch: Any, loss_fn: LossFn | None) -> Tensor:
    """``loss_fn(model, batch)``, or the model's own ``outputs.loss`` (from float32 logits: `float32_logits`)."""
    if loss_fn is not None:
        return loss_fn(model, batch)
    with float32_logits(model):
        outputs = model(**batch)
    if isinstance(outputs, tuple):  # config.return_dict False (set for TorchScript or ONNX export)
        raise ValueError(
            f"{type(model).__name__} returned a tuple, not its outputs with a loss field: its config has "
            "return_dict=False; set model.config.return_dict = True, or pass loss_fn(model, batch) -> Tensor."
        )
    loss = getattr(outputs, "loss", None)  # a model without a head (BertModel) returns no loss field at all
    if loss is None:
        raise ValueError(
            "the model returned no loss: put labels in the batches (e.g. labels=input_ids for a causal LM) "
            "or pass loss_fn(model, batch) -> Tensor (a model without a head, such as BertModel, needs one)."
        )
    return loss


#: The modules whose output is the logits of transformers' classification, question-answering and next-sentence heads
#: (a language model's are its output embeddings).
_HEAD_NAMES = ("classifier", "score", "qa_outputs", "cls.seq_relationship")
_HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def float32_logits(model: nn.Module) -> Iterator[None]:
    """Inside, a half-precision model's head returns float32 logits, so that its own loss is computed in float32:
    transformers' masked-LM and classification heads compute their cross-entropy in the logits' dtype (a bfloat16
    loss moves in steps of 0.004 near 10 nats, which a line search took for gains), its causal LMs in float32."""
    inner = getattr(model, "module", model)  # DistributedDataParallel's model
    parameter = next((p for p in inner.parameters() if p.is_floating_point()), None)
    heads = []
    if parameter is not None and parameter.dtype in _HALF:
        output_embeddings = getattr(inner, "get_output_embeddings", lambda: None)()
        heads = [head for head in (output_embeddings, *(_submodule(inner, name) for name in _HEAD_NAMES))
                 if isinstance(head, nn.Module)]
    handles = [head.register_forward_hook(_as_float32) for head in heads]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    for part in name.split("."):
        model = getattr(model, part, None)
    return model


def _as_float32(module: nn.Module, args: tuple, output: Any) -> Any:
    return output.float() if isinstance(output, Tensor) and output.dtype in _HALF else output


#: A config without a ``use_cache`` field (`without_kv_cache` leaves it without one).
_ABSENT = object()


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """``config.use_cache = False`` for every config of ``model`` inside, restored as it was on exit (also on error).

    Passes run for a loss or its gradient need no key/value cache, which a causal LM otherwise builds on every
    forward (2 x layers x tokens x hidden: 403 MB per batch of 8 x 256 tokens at GPT-2 medium) and drops; a
    checkpointed layer recomputed in backward would append to it twice.
    """
    configs = {id(module.config): module.config for module in model.modules()
               if hasattr(getattr(module, "config", None), "to_dict")}
    saved = [(config, vars(config).get("use_cache", _ABSENT)) for config in configs.values()]
    for config, _ in saved:
        config.use_cache = False
    try:
        yield
    finally:
        for config, value in saved:
            if value is _ABSENT:
                del config.use_cache
            else:
                config.use_cache = value


def module_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every submodule's own train/eval flag (a dropout turned off inside a training model, say)."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Set back the flags `module_modes` took: ``model.train(flag)`` would set one flag on every submodule."""
    for module, training in modes:
        module.training = training
