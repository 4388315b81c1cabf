"""The command's argument parsers and help texts: ``hf-grow MODEL ...`` and ``hf-grow inspect MODEL ...``.

The growth options come from `GrowthConfig`'s fields; the data and run options are shared by both subcommands, so
the same options give the same statistics and held-out text.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import torch
from transformers import HfArgumentParser

from ..version import __version__
from ..config import FOR_TRAINING, GrowthConfig
from ..data import DEFAULT_EVAL_TOKENS
from .checks import DATASET_ONLY_OPTIONS
from .loading import DTYPES, MLM_PROBABILITY
from .pairs import add_pairs_arguments


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
  hf-grow sentence-transformers/all-MiniLM-L6-v2 --p 8 --pairs pairs.tsv --batch-size 32 --output-dir minilm-grown
      a SentenceTransformer on text pairs with MultipleNegativesRankingLoss (the last 10% held out)
  hf-grow ./my-gpt2 --p 8 --data 'corpus/*.txt' --for-training --output-dir my-gpt2-grown
      a model that will be trained on after growth: a tenth of the searched step, cross-fitted, the scale kept

  hf-grow inspect MODEL --help: the expected gain of adding 1..k dims per layer and head, without growing
"""


INSPECT_EXAMPLES = """examples:
  hf-grow inspect gpt2 --plot spectra.png --save-stats gpt2-stats.safetensors
      the table of expected gains, a PNG of the spectra, and the statistics for a later run:
  hf-grow gpt2 --stats gpt2-stats.safetensors --budget 96 --output-dir gpt2-grown
      grows from those statistics (same data options: the held-out text is read again, not the rest)
"""


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hub id (e.g. gpt2) or local folder of a causal or masked LM and its tokenizer")


EVAL_FRACTION_HELP = (
    "share of the text read held out for the line search (its tail) when it comes from the same text as the "
    f"statistics (--data, or --eval-split equal to --split), at most {DEFAULT_EVAL_TOKENS:,} tokens (default "
    f"{GrowthConfig.eval_fraction}, as grow_model's eval_fraction); the text read is --max-tokens and up to "
    f"{DEFAULT_EVAL_TOKENS:,} tokens after it"
)


def _add_data_arguments(parser: argparse.ArgumentParser, eval_fraction: bool = True) -> None:
    """The data options of both subcommands: the same options give the same statistics and held-out text
    (the main command's ``--eval-fraction`` is `GrowthConfig`'s field)."""
    data = parser.add_argument_group("data (default: --dataset wikitext --dataset-config wikitext-2-raw-v1)")
    data.add_argument("--data", nargs="+", metavar="FILE", help="plain text files or globs")
    data.add_argument("--dataset", help="a datasets name (Hub or local script/folder)")
    defaults = DATASET_ONLY_OPTIONS  # the defaults the refusal of these with --data compares with
    data.add_argument("--dataset-config", default=defaults["dataset_config"],
                      help="the dataset's configuration name")
    data.add_argument("--split", default=defaults["split"],
                      help=f"split for the statistics (default {defaults['split']})")
    data.add_argument("--eval-split", default=defaults["eval_split"],
                      help=f"split for held-out text (default {defaults['eval_split']})")
    data.add_argument("--text-column", default=defaults["text_column"],
                      help=f"column holding the text (default {defaults['text_column']})")
    data.add_argument("--streaming", action="store_true", default=defaults["streaming"],
                      help="stream the dataset instead of downloading it")
    data.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default 512, or the model's positions if fewer; with "
        "--pairs, the SentenceTransformer's max_seq_length)"
    )
    data.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    data.add_argument("--max-tokens", type=int, default=500_000, help="tokens for the statistics")
    data.add_argument(
        "--eval-tokens", type=int, help=f"held-out tokens for the line search (default: {DEFAULT_EVAL_TOKENS:,} from "
        "--eval-split, or --eval-fraction of the same text)"
    )
    if eval_fraction:
        data.add_argument("--eval-fraction", type=float, help=EVAL_FRACTION_HELP)
    data.add_argument("--mlm-probability", type=float, default=MLM_PROBABILITY,
                      help="masked LMs: share of tokens masked")


FOR_TRAINING_HELP = (
    "for a model that will be trained after growth (GrowthConfig.for_training()): "
    + ", ".join(f"--{name.replace('_', '-')} {str(value).lower()}" for name, value in FOR_TRAINING.items())
    + ", where not given. Pretrained models grown so and then trained on were not behind the original's same "
    "training beyond the seed spread in 9 of 11 regimes measured (behind: a byte GPT-2 at lr 3e-4, MiniLM "
    "fine-tuned on the pairs its statistics came from); the default whole searched step (the largest one-shot "
    "decrease) fell behind where that training overfits (BENCHMARKS.md)"
)


def _add_run_arguments(parser: argparse.ArgumentParser, grows: bool = True) -> argparse._ArgumentGroup:
    run = parser.add_argument_group("run")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                     help="where the model runs, e.g. cpu, cuda or cuda:1 (default: cuda where PyTorch sees one)")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="model dtype" + ", also of the saved grown model" * grows + " (statistics are float32+)")
    run.add_argument("--seed", type=int, default=0, help="seed of the masking and the random draws (default 0)")
    run.add_argument("--quiet", action="store_true", help="no progress bars (on a terminal) or lines (in a log)")
    return run


DRY_RUN_HELP = ("print the memory plan (predicted peak memory per stage) and exit, reading no data or weights (exit "
                "status 2, with the flags that fit, where it does not fit)")
MAX_MEMORY_HELP = ("plan for at most this much memory (e.g. 16GB; host on a CPU, the device's on a GPU), when less "
                   "than is free")
IGNORE_MEMORY_PLAN_HELP = "run even where the memory plan predicts more than the free memory"


#: The data options only text is read with: `--pairs` refuses them where given other than their defaults.
TEXT_ONLY_OPTIONS = ("text_column", "eval_split", "max_tokens", "eval_tokens", "eval_fraction", "mlm_probability")


def text_options_given(args: argparse.Namespace) -> list[str]:
    """The flags of `TEXT_ONLY_OPTIONS` whose values in ``args`` are not the command's defaults."""
    parser = build_parser()
    return [f"--{name.replace('_', '-')}" for name in TEXT_ONLY_OPTIONS
            if getattr(args, name, None) != parser.get_default(name)]


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
        if action.dest in FOR_TRAINING:  # None: not given, the config's default or --for-training's
            action.default = None
        if isinstance(action, argparse._StoreFalseAction):  # HfArgumentParser copies the help of what it negates
            action.help = f"do not: {action.help}"
    growth = next(group for group in parser._action_groups if group.title == GrowthConfig._argument_group_name)
    growth.add_argument("--for-training", action="store_true", help=FOR_TRAINING_HELP)
    _add_model_argument(parser)
    parser.add_argument("--output-dir", help="folder for the grown model (must be empty; required but with --dry-run)")
    parser.add_argument("--overwrite", action="store_true", help="replace an output folder that holds a saved model")
    _add_data_arguments(parser, eval_fraction=False)
    add_pairs_arguments(parser)
    parser.add_argument("--stats", metavar="FILE", help="statistics saved by `hf-grow inspect --save-stats` for this "
                        "model and the same data options: not collected again (the text is read for its held-out part)")
    run = _add_run_arguments(parser)
    run.add_argument("--report", help="also write the JSON growth report to this file")
    run.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    run.add_argument("--max-memory", metavar="SIZE", help=MAX_MEMORY_HELP)
    run.add_argument("--ignore-memory-plan", action="store_true", help=IGNORE_MEMORY_PLAN_HELP)
    push = parser.add_argument_group("Hugging Face Hub")
    push.add_argument("--push-to-hub", metavar="REPO_ID", help="also push the grown model and its card to this repo")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", help="branch to push to (created if needed; default main)")
    push.add_argument("--commit-message", help="message of the commit")
    parser.add_argument("--version", action="version", version=f"hf-grow {__version__}")
    return parser


#: The `GrowthConfig` fields ``hf-grow inspect`` takes: how the statistics are collected and what they may hold (as
#: the main command's flags of the same names), so that its ``--save-stats`` serves ``hf-grow --stats``.
INSPECT_CONFIG_FIELDS = (
    "max_batches", "statistics_method", "compute_dtype", "accumulate_dtype", "query_block", "memory_budget",
    "offload_dir",
)
#: The fields that set the lam the gains are at, as the growth (and its ``--budget``) ranks them.
INSPECT_GAIN_FIELDS = ("step_mode", "truncation", "rtol")


def _add_config_options(
    group: argparse._ArgumentGroup, names: tuple[str, ...], helps: dict[str, str] | None = None
) -> None:
    """``--name`` (also ``--name_with_underscores``) for each `GrowthConfig` field of ``names``: its type, choices,
    default and help, as the main command's parser makes them (``helps``: other help texts, by field)."""
    hints = typing.get_type_hints(GrowthConfig)
    for config_field in dataclasses.fields(GrowthConfig):
        if config_field.name not in names:
            continue
        hint = hints[config_field.name]
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        value_type = str if choices else next(kind for kind in (*typing.get_args(hint), hint) if kind is not None
                                              and kind is not type(None))
        spellings = dict.fromkeys([f"--{config_field.name.replace('_', '-')}", f"--{config_field.name}"])
        group.add_argument(*spellings, dest=config_field.name, type=value_type, choices=choices,
                           default=config_field.default, help=(helps or {}).get(config_field.name,
                                                                                config_field.metadata["help"]))


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
    output.add_argument("--cross-fit", action="store_true", help="also sum M over half the batches, and report the "
                        "gains of the cross-fitted M (statistics for `hf-grow --stats FILE --cross-fit`)")
    _add_config_options(parser.add_argument_group("statistics"), INSPECT_CONFIG_FIELDS, {
        "max_batches": "use the first this many statistics batches (then give hf-grow --stats the same flag)",
    })
    _add_config_options(parser.add_argument_group("gains"), INSPECT_GAIN_FIELDS, {
        "step_mode": "rank at the lam of this step mode, as hf-grow --budget with the same --step-mode does "
                     "(default auto: per head, its first candidate; layer_search and coordinate: per layer)",
        "truncation": "rank at the lam units of this truncation, as hf-grow --budget with the same --truncation does "
                      "(default whitened; auto: whitened, its first candidate)",
        "rtol": "pseudo-inverse tolerance, as hf-grow --rtol (default 1e-6)",
    })
    run = _add_run_arguments(parser, grows=False)
    run.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    run.add_argument("--max-memory", metavar="SIZE", help=MAX_MEMORY_HELP)
    run.add_argument("--ignore-memory-plan", action="store_true", help=IGNORE_MEMORY_PLAN_HELP)
    return parser
