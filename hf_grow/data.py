"""Text to batches for the command line: local files or a `datasets` dataset, tokenized into fixed windows."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerBase


def read_text_files(patterns: list[str]) -> Iterator[str]:
    """The contents of every file matching ``patterns`` (paths or globs), in sorted order per pattern."""
    for pattern in patterns:
        paths = sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) or [pattern]
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no text file at {path!r}: --data takes text files or globs")
            with open(path, encoding="utf-8", errors="replace") as handle:
                yield handle.read()


def read_dataset(
    name: str, config: str | None, split: str, text_column: str, streaming: bool, progress: bool = True
) -> Iterator[str]:
    """The ``text_column`` of a `datasets` split, one document at a time."""
    import datasets

    if not progress:
        datasets.disable_progress_bars()
    dataset = datasets.load_dataset(name, config, split=split, streaming=streaming)
    columns = dataset.column_names or []
    if columns and text_column not in columns:
        raise KeyError(f"dataset {name!r} has no column {text_column!r}; columns: {', '.join(columns)} (use --text-column)")
    for row in dataset:
        yield row[text_column]


def token_windows(
    texts: Iterable[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, max_tokens: int
) -> list[torch.Tensor]:
    """Concatenate the tokenized texts and cut windows of ``seq_len`` tokens.

    Stops after ``max_tokens`` tokens of windows; a last partial window is dropped.
    """
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer: list[int] = []
    windows: list[torch.Tensor] = []
    for text in texts:
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + separator
        buffer.extend(ids)
        wanted = -(-max_tokens // seq_len) - len(windows)
        count = min(len(buffer) // seq_len, wanted)
        windows.extend(torch.tensor(buffer[: count * seq_len], dtype=torch.long).view(count, seq_len).unbind())
        del buffer[: count * seq_len]  # once per text: a long document is cut in linear time
        if len(windows) * seq_len >= max_tokens:
            break
    return windows


def causal_lm_batches(windows: list[torch.Tensor], batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Batches for next-token loss: full windows, so there is no padding and every label counts."""
    batches = []
    for start in range(0, len(windows), batch_size):
        input_ids = torch.stack(windows[start : start + batch_size])
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids})
    return batches


def masked_lm_batches(
    windows: list[torch.Tensor],
    batch_size: int,
    tokenizer: PreTrainedTokenizerBase,
    mlm_probability: float = 0.15,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Batches for masked-LM loss: each window between the tokenizer's [CLS]/[SEP] (when it has them), masked by
    transformers' standard `DataCollatorForLanguageModeling`. The masks are drawn once, from ``seed``, so every
    evaluation of the line search sees the same masked tokens."""
    if tokenizer.mask_token_id is None:
        raise ValueError("the tokenizer has no mask token: masked-LM batches need one")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability, seed=seed)
    prefix = [tokenizer.cls_token_id] if tokenizer.cls_token_id is not None else []
    suffix = [tokenizer.sep_token_id] if tokenizer.sep_token_id is not None else []
    batches = []
    for start in range(0, len(windows), batch_size):
        examples = [{"input_ids": prefix + window.tolist() + suffix} for window in windows[start : start + batch_size]]
        batch = dict(collator(examples))
        if (batch["labels"] != -100).any():  # a batch without masked tokens has no loss (0 / 0)
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batches.append(batch)
    return batches
