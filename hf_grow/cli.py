"""The ``hf-grow`` command: load a language model, read text, grow it, write the grown model atomically.

``hf-grow MODEL ...`` grows (and optionally pushes to the Hub); ``hf-grow inspect MODEL ...`` reports what growth
would gain per layer and head, without growing. Causal LMs (GPT-2) grow on next-token loss; masked LMs (BERT) on
masked-LM loss with transformers' standard collator. Any other objective goes through the Python API's ``loss_fn``.

Launched with several processes (``torchrun --nproc_per_node N -m hf_grow ...`` or ``accelerate launch``;
``WORLD_SIZE`` > 1), every process reads the same text, takes every N-th batch, and the statistics and
held-out losses are summed across processes; only the main process writes and pushes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import HfArgumentParser
from transformers.utils import logging as transformers_logging

from . import __version__, hub
from .adapters import get_adapter, supported_model_types
from .data import (
    DEFAULT_EVAL_TOKENS,
    TextFileError,
    causal_lm_batches,
    masked_lm_batches,
    read_dataset,
    read_text_files,
    split_held_out,
    token_windows,
)
from .distributed import OtherProcessFailed, Processes
from .config import GrowthConfig
from .growth import grow_model
from .inspection import PLOT_EXTRA, inspect_growth
from .progress import stage
from .statistics import GrowthStatistics, collect_statistics, parse_bytes


EXAMPLES = """examples:
  hf-grow gpt2 --p 8 --output-dir gpt2-grown
      statistics from wikitext-2-raw-v1 (train), line search on its validation split
  hf-grow ./my-gpt2 --p 8 --data 'corpus/*.txt' --output-dir my-gpt2-grown
      a local model and local text files (the last 10% of the text, at most 50,000 tokens, is held out)
  hf-grow google-bert/bert-base-uncased --p 8 --seq-len 128 --output-dir bert-grown
      a masked LM: masked-LM loss with 15% of tokens masked
  hf-grow gpt2 --p 16 --dataset wikitext --dataset-config wikitext-103-raw-v1 --max-tokens 2000000 \\
      --output-dir gpt2-grown --report growth.json
  hf-grow gpt2 --budget 96 --multiple-of 8 --output-dir gpt2-grown --push-to-hub me/gpt2-grown
      96 added dims per head in all, allocated to the layers by expected gain; pushed to the Hub

  hf-grow inspect MODEL --help: the expected gain of adding 1..k dims per layer and head, without growing
"""

INSPECT_EXAMPLES = """examples:
  hf-grow inspect gpt2 --plot spectra.png --save-stats gpt2-stats.safetensors
      the table of expected gains, a PNG of the spectra, and the statistics for a later run:
  hf-grow gpt2 --stats gpt2-stats.safetensors --budget 96 --output-dir gpt2-grown
      grows from those statistics (same data options: the held-out text is read again, not the rest)
"""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CommandError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hub id (e.g. gpt2) or local folder of a causal or masked LM and its tokenizer")


EVAL_FRACTION_HELP = (
    "share of the text held out for the line search (its tail) when it comes from the same text as the statistics "
    f"(--data, or --eval-split equal to --split), at most {DEFAULT_EVAL_TOKENS:,} tokens (default "
    f"{GrowthConfig.eval_fraction}, as grow_model's eval_fraction)"
)


def _add_data_arguments(parser: argparse.ArgumentParser, eval_fraction: bool = True) -> None:
    """The data options of both subcommands: the same options give the same statistics and held-out text
    (the main command's ``--eval-fraction`` is `GrowthConfig`'s field)."""
    data = parser.add_argument_group("data (default: --dataset wikitext --dataset-config wikitext-2-raw-v1)")
    data.add_argument("--data", nargs="+", metavar="FILE", help="plain text files or globs")
    data.add_argument("--dataset", help="a datasets name (Hub or local script/folder)")
    data.add_argument("--dataset-config", help="the dataset's configuration name")
    data.add_argument("--split", default="train", help="split for the statistics (default train)")
    data.add_argument("--eval-split", default="validation", help="split for held-out text (default validation)")
    data.add_argument("--text-column", default="text", help="column holding the text (default text)")
    data.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it")
    data.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default 512, or the model's positions if fewer)"
    )
    data.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    data.add_argument("--max-tokens", type=int, default=500_000, help="tokens for the statistics")
    data.add_argument(
        "--eval-tokens", type=int, help=f"held-out tokens for the line search (default: {DEFAULT_EVAL_TOKENS:,} from "
        "--eval-split, or --eval-fraction of the same text)"
    )
    if eval_fraction:
        data.add_argument("--eval-fraction", type=float, help=EVAL_FRACTION_HELP)
    data.add_argument("--mlm-probability", type=float, default=0.15, help="masked LMs: share of tokens masked")


def _add_run_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    run = parser.add_argument_group("run")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (statistics are float32+)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--quiet", action="store_true", help="no progress bars (on a terminal) or lines (in a log)")
    return run


def build_parser() -> HfArgumentParser:
    """The growth options come from `GrowthConfig` (flags and help text from its fields); the model, data,
    output, run and Hub options are the command's own."""
    parser = HfArgumentParser(
        GrowthConfig,
        prog="hf-grow",
        description="Grow the query/key dimension of every attention head of a language model (causal LMs "
        "such as GPT-2 on next-token loss, masked LMs such as BERT on masked-LM loss), with weights solved from "
        "first-order loss statistics. `hf-grow inspect MODEL` reports the expected gains without growing.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for action in parser._actions:  # show the dash spelling the README uses (the underscore one works too)
        action.option_strings.sort(key=lambda option: "_" in option)
        if action.dest == "eval_fraction":  # the share of text held out (None: not given, the config's default)
            action.help, action.default = EVAL_FRACTION_HELP, None
    _add_model_argument(parser)
    parser.add_argument("--output-dir", required=True, help="folder for the grown model (must be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    _add_data_arguments(parser, eval_fraction=False)
    parser.add_argument("--stats", metavar="FILE", help="statistics saved by `hf-grow inspect --save-stats` for this "
                        "model: the statistics text is not read again")
    run = _add_run_arguments(parser)
    run.add_argument("--report", help="also write the JSON growth report to this file")
    push = parser.add_argument_group("Hugging Face Hub")
    push.add_argument("--push-to-hub", metavar="REPO_ID", help="also push the grown model and its card to this repo")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", help="branch to push to (created if needed; default main)")
    push.add_argument("--commit-message", help="message of the commit")
    parser.add_argument("--version", action="version", version=f"hf-grow {__version__}")
    return parser


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-grow inspect",
        description="Collect the statistics once and report, per layer and head, the expected first-order loss "
        "decrease of adding 1..k query/key dimensions, without changing the model: a table, optionally a PNG of "
        "the spectra and the statistics for a later `hf-grow MODEL --stats FILE`.",
        epilog=INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_argument(parser)
    _add_data_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--max-dims", type=int, default=16, help="report adding 1..this many dims (default 16)")
    output.add_argument("--layers-only", action="store_true", help="one table row per layer, no per-head rows")
    output.add_argument("--plot", metavar="PNG", help="write the spectra per layer to this PNG (needs matplotlib)")
    output.add_argument("--json", metavar="FILE", help="write the full inspection as JSON")
    output.add_argument("--save-stats", metavar="FILE", help="save the statistics (safetensors) for `hf-grow --stats`")
    _add_run_arguments(parser)
    return parser


def _progress(args: argparse.Namespace) -> bool:
    """Progress unless --quiet: bars on a terminal, a line every half minute in a log (`hf_grow.progress`)."""
    return not args.quiet


def _check_data_arguments(args: argparse.Namespace) -> None:
    for name in ("seq_len", "batch_size", "max_tokens", "eval_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CommandError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.mlm_probability < 1:
        raise CommandError(f"--mlm-probability must be between 0 and 1, got {args.mlm_probability}")
    if args.data and args.dataset:
        raise CommandError("give either --data or --dataset, not both")
    if args.eval_fraction is not None:
        if not 0 < args.eval_fraction < 1:
            raise CommandError(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
        if args.eval_tokens is not None:
            raise CommandError("give either --eval-tokens or --eval-fraction, not both")
        if not _held_out_of_the_same_text(args):
            raise CommandError(
                f"--eval-fraction applies to held-out text cut from the statistics' text; here it is read from "
                f"--eval-split {args.eval_split} (--eval-tokens sets how much)"
            )


def _held_out_of_the_same_text(args: argparse.Namespace) -> bool:
    """Whether the held-out text is the tail of the statistics' text (local files, or one dataset split)."""
    return bool(args.data) or args.eval_split == args.split


def _check_arguments(args: argparse.Namespace) -> None:
    if args.budget is not None and args.p is not None:
        raise CommandError("give either --p or --budget, not both")
    if args.budget is None:
        args.p = 8 if args.p is None else args.p
        if args.p <= 0:
            raise CommandError(f"--p must be a positive number of dimensions to add, got {args.p}")
        if args.multiple_of != 1:
            raise CommandError("--multiple-of applies to --budget")
    elif args.multiple_of <= 0 or args.budget <= 0 or args.budget % args.multiple_of:
        raise CommandError(
            f"--budget must be a positive multiple of --multiple-of, got --budget {args.budget} --multiple-of "
            f"{args.multiple_of}"
        )
    _check_data_arguments(args)
    if args.memory_budget is not None:
        try:
            parse_bytes(args.memory_budget)
        except ValueError as error:
            raise CommandError(str(error)) from None
    if args.push_to_hub:
        try:
            hub.check_push(args.push_to_hub)
        except ValueError as error:
            raise CommandError(str(error)) from None
    _check_device(args)
    _check_output_folder(Path(args.output_dir), args.overwrite)
    _check_file_folders(("--report", args.report))
    args.config = _growth_config(args)


def _growth_config(args: argparse.Namespace) -> GrowthConfig:
    """The `GrowthConfig` of the growth flags; its checks as one-line errors, before any data is read."""
    options = {option.name: getattr(args, option.name) for option in dataclasses.fields(GrowthConfig)}
    if options["eval_fraction"] is None:  # not given: the config's default, which the command holds out too
        del options["eval_fraction"]
    try:
        return GrowthConfig(**options)
    except (TypeError, ValueError) as error:
        raise CommandError(str(error)) from None


def _check_device(args: argparse.Namespace) -> None:
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CommandError(f"--device {args.device!r} is not a device: write e.g. cpu, cuda or cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {args.device}: this PyTorch sees no CUDA device; use --device cpu")


def _check_output_folder(output: Path, overwrite: bool) -> None:
    """A ready or creatable output folder, refused if it holds anything (unless ``overwrite``)."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise CommandError(f"{output} exists and is not empty: choose another --output-dir or pass --overwrite")
    ancestor = output.resolve().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise CommandError(f"--output-dir {output}: cannot create folders in {ancestor}")


def _check_file_folders(*options: tuple[str, str | None]) -> None:
    """Output files' folders exist: found before any work, not when the results are written."""
    for option, path in options:
        if path and not Path(path).resolve().parent.is_dir():
            raise CommandError(f"{option}: the folder of {path} does not exist")
        if path and Path(path).is_dir():
            raise CommandError(f"{option} {path} is a folder: give a file name")


def _load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"cannot load a tokenizer for {args.model!r} ({str(error).splitlines()[0]}): check the name, "
            "that the folder holds tokenizer files, and network access (HF_HUB_OFFLINE)"
        ) from None
    # transformers builds an empty tokenizer for a folder without vocabulary files: it encodes nothing.
    if not tokenizer("def grow(): pass", add_special_tokens=False)["input_ids"]:
        raise CommandError(f"{args.model!r} has no usable tokenizer: save the model's tokenizer into that folder")
    return tokenizer


def _objective(args: argparse.Namespace) -> str:
    """``"causal"`` or ``"masked"``: the loss the command grows the model on, from the model's config.

    Also checks the architecture, resolves ``--seq-len`` against the model's positions and records the vocabulary
    size, before any data is read.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load model {args.model!r}: {str(error).splitlines()[0]}") from None
    if config.model_type not in supported_model_types():
        raise CommandError(
            f"hf_grow cannot grow {args.model!r} (model_type={config.model_type!r}); "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    _check_local_weights(args.model)
    positions = getattr(config, "max_position_embeddings", None)
    args.vocab_size = getattr(config, "vocab_size", None)  # for the tokenizer's ids (`_check_token_ids`)
    if args.seq_len is None:
        args.seq_len = min(512, positions or 512)
    elif positions is not None and args.seq_len > positions:
        raise CommandError(f"--seq-len {args.seq_len} exceeds the {positions} positions of {args.model!r}")
    if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False):
        return "masked"
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return "causal"
    raise CommandError(
        f"{args.model!r} ({config.model_type}) is neither a causal nor a masked language model: the command line "
        "only knows those losses; use the Python API: grow_model(model, batches, loss_fn=...)"
    )


def _check_local_weights(model: str) -> None:
    """A local folder's safetensors files have whole headers and data (a truncated copy or download is found
    before any text is read; reading the headers costs nothing)."""
    for path in sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []:
        try:
            safe_open(path, framework="pt").keys()
        except SafetensorError as error:
            raise CommandError(
                f"cannot load model {model!r}: its weights file {path.name} is damaged or incomplete ({error}); "
                "download or save it again"
            ) from None


def _load_model(args: argparse.Namespace, objective: str):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto_class = AutoModelForMaskedLM if objective == "masked" else AutoModelForCausalLM
    try:
        model, loading = auto_class.from_pretrained(args.model, dtype=DTYPES[args.dtype], output_loading_info=True)
    except ValueError as error:
        raise CommandError(
            f"{args.model!r} cannot be loaded as a {objective} language model ({str(error).splitlines()[0]}); "
            "for other heads use the Python API: grow_model(..., loss_fn=...)"
        ) from None
    except OSError as error:
        raise CommandError(f"cannot load model {args.model!r}: {str(error).splitlines()[0]}") from None
    except SafetensorError as error:
        raise CommandError(
            f"cannot load model {args.model!r}: its weights file is damaged or incomplete ({error}); download or "
            "save it again"
        ) from None
    if loading["missing_keys"]:
        missing = sorted(loading["missing_keys"])
        raise CommandError(
            f"{args.model!r} has no trained {objective}-LM head (missing {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): its loss would measure random weights. Use the Python API "
            "with a loss for this model: grow_model(model, batches, loss_fn=...)"
        )
    return model.to(args.device)


def _dataset_windows(args: argparse.Namespace, tokenizer, window: int) -> tuple[list, list]:
    """Statistics windows from ``--split`` and held-out windows from ``--eval-split`` of a datasets dataset (or
    from the tail of ``--split`` when they are the same split)."""
    name = args.dataset or "wikitext"
    config = args.dataset_config or (None if args.dataset else "wikitext-2-raw-v1")

    def windows(split: str, max_tokens: int) -> list:
        texts = read_dataset(name, config, split, args.text_column, args.streaming, _bars(args))
        return token_windows(texts, tokenizer, window, max_tokens)

    try:
        if _held_out_of_the_same_text(args):
            return _split_held_out(args, windows(args.split, args.max_tokens + _most_held_out(args)), window)
        return windows(args.split, args.max_tokens), windows(args.eval_split, args.eval_tokens or DEFAULT_EVAL_TOKENS)
    except KeyError as error:
        raise CommandError(str(error).strip("'\"")) from None
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
    try:
        return split_held_out(windows, window, args.max_tokens, args.eval_tokens, fraction)
    except ValueError as error:
        raise CommandError(str(error)) from None


def _warn(message: str) -> None:
    print(f"hf-grow: warning: {message}", file=sys.stderr)


def _batches(args: argparse.Namespace, tokenizer, objective: str, is_main: bool = True) -> tuple[list, list]:
    """Statistics and held-out batches; local files give their tail as held-out text (`_split_held_out`).

    Prints how many tokens each side got, and refuses token ids beyond the model's vocabulary.
    """
    window = args.seq_len
    if objective == "masked":
        if tokenizer.mask_token_id is None:
            raise CommandError(f"the tokenizer of {args.model!r} has no mask token: masked-LM loss needs one")
        window -= (tokenizer.cls_token_id is not None) + (tokenizer.sep_token_id is not None)
    if args.data:
        try:
            texts = read_text_files(args.data, warn=_warn if is_main else lambda message: None)
            windows = token_windows(texts, tokenizer, window, args.max_tokens + _most_held_out(args))
        except TextFileError as error:
            raise CommandError(str(error)) from None
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
        print(_split_description(args, len(statistics) * window, len(held_out) * window), flush=True)
    if objective == "causal":
        return causal_lm_batches(statistics, args.batch_size), causal_lm_batches(held_out, args.batch_size)
    return (
        masked_lm_batches(statistics, args.batch_size, tokenizer, args.mlm_probability, args.seed),
        masked_lm_batches(held_out, args.batch_size, tokenizer, args.mlm_probability, args.seed + 1),
    )


def _split_description(args: argparse.Namespace, statistics_tokens: int, held_out_tokens: int) -> str:
    """One line: the tokens of each side and where the held-out ones come from."""
    if not _held_out_of_the_same_text(args):
        source = f"from --eval-split {args.eval_split}"
    elif args.eval_tokens is not None:
        source = "the tail of the text, --eval-tokens"
    else:
        fraction = GrowthConfig.eval_fraction if args.eval_fraction is None else args.eval_fraction
        source = f"the last {fraction:.0%} of the text, at most {DEFAULT_EVAL_TOKENS:,}: --eval-fraction, --eval-tokens"
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


def _data_description(args: argparse.Namespace) -> tuple[str, list[str]]:
    """What the statistics were collected on, in words, and the Hub datasets among it (for the model card)."""
    if args.data:
        shown = ", ".join(f"`{pattern}`" for pattern in args.data[:3])
        return f"local text ({shown}{', ...' if len(args.data) > 3 else ''})", []
    name = args.dataset or "wikitext"
    config = args.dataset_config or (None if args.dataset else "wikitext-2-raw-v1")
    return f"`{name}`{f' ({config})' if config else ''}, split `{args.split}` (held out: `{args.eval_split}`)", [name]


def _load_statistics(path: str) -> GrowthStatistics:
    try:
        return GrowthStatistics.load(path)
    except ValueError as error:
        raise CommandError(f"{error}: pass a file written by `hf-grow inspect --save-stats`") from None


def _write_atomically(output: Path, write, overwrite: bool) -> None:
    """Write into a temporary sibling folder, then rename it into place: no half-written model, ever.

    The output folder is checked again just before the rename: what appeared there meanwhile is replaced
    only with ``overwrite``.
    """
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.hf-grow-{os.getpid()}"
    replaced = output.parent / f".{output.name}.hf-grow-old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        write(staging)
        _check_output_folder(output, overwrite)
        if output.exists():
            output.rename(replaced)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if replaced.exists() and not output.exists():
            replaced.rename(output)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _accelerator(args: argparse.Namespace):
    """An `accelerate.Accelerator` when launched with several processes (``WORLD_SIZE`` > 1), else None.

    The model then goes to the accelerator's device (one GPU per process, or the CPU with ``--device cpu``).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=torch.device(args.device).type == "cpu")
    args.device = str(accelerator.device)
    return accelerator


def _shard(batches: list, accelerator, what: str) -> list:
    """Every N-th batch, from this process's index: the processes' shards add up to all the batches."""
    if accelerator is None:
        return batches
    if len(batches) < accelerator.num_processes:
        raise CommandError(
            f"{len(batches)} {what} batches cannot be shared by {accelerator.num_processes} processes: pass more text "
            "or a smaller --batch-size"
        )
    return batches[accelerator.process_index :: accelerator.num_processes]


def _bars(args: argparse.Namespace) -> bool:
    """Other libraries' progress bars (transformers' loading and saving, datasets'): on a terminal only."""
    return _progress(args) and sys.stderr.isatty()


def _start(args: argparse.Namespace, is_main: bool = True) -> bool:
    """Seed and logging; whether progress shows (on the main process only)."""
    torch.manual_seed(args.seed)
    show_progress = _progress(args) and is_main
    transformers_logging.set_verbosity_error()
    if not (show_progress and _bars(args)):
        transformers_logging.disable_progress_bar()
    return show_progress


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    _check_arguments(args)
    accelerator = _accelerator(args)
    try:
        _grow_and_write(args, accelerator, started)
    finally:
        if accelerator is not None:
            accelerator.end_training()  # destroys the process group: a clean exit on every process


def _grow_and_write(args: argparse.Namespace, accelerator, started: float) -> None:
    is_main = accelerator is None or accelerator.is_main_process
    show_progress = _start(args, is_main)
    objective = _objective(args)
    statistics = _load_statistics(args.stats) if args.stats else None
    if statistics is not None and accelerator is not None:
        raise CommandError("--stats holds the statistics of all the data: run it in one process")
    tokenizer = _load_tokenizer(args)
    statistics_batches, held_out_batches = _batches(args, tokenizer, objective, is_main)  # data before the model
    statistics_batches = _shard(statistics_batches, accelerator, "statistics")
    held_out_batches = _shard(held_out_batches, accelerator, "held-out")
    model = _load_model(args, objective)
    try:
        grown = grow_model(
            model,
            None if statistics else statistics_batches,
            config=args.config,
            statistics=statistics,
            eval_dataloader=held_out_batches,
            accelerator=accelerator,
            progress=show_progress,
        )
    except (ValueError, OtherProcessFailed) as error:
        raise CommandError(str(error)) from None
    try:
        # Only the main process writes and pushes; the others wait for it, and learn if it failed.
        with Processes(accelerator).failing_together():
            if is_main:
                _write_outputs(args, grown, tokenizer, started, accelerator, show_progress)
    except OtherProcessFailed as error:
        raise CommandError(f"{error}: nothing was written") from None


def _write_outputs(
    args: argparse.Namespace, grown, tokenizer, started: float, accelerator, show_progress: bool
) -> None:
    report = grown.growth_report
    output = Path(args.output_dir)
    data, datasets = _data_description(args)

    def write(folder: Path) -> None:
        grown.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        # A local model is named by its absolute path: the card stays true wherever it is pushed from later.
        base_model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        card = hub.model_card(folder, base_model=base_model, repo_id=args.push_to_hub or output.name, data=data,
                              datasets=datasets)
        card.save(folder / hub.CARD_FILENAME)

    try:
        with stage(f"writing the grown model to {output}", enabled=show_progress):
            _write_atomically(output, write, args.overwrite)
    except OSError as error:
        raise CommandError(f"writing {output} failed ({error}); nothing was written") from None
    if args.report:
        try:
            report.to_json_file(args.report)
        except OSError as error:
            raise CommandError(
                f"writing --report {args.report} failed ({error}); the grown model is in {output}"
            ) from None
    elapsed = time.perf_counter() - started
    print(report.summary())
    processes = f" on {accelerator.num_processes} processes" if accelerator is not None else ""
    print(f"wall time {elapsed:.1f} s{processes}; grown model written to {output}")
    if args.push_to_hub:
        try:
            commit = hub.push_to_hub(output, args.push_to_hub, private=args.private or None, revision=args.revision,
                                     commit_message=args.commit_message)
        except Exception as error:  # network and Hub errors come in many types; the model is safe on disk
            reason = (str(error).splitlines() or [""])[0]
            raise CommandError(
                f"pushing to {args.push_to_hub} failed ({type(error).__name__}: {reason}); the grown model is in "
                f"{output}: push it later with hf_grow.push_to_hub"
            ) from None
        if commit is not None:
            print(f"pushed to {getattr(commit, 'commit_url', None) or args.push_to_hub}")


def run_inspect(args: argparse.Namespace) -> None:
    _check_data_arguments(args)
    if args.max_dims <= 0:
        raise CommandError(f"--max-dims must be positive, got {args.max_dims}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"--plot: {PLOT_EXTRA}")
    _check_device(args)
    _check_file_folders(("--plot", args.plot), ("--json", args.json), ("--save-stats", args.save_stats))
    show_progress = _start(args)
    objective = _objective(args)
    tokenizer = _load_tokenizer(args)
    statistics_batches, _ = _batches(args, tokenizer, objective)  # the same split as the main command
    model = _load_model(args, objective)
    try:
        statistics = collect_statistics(model, statistics_batches, get_adapter(model), progress=show_progress)
        if args.save_stats:
            statistics.save(args.save_stats)
        inspection = inspect_growth(model, statistics=statistics, max_dims=args.max_dims)
    except ValueError as error:
        raise CommandError(str(error)) from None
    print(inspection.table(heads=not args.layers_only))
    if args.json:
        inspection.to_json_file(args.json)
    if args.plot:
        inspection.plot(args.plot)
    written = [f"{kind} {path}" for kind, path in (("spectra", args.plot), ("inspection", args.json),
                                                   ("statistics", args.save_stats)) if path]
    if written:
        print("wrote " + ", ".join(written))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    inspecting = argv[:1] == ["inspect"]
    args = build_inspect_parser().parse_args(argv[1:]) if inspecting else build_parser().parse_args(argv)
    try:
        if inspecting:
            run_inspect(args)
        else:
            run(args)
    except CommandError as error:
        print(f"hf-grow: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf-grow: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
