"""The text side of the command: local files or a datasets split cut into token windows, the held-out tail, the
statistics and held-out batches for the model's loss, and the data described for the output and the model card.
"""

from __future__ import annotations

import argparse
import sys

from ..config import GrowthConfig
from ..data import (
    DEFAULT_EVAL_TOKENS,
    TextFileError,
    causal_lm_batches,
    masked_lm_batches,
    read_dataset,
    read_text_files,
    split_held_out,
    token_windows,
)
from .checks import CommandError, as_command_error, held_out_of_the_same_text
from .running import show_bars


def _dataset_windows(args: argparse.Namespace, tokenizer, window: int) -> tuple[list, list]:
    """Statistics windows from ``--split`` and held-out windows from ``--eval-split`` of a datasets dataset (or
    from the tail of ``--split`` when they are the same split)."""
    name = args.dataset or "wikitext"
    config = args.dataset_config or (None if args.dataset else "wikitext-2-raw-v1")

    def windows(split: str, max_tokens: int) -> list:
        texts = read_dataset(name, config, split, args.text_column, args.streaming, show_bars(args))
        return token_windows(texts, tokenizer, window, max_tokens)

    try:
        if held_out_of_the_same_text(args):
            return _split_held_out(args, windows(args.split, args.max_tokens + _most_held_out(args)), window)
        return windows(args.split, args.max_tokens), windows(args.eval_split, args.eval_tokens or DEFAULT_EVAL_TOKENS)
    except KeyError as error:
        raise CommandError(str(error).strip("'\"")) from None
    except TextFileError as error:
        raise CommandError(str(error)) from None
    except Exception as error:  # datasets raises many types for unreachable or unknown datasets
        if not args.dataset:
            raise CommandError(
                f"cannot reach the default dataset wikitext ({type(error).__name__}): pass local text with --data FILE"
            ) from None
        raise CommandError(f"cannot load dataset {args.dataset!r}: {str(error).splitlines()[0]}") from None


def _most_held_out(args: argparse.Namespace) -> int:
    return args.eval_tokens or DEFAULT_EVAL_TOKENS


def _split_held_out(args: argparse.Namespace, windows: list, window: int) -> tuple[list, list]:
    """The statistics and the held-out tail of one text (`hf_grow.data.split_held_out`), as one-line errors."""
    fraction = GrowthConfig.eval_fraction if args.eval_fraction is None else args.eval_fraction
    with as_command_error():
        return split_held_out(windows, window, args.max_tokens, args.eval_tokens, fraction)


def _warn(message: str) -> None:
    print(f"hf-grow: warning: {message}", file=sys.stderr)


def text_batches(
    args: argparse.Namespace, tokenizer, objective: str, is_main: bool = True, held_out_used: bool = True
) -> tuple[list, list]:
    """Statistics and held-out batches; local files give their tail as held-out text (`_split_held_out`);
    ``held_out_used``: whether the run uses the held-out batches (`hf-grow inspect` does not).

    Prints how many tokens each side got, and refuses token ids beyond the model's vocabulary.
    """
    window = args.seq_len
    if objective == "masked":
        if tokenizer.mask_token_id is None:
            raise CommandError(f"the tokenizer of {args.model!r} has no mask token: masked-LM loss needs one")
        window -= (tokenizer.cls_token_id is not None) + (tokenizer.sep_token_id is not None)
        if window < 1:
            raise CommandError(
                f"--seq-len {args.seq_len} leaves no text token beside the tokenizer's [CLS] and [SEP]: pass a "
                "larger --seq-len"
            )
    if args.data:
        with as_command_error(TextFileError):
            texts = read_text_files(args.data, warn=_warn if is_main else lambda message: None)
            windows = token_windows(texts, tokenizer, window, args.max_tokens + _most_held_out(args))
        statistics, held_out = _split_held_out(args, windows, window)
    else:
        statistics, held_out = _dataset_windows(args, tokenizer, window)
    if not statistics or not held_out:
        raise CommandError(
            f"the text is too short: it gives {len(statistics)} statistics and {len(held_out)} held-out sequences "
            f"of {window} tokens; pass more text or a smaller --seq-len"
        )
    _check_token_ids(args, statistics + held_out)
    if is_main:
        max_batches = getattr(args, "config", None) and args.config.max_batches  # inspect takes every batch
        used = len(statistics) if max_batches is None else min(len(statistics), max_batches * args.batch_size)
        print(_split_description(args, used * window, len(held_out) * window), flush=True)
    if objective == "causal":
        return causal_lm_batches(statistics, args.batch_size), causal_lm_batches(held_out, args.batch_size)
    batches = (masked_lm_batches(statistics, args.batch_size, tokenizer, args.mlm_probability, args.seed),
               masked_lm_batches(held_out, args.batch_size, tokenizer, args.mlm_probability, args.seed + 1))
    for side, sequences, kept in (("statistics", statistics, batches[0]), ("held-out", held_out, batches[1])):
        # batches that mask nothing are dropped (no loss term): the API's "yielded no batches" followed
        if not kept and (side == "statistics" or held_out_used):
            raise CommandError(
                f"the masking (--mlm-probability {args.mlm_probability}, --seed {args.seed}) masked no token of the "
                f"{len(sequences)} {side} sequences: pass a larger --mlm-probability, or more text for them"
            )
    return batches


def _split_description(args: argparse.Namespace, statistics_tokens: int, held_out_tokens: int) -> str:
    """One line: the tokens of each side and where the held-out ones come from."""
    if not held_out_of_the_same_text(args):
        source = f"from --eval-split {args.eval_split}"
    elif args.eval_tokens is not None:
        source = "the tail of the text, --eval-tokens"
    else:
        fraction = GrowthConfig.eval_fraction if args.eval_fraction is None else args.eval_fraction
        source = (f"the last {fraction:.0%} of the text read, --max-tokens and up to {DEFAULT_EVAL_TOKENS:,} after, at "
                  f"most {DEFAULT_EVAL_TOKENS:,}: --eval-fraction, --eval-tokens")
    return f"text: {statistics_tokens:,} tokens for the statistics, {held_out_tokens:,} held out ({source})"


def _check_token_ids(args: argparse.Namespace, windows: list) -> None:
    """A tokenizer that does not belong to the model gives ids past its embeddings (an IndexError, or a device
    assert on a GPU): refused before the model is loaded."""
    largest = max(int(window.max()) for window in windows)
    if args.vocab_size is not None and largest >= args.vocab_size:
        raise CommandError(
            f"the tokenizer of {args.model!r} gives token id {largest}, past the model's vocabulary of "
            f"{args.vocab_size}: the tokenizer does not belong to this model; save the model's own tokenizer with it"
        )


def data_description(args: argparse.Namespace) -> tuple[str, list[str]]:
    """What the statistics were collected on, in words, and the Hub datasets among it (for the model card)."""
    if args.data:
        shown = ", ".join(f"`{pattern}`" for pattern in args.data[:3])
        return f"local text ({shown}{', ...' if len(args.data) > 3 else ''})", []
    name = args.dataset or "wikitext"
    config = args.dataset_config or (None if args.dataset else "wikitext-2-raw-v1")
    held_out = "its tail" if held_out_of_the_same_text(args) else f"`{args.eval_split}`"
    return f"`{name}`{f' ({config})' if config else ''}, split `{args.split}` (held out: {held_out})", [name]
