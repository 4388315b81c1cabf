"""``hf-grow MODEL --pairs FILE``: grow a SentenceTransformer on text pairs with MultipleNegativesRankingLoss.

The pairs' last ``--eval-pairs`` (10% by default) are held out for the line search; the rest give the statistics.
The output folder is written by sentence-transformers (modules.json, pooling and normalization config, tokenizer)
with the grown model's weights, config, modeling files and growth report, and the growth card, atomically as the
main command's, and pushed with ``--push-to-hub``.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from safetensors import SafetensorError

from ..adapters import position_limit
from ..distributed import OtherProcessFailed, Processes
from ..growth import grow_model
from ..progress import stage
from ..statistics import return_free_memory
from ..statistics import GrowthStatistics
from .checks import CommandError, as_command_error, check_cross_fit_batches
from .loading import DTYPES
from .running import MAIN_WRITES, finish_run, shard_batches, write_card, write_folder_atomically


def add_pairs_arguments(parser: argparse.ArgumentParser) -> None:
    pairs = parser.add_argument_group("sentence-transformers models (instead of --data or --dataset)")
    pairs.add_argument(
        "--pairs", metavar="FILE",
        help="text pairs (anchor, positive) to grow a SentenceTransformer on with MultipleNegativesRankingLoss: a "
        ".tsv (two tab-separated texts a line), .jsonl or .csv file, or a datasets name (its --split)",
    )
    pairs.add_argument("--pair-columns", nargs=2, metavar=("ANCHOR", "POSITIVE"),
                       help="the pair's columns in a .jsonl or .csv file or a dataset (default: the first two)")
    pairs.add_argument("--negative-column", metavar="NEGATIVE",
                       help="a third column, of hard negatives (with --pair-columns): (anchor, positive, negative) "
                       "triplets")
    pairs.add_argument("--eval-pairs", type=int,
                       help="held-out pairs for the line search: the last ones (default 10%% in whole batches, at "
                            "least one batch)")


def check_pairs_arguments(args: argparse.Namespace, text_options: list[str]) -> None:
    """``--pairs``' own checks, before the memory plan and any data; ``text_options``: the options given that only
    text is read with."""
    if args.data or args.dataset:
        raise CommandError("--pairs grows a SentenceTransformer on text pairs: give no --data or --dataset")
    if text_options:
        raise CommandError(
            f"{', '.join(text_options)} appl{'ies' if len(text_options) == 1 else 'y'} to text, not to --pairs (its "
            "options: --pair-columns, --negative-column, --eval-pairs, --split and --dataset-config of a dataset, "
            "--streaming)"
        )
    # MultipleNegativesRankingLoss takes each batch's other positives as a pair's negatives: one pair alone has a
    # loss of 0 whatever the weights
    if args.batch_size < 2:
        raise CommandError(f"--batch-size must be at least 2 with --pairs (the other pairs of a batch are a pair's "
                           f"negatives), got {args.batch_size}")
    if args.negative_column is not None and args.pair_columns is None:
        raise CommandError("--negative-column is a third column beside the pair's: name those too (--pair-columns "
                           "ANCHOR POSITIVE)")
    if args.eval_pairs is not None and args.eval_pairs < 2:
        raise CommandError(f"--eval-pairs must be at least 2 (the other pairs of a batch are a pair's negatives), "
                           f"got {args.eval_pairs}")
    if importlib.util.find_spec("sentence_transformers") is None:
        raise CommandError('--pairs needs sentence-transformers: pip install "hf_grow[sentence-transformers]"')


def default_eval_pairs(num_pairs: int, batch_size: int) -> int:
    """The pairs held out without ``--eval-pairs``: a tenth in whole batches (a smaller last batch has fewer
    negatives: an easier loss), at least one batch."""
    return max(batch_size, num_pairs // 10 // batch_size * batch_size)


def grow_from_pairs(args: argparse.Namespace, accelerator, started: float, is_main: bool,
                    show_progress: bool, statistics: GrowthStatistics | None) -> None:
    """``--pairs``: a SentenceTransformer grown with MultipleNegativesRankingLoss on text pairs, saved by
    sentence-transformers (its modules, pooling and normalization config) with the grown model inside;
    ``statistics``: those of ``--stats``, read and checked already."""
    from sentence_transformers import SentenceTransformer

    from ..sentence import read_pairs, tokenize_pairs, transformer_module

    if not show_progress and not Path(args.pairs).is_file():  # a datasets name: its bars end up in the error output
        import datasets

        datasets.disable_progress_bars()
    try:
        columns = args.pair_columns  # and the negatives' (checked: named with the pair's)
        if args.negative_column is not None:
            columns = [*columns, args.negative_column]
        pairs = read_pairs(args.pairs, columns, args.split, args.streaming, args.dataset_config)
    except (ValueError, OSError) as error:
        raise CommandError(f"--pairs: {str(error).splitlines()[0]}") from None
    except Exception as error:  # datasets' own, e.g. a folder whose files have other columns: its cause says which
        if not type(error).__module__.startswith("datasets"):
            raise
        said = [line for line in str(error).splitlines() if line.strip()]
        cause = str(error.__cause__ or error.__context__ or "").splitlines()
        cause = f"{cause[0]}{f' ... {cause[-1]}' if len(cause) > 1 else ''}" if cause else ""
        why = said[1] if len(said) > 1 else cause
        raise CommandError(f"--pairs {args.pairs}: {said[0] if said else type(error).__name__}"
                           f"{f' ({why})' if why else ''}; give a .csv, .jsonl or .tsv file, or a dataset whose files "
                           "have the same columns") from None
    num_eval = args.eval_pairs or default_eval_pairs(len(pairs), args.batch_size)
    if len(pairs) - num_eval < 2:  # one pair alone has no negatives: a loss of 0 whatever the weights
        lower = ("--eval-pairs" if args.eval_pairs else
                 "--batch-size, which sets the default share held out, or give a smaller --eval-pairs")
        raise CommandError(f"--pairs {args.pairs} holds {len(pairs)} pairs: too few to hold out {num_eval} for the "
                           f"line search and keep two for the statistics (lower {lower}, or pass more pairs)")
    try:
        model = SentenceTransformer(args.model, device=args.device, model_kwargs={"dtype": DTYPES[args.dtype]})
        transformer_module(model)  # exactly one transformers model inside, or a ValueError saying so
    except (OSError, ValueError) as error:
        raise CommandError(
            f"cannot load {args.model!r} as a SentenceTransformer: {str(error).splitlines()[0]}"
        ) from None
    if args.seq_len:
        if args.seq_len < 3:  # [CLS] and [SEP] alone: every text the same, a loss no weight changes
            raise CommandError(f"--seq-len {args.seq_len} leaves no text token beside the tokenizer's [CLS] and "
                               "[SEP]: pass a larger --seq-len")
        positions = position_limit(transformer_module(model).model.config)
        if positions is not None and args.seq_len > positions:
            raise CommandError(f"--seq-len {args.seq_len} exceeds the {positions} positions of {args.model!r}")
        model.max_seq_length = args.seq_len
    try:
        statistics_pairs = tokenize_pairs(pairs[:-num_eval], model, args.batch_size, what="statistics batches")
        held_out_pairs = tokenize_pairs(pairs[-num_eval:], model, args.batch_size, what="held-out batches")
    except ValueError as error:  # e.g. a tokenizer without a padding token (a decoder's)
        raise CommandError(f"cannot tokenize the pairs for {args.model!r}: {str(error).splitlines()[0]}") from None
    # --max-batches counts all the processes' batches (grow_model's max_batches counts each process's own)
    statistics_pairs = statistics_pairs[: args.config.max_batches]
    # every text column's real tokens, as the statistics count them (one forward pass a column)
    tokens = sum(int(column["attention_mask"].sum()) if "attention_mask" in column else column["input_ids"].numel()
                 for batch in statistics_pairs for column in batch.values())
    if statistics is not None and (statistics.num_batches, statistics.num_tokens) != (len(statistics_pairs), tokens):
        raise CommandError(
            f"--stats {args.stats} holds the statistics of {statistics.num_tokens:,} tokens in "
            f"{statistics.num_batches:,} batches, but these pairs give {tokens:,} tokens in {len(statistics_pairs):,} "
            f"batches for the statistics (the pairs before the last {num_eval} held out, in batches of "
            f"{args.batch_size}, the first --max-batches): collect them on those pairs, with these options"
        )
    if statistics is None:
        processes = 1 if accelerator is None else accelerator.num_processes
        check_cross_fit_batches(args.config.cross_fit, len(statistics_pairs), processes)
    statistics_batches = shard_batches(statistics_pairs, accelerator, "statistics")
    held_out_batches = shard_batches(held_out_pairs, accelerator, "held-out")
    with as_command_error(ValueError, TypeError, OtherProcessFailed):
        grown = grow_model(model, None if statistics else statistics_batches, config=args.config,
                           statistics=statistics, eval_dataloader=held_out_batches, accelerator=accelerator,
                           progress=show_progress)
    del model, statistics  # the grown model holds its own weights: saving it needs neither beside it
    return_free_memory()
    output = Path(args.output_dir)
    used = sum(len(next(iter(batch.values()))["input_ids"]) for batch in statistics_pairs)
    data = f"{used} text {'triplets' if len(pairs[0]) == 3 else 'pairs'} from {args.pairs}"

    def write(folder: Path) -> None:
        grown.save(str(folder))  # its modules, tokenizer and the grown transformers model
        write_card(args, folder, data, [] if Path(args.pairs).exists() else [args.pairs])  # a local file, or a dataset

    try:
        with Processes(accelerator).failing_together():
            if is_main:
                with stage(f"writing the grown model to {output}", enabled=show_progress):
                    write_folder_atomically(output, write, args.overwrite,
                                            done=lambda: args.written.append(f"the grown model to {output}"))
    except OtherProcessFailed as error:
        raise CommandError(f"{error}: {MAIN_WRITES}") from None
    except (OSError, SafetensorError) as error:
        raise CommandError(f"writing {output} failed ({error}); nothing was written") from None
    if is_main:
        finish_run(args, grown.growth_report, output, [
            grown.growth_report.summary(),
            f"wall time {time.perf_counter() - started:.1f} s"
            f"{f' on {accelerator.num_processes} processes' if accelerator is not None else ''}; grown "
            f"SentenceTransformer written to {output} "
            f"({used} pairs for the statistics, {num_eval} held out)",
        ])
