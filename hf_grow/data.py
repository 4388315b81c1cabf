"""Text to batches for the command line: local files or a `datasets` dataset, tokenized into fixed windows."""

from __future__ import annotations

import glob
import os
import re
import warnings
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator

import torch
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerBase

from .option_values import held_out_count


#: Held-out tokens read from a separate split, and the most held out of the same text by default.
DEFAULT_EVAL_TOKENS = 50_000
#: A file whose bytes are more than this share not text (not UTF-8, or control characters) is refused:
#: binary data, UTF-16, or text in another encoding; a smaller share is read as U+FFFD with a warning.
MAX_NOT_TEXT_SHARE = 0.1
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\udc80-\udcff]")  # control characters, undecodable bytes


class TextFileError(ValueError):
    """A ``--data`` path that cannot be read as text (missing, a folder, unreadable, or binary), or a dataset whose
    text column holds something else."""


#: Text files are read in pieces of about this many bytes, each cut after a line end: a large corpus file is read
#: (and held in memory) only as far as the tokens wanted, not whole.
READ_BYTES = 1 << 20


def read_text_files(patterns: list[str], warn: Callable[[str], None] = warnings.warn) -> Iterator[Iterator[str]]:
    """Every file matching ``patterns`` (paths or globs), in sorted order per pattern, as its text in pieces
    (`READ_BYTES`, cut after line ends), read as far as the pieces are taken (`token_windows` takes a file so).

    Folders matched by a glob are skipped; a folder named as such, a missing or unreadable file, or one that is
    not UTF-8 text (`decode_text`, piece by piece) raises `TextFileError`. A file named more than once (by two
    patterns, or by a path and a link to it) is read once, with a warning: the held-out tail must be text the
    statistics did not see. A ``.json``/``.jsonl`` file is read as text too, with a warning saying how to read a
    field of its records instead.
    """
    seen: set[str] = set()
    for pattern in patterns:
        for path in matching_paths(pattern):
            real = os.path.realpath(path)
            if real in seen:
                warn(f"--data names {path!r} more than once: read once")
                continue
            seen.add(real)
            if os.path.isdir(path):
                raise TextFileError(f"--data {path!r} is a folder: pass its text files, e.g. '{path}/*.txt'")
            if not os.path.isfile(path):
                raise TextFileError(f"no text file at {path!r}: --data takes text files or globs")
            if path.lower().endswith((".json", ".jsonl", ".csv", ".tsv")):
                warn(f"--data {path!r} is read as plain text, its syntax (JSON keys, a header, quotes) included: to "
                     "read one field of its records, put the file in a folder of its own and pass --dataset FOLDER "
                     "--text-column FIELD --eval-split train")
            yield _text_pieces(path, warn)


def _text_pieces(path: str, warn: Callable[[str], None]) -> Iterator[str]:
    """The text of ``path`` in pieces of about `READ_BYTES`, each ending after a line end (in a file without any,
    at a character's end), judged as text (`decode_text`) on all that was read so far; a warning about
    undecodable bytes once per file. Where a piece is cut, a tokenizer may split a token that the whole text would
    not (one token in a MiB at most)."""
    counts = [0, 0]  # bytes that are not text, bytes read
    try:
        with open(path, "rb") as handle:
            rest = b""
            while True:
                data = handle.read(READ_BYTES)
                text = rest + data
                cut = text.rfind(b"\n") + 1 if data else len(text)  # a line without an end stays for the next read
                if cut == 0 and len(text) >= READ_BYTES:  # no line end at all: cut before the last character
                    cut = len(text) - 1
                    while cut > 0 and text[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                        cut -= 1
                piece, rest = text[:cut], text[cut:]
                if piece:
                    yield decode_text(piece, path, warn if not counts[0] else lambda message: None, counts)
                if not data:
                    return
    except OSError as error:
        raise TextFileError(f"cannot read --data file {path!r}: {error.strerror or error}") from None


def matching_paths(pattern: str) -> list[str]:
    """The files a ``--data`` pattern names: a glob's matches that are not folders, in sorted order, or the pattern
    itself (``~`` expanded) when it is no glob or matches no file."""
    pattern = os.path.expanduser(pattern)
    matches = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else []
    return sorted(path for path in matches if not os.path.isdir(path)) or [pattern]


def decode_text(
    data: bytes, name: str, warn: Callable[[str], None] = warnings.warn, counts: list[int] | None = None
) -> str:
    """``data`` as UTF-8 text; refused if more than `MAX_NOT_TEXT_SHARE` of its bytes are not text (binary data
    would be grown on as noise), undecodable bytes read as U+FFFD with a warning otherwise. ``counts``: the bytes
    not text and all bytes of the file's pieces before this one, updated: the share is of the whole part read."""
    text = data.decode("utf-8", errors="surrogateescape")
    counts = [0, 0] if counts is None else counts
    counts[0] += len(_NOT_TEXT.findall(text))
    counts[1] += len(data)
    if not counts[0]:
        return text
    share = counts[0] / counts[1]
    if share > MAX_NOT_TEXT_SHARE:
        raise TextFileError(
            f"{name} is not text: {share:.0%} of its bytes are not UTF-8 text (binary data, UTF-16, or another "
            "encoding); pass UTF-8 text files (convert with e.g. iconv -t UTF-8)"
        )
    warn(f"{share:.2%} of the bytes of {name} are not UTF-8 text: read as U+FFFD")
    return data.decode("utf-8", errors="replace")


def read_dataset(
    name: str, config: str | None, split: str, text_column: str, streaming: bool, progress: bool = True
) -> Iterator[str]:
    """The ``text_column`` of a `datasets` split, one document at a time (a missing text, None, is an empty one)."""
    import datasets

    if not progress:
        datasets.disable_progress_bars()
    if (Path(name) / "state.json").is_file():  # load_dataset's own advice, load_from_disk, is no option of ours
        raise TextFileError(
            f"{name} holds one Dataset saved by save_to_disk, without splits: save it as a DatasetDict "
            "(DatasetDict({'train': dataset}).save_to_disk(folder)) or as text files (--data)"
        )
    dataset = datasets.load_dataset(name, config, split=split, streaming=streaming)
    columns = dataset.column_names or []
    if columns and text_column not in columns:
        raise KeyError(
            f"dataset {name!r} has no column {text_column!r}; columns: {', '.join(columns)} (use --text-column)"
        )
    for index, row in enumerate(dataset):
        text = row[text_column]
        if text is None:
            continue
        if not isinstance(text, str):
            raise TextFileError(
                f"dataset {name!r} ({split}) row {index}: column {text_column!r} holds a value of type "
                f"{type(text).__name__}, not a text (use --text-column)"
            )
        yield text


def token_windows(
    texts: Iterable[str | Iterable[str]], tokenizer: PreTrainedTokenizerBase, seq_len: int, max_tokens: int
) -> list[torch.Tensor]:
    """Concatenate the tokenized texts, each followed by the end-of-text token, and cut windows of ``seq_len``
    tokens. A text may come in pieces (an iterable of strings, as `read_text_files` gives a file): only as many
    are read as the windows need.

    Stops after ``max_tokens`` tokens of windows; a last partial window is dropped.
    """
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer: list[int] = []
    windows: list[torch.Tensor] = []

    def cut() -> bool:
        """Windows from the buffer, up to the ones wanted; whether they are all there."""
        count = min(len(buffer) // seq_len, -(-max_tokens // seq_len) - len(windows))
        windows.extend(torch.tensor(buffer[: count * seq_len], dtype=torch.long).view(count, seq_len).unbind())
        del buffer[: count * seq_len]  # once per piece: a long document is cut in linear time
        return len(windows) * seq_len >= max_tokens

    for text in texts:
        read = False
        for piece in [text] if isinstance(text, str) else text:
            if piece:
                read = True
                buffer.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
                if cut():
                    return windows
        if read:
            buffer.extend(separator)
            if cut():
                return windows
    return windows


def split_held_out(
    windows: list[torch.Tensor], window: int, max_tokens: int, eval_tokens: int | None, eval_fraction: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Statistics windows and held-out windows (the tail) of one text cut into windows of ``window`` tokens.

    Held out: ``eval_tokens`` tokens in whole windows (at least one) when given; otherwise the last
    ``eval_fraction`` of the windows (counted as `grow_model` counts the batches it holds out) and at most
    `DEFAULT_EVAL_TOKENS` tokens. The statistics are the windows before them, at most ``max_tokens`` tokens.
    Errors name the option that fixes them.
    """
    if len(windows) < 2:
        raise ValueError(
            f"the text is too short: it gives {len(windows)} sequence(s) of {window} tokens, and growth needs one for "
            "the statistics and one held out at least; pass more text or a smaller --seq-len"
        )
    if eval_tokens is not None:
        count = max(1, eval_tokens // window)
        if count >= len(windows):
            raise ValueError(
                f"--eval-tokens {eval_tokens} holds out all {len(windows)} sequences of {window} tokens of the text, "
                f"leaving none for the statistics: pass a smaller --eval-tokens (or leave it out to hold out "
                f"{eval_fraction:.0%} of the text)"
            )
    else:
        count = min(held_out_count(len(windows), eval_fraction), max(1, DEFAULT_EVAL_TOKENS // window))
        if count >= len(windows):
            raise ValueError(
                f"--eval-fraction {eval_fraction} holds out all {len(windows)} sequences of {window} tokens of the "
                "text, leaving none for the statistics: pass a smaller --eval-fraction, or more text"
            )
    statistics = windows[: len(windows) - count][: -(-max_tokens // window)]
    return statistics, windows[len(windows) - count :]


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
