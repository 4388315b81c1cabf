"""The ``hf-grow`` command: load a language model, read text, grow it, write the grown model atomically.

Causal LMs (GPT-2) grow on next-token loss; masked LMs (BERT) on masked-LM loss with transformers' standard
collator. Any other objective goes through the Python API's ``loss_fn``.

Launched with several processes (``torchrun --nproc_per_node N -m hf_grow ...`` or ``accelerate launch``;
``WORLD_SIZE`` > 1), every process reads the same text, takes every N-th batch, and the statistics and
held-out losses are summed across processes; only the main process writes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from . import __version__
from .adapters import supported_model_types
from .data import causal_lm_batches, masked_lm_batches, read_dataset, read_text_files, token_windows
from .distributed import OtherProcessFailed, Processes
from .growth import DEFAULT_TRUNCATION, SEARCHES, grow_model
from .linalg import TRUNCATIONS
from .report import GrowthReport
from .statistics import parse_bytes


EXAMPLES = """examples:
  hf-grow gpt2 --p 8 --output-dir gpt2-grown
      statistics from wikitext-2-raw-v1 (train), line search on its validation split
  hf-grow ./my-gpt2 --p 8 --data 'corpus/*.txt' --output-dir my-gpt2-grown
      a local model and local text files (the held-out text is the tail of the files)
  hf-grow google-bert/bert-base-uncased --p 8 --seq-len 128 --output-dir bert-grown
      a masked LM: masked-LM loss with 15% of tokens masked
  hf-grow gpt2 --p 16 --dataset wikitext --dataset-config wikitext-103-raw-v1 --max-tokens 2000000 \\
      --output-dir gpt2-grown --report growth.json
"""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CommandError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-grow",
        description="Grow the query/key dimension of every attention head of a language model (causal LMs "
        "such as GPT-2 on next-token loss, masked LMs such as BERT on masked-LM loss), with weights solved from "
        "first-order loss statistics.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="Hub id (e.g. gpt2) or local folder of a causal or masked LM and its tokenizer")
    parser.add_argument("--p", type=int, default=8, help="query/key dimensions to add per head (default 8)")
    parser.add_argument("--output-dir", required=True, help="folder for the grown model (must be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    data = parser.add_argument_group("data (default: --dataset wikitext --dataset-config wikitext-2-raw-v1)")
    data.add_argument("--data", nargs="+", metavar="FILE", help="plain text files or globs")
    data.add_argument("--dataset", help="a datasets name (Hub or local script/folder)")
    data.add_argument("--dataset-config", help="the dataset's configuration name")
    data.add_argument("--split", default="train", help="split for the statistics (default train)")
    data.add_argument("--eval-split", default="validation", help="split for held-out text (default validation)")
    data.add_argument("--text-column", default="text", help="column holding the text (default text)")
    data.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it")
    data.add_argument("--seq-len", type=int, help="tokens per sequence (default 512, or the model's positions if fewer)")
    data.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    data.add_argument("--max-tokens", type=int, default=500_000, help="tokens for the statistics")
    data.add_argument("--eval-tokens", type=int, default=50_000, help="held-out tokens for the line search")
    data.add_argument("--mlm-probability", type=float, default=0.15, help="masked LMs: share of tokens masked")
    growth = parser.add_argument_group("growth")
    growth.add_argument("--step-size", type=float, help="skip the line search and take this (relative) step")
    growth.add_argument("--truncation", choices=TRUNCATIONS, default=DEFAULT_TRUNCATION)
    growth.add_argument("--search", choices=SEARCHES, default="exact")
    growth.add_argument(
        "--memory-budget",
        help="bytes for the statistics' accumulators, e.g. 2GB: M is collected for groups of layers in several passes",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (statistics are float32+)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--report", help="also write the JSON growth report to this file")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--version", action="version", version=f"hf-grow {__version__}")
    return parser


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars only for a person watching: not with --quiet, not when stderr is a file or pipe."""
    return not args.quiet and sys.stderr.isatty()


def _check_arguments(args: argparse.Namespace) -> None:
    if args.p <= 0:
        raise CommandError(f"--p must be a positive number of dimensions to add, got {args.p}")
    for name in ("seq_len", "batch_size", "max_tokens", "eval_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CommandError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.mlm_probability < 1:
        raise CommandError(f"--mlm-probability must be between 0 and 1, got {args.mlm_probability}")
    if args.data and args.dataset:
        raise CommandError("give either --data or --dataset, not both")
    if args.memory_budget is not None:
        try:
            parse_bytes(args.memory_budget)
        except ValueError as error:
            raise CommandError(str(error)) from None
    output = Path(args.output_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        raise CommandError(f"{output} exists and is not empty: choose another --output-dir or pass --overwrite")


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

    Also checks the architecture and resolves ``--seq-len`` against the model's positions, before any data is read.
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
    positions = getattr(config, "max_position_embeddings", None)
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
    if loading["missing_keys"]:
        missing = sorted(loading["missing_keys"])
        raise CommandError(
            f"{args.model!r} has no trained {objective}-LM head (missing {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): its loss would measure random weights. Use the Python API "
            "with a loss for this model: grow_model(model, batches, loss_fn=...)"
        )
    return model.to(args.device)


def _dataset_windows(args: argparse.Namespace, tokenizer, window: int) -> tuple[list, list]:
    """Statistics windows from ``--split`` and held-out windows from ``--eval-split`` of a datasets dataset."""
    name = args.dataset or "wikitext"
    config = args.dataset_config or (None if args.dataset else "wikitext-2-raw-v1")

    def windows(split: str, max_tokens: int) -> list:
        texts = read_dataset(name, config, split, args.text_column, args.streaming, _progress(args))
        return token_windows(texts, tokenizer, window, max_tokens)

    try:
        return windows(args.split, args.max_tokens), windows(args.eval_split, args.eval_tokens)
    except KeyError as error:
        raise CommandError(str(error).strip("'\"")) from None
    except Exception as error:  # datasets raises many types for unreachable or unknown datasets
        if not args.dataset:
            raise CommandError(
                f"cannot reach the default dataset wikitext ({type(error).__name__}): pass local text with --data FILE"
            ) from None
        raise CommandError(f"cannot load dataset {args.dataset!r}: {str(error).splitlines()[0]}") from None


def _batches(args: argparse.Namespace, tokenizer, objective: str) -> tuple[list, list]:
    """Statistics and held-out batches; local files give their tail as held-out text."""
    window = args.seq_len
    if objective == "masked":
        if tokenizer.mask_token_id is None:
            raise CommandError(f"the tokenizer of {args.model!r} has no mask token: masked-LM loss needs one")
        window -= (tokenizer.cls_token_id is not None) + (tokenizer.sep_token_id is not None)
    if args.data:
        eval_windows = max(1, args.eval_tokens // window)
        try:
            windows = token_windows(read_text_files(args.data), tokenizer, window, args.max_tokens + args.eval_tokens)
        except FileNotFoundError as error:
            raise CommandError(str(error)) from None
        statistics, held_out = windows[:-eval_windows], windows[-eval_windows:]
    else:
        statistics, held_out = _dataset_windows(args, tokenizer, window)
    if not statistics or not held_out:
        raise CommandError(
            f"the text is too short: it gives {len(statistics)} statistics and {len(held_out)} held-out sequences "
            f"of {args.seq_len} tokens; pass more text or a smaller --seq-len"
        )
    if objective == "causal":
        return causal_lm_batches(statistics, args.batch_size), causal_lm_batches(held_out, args.batch_size)
    return (
        masked_lm_batches(statistics, args.batch_size, tokenizer, args.mlm_probability, args.seed),
        masked_lm_batches(held_out, args.batch_size, tokenizer, args.mlm_probability, args.seed + 1),
    )


CARD_TASKS = {"causal": ("text-generation", "AutoModelForCausalLM"), "masked": ("fill-mask", "AutoModelForMaskedLM")}


def model_card(model_name: str, report: GrowthReport, output_name: str, objective: str = "causal") -> str:
    """A model card for the grown model: metadata, the growth summary and how to load it."""
    pipeline_tag, auto_class = CARD_TASKS[objective]
    return f"""---
base_model: {model_name}
library_name: transformers
pipeline_tag: {pipeline_tag}
tags:
- hf_grow
- grown-attention
---

# {output_name}

`{model_name}` with the query/key width of every attention head grown by
[hf_grow](https://pypi.org/project/hf_grow/): Q/K dims {report.qk_dims_before} -> {report.qk_dims_after},
{report.parameters_added:,} parameters added, new weights solved from first-order loss statistics over
{report.statistics_tokens:,} tokens.

| | before | after |
|---|---|---|
| held-out loss | {report.eval_loss_before} | {report.eval_loss_after} |
| held-out perplexity | {report.perplexity_before} | {report.perplexity_after} |

Step size {report.step_size:.4g} (λ = {report.lam:.4g}), truncation `{report.truncation}`. The full report is in
`growth_report.json`.

## Load

```python
from transformers import {auto_class}
model = {auto_class}.from_pretrained("{output_name}", trust_remote_code=True)
```

or, with hf_grow installed, `import hf_grow` first and drop `trust_remote_code`.
"""


def _write_atomically(output: Path, write) -> None:
    """Write into a temporary sibling folder, then rename it into place: no half-written model, ever."""
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.hf-grow-{os.getpid()}"
    replaced = output.parent / f".{output.name}.hf-grow-old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        write(staging)
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
    torch.manual_seed(args.seed)
    show_progress = _progress(args) and is_main
    transformers_logging.set_verbosity_error()
    if not show_progress:
        transformers_logging.disable_progress_bar()
    objective = _objective(args)
    tokenizer = _load_tokenizer(args)
    statistics_batches, held_out_batches = _batches(args, tokenizer, objective)  # data before the model
    statistics_batches = _shard(statistics_batches, accelerator, "statistics")
    held_out_batches = _shard(held_out_batches, accelerator, "held-out")
    model = _load_model(args, objective)
    try:
        grown = grow_model(
            model,
            statistics_batches,
            p=args.p,
            eval_dataloader=held_out_batches,
            step_size=args.step_size,
            truncation=args.truncation,
            search=args.search,
            memory_budget=args.memory_budget,
            accelerator=accelerator,
            progress=show_progress,
        )
    except (ValueError, OtherProcessFailed) as error:
        raise CommandError(str(error)) from None
    try:
        # Only the main process writes; the others wait for it, and learn if it failed.
        with Processes(accelerator).failing_together():
            if is_main:
                _write_outputs(args, grown, tokenizer, objective, started, accelerator)
    except OtherProcessFailed as error:
        raise CommandError(f"{error}: nothing was written") from None


def _write_outputs(args: argparse.Namespace, grown, tokenizer, objective: str, started: float, accelerator) -> None:
    report = grown.growth_report
    output = Path(args.output_dir)

    def write(folder: Path) -> None:
        grown.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "README.md").write_text(model_card(args.model, report, output.name, objective))

    _write_atomically(output, write)
    if args.report:
        report.to_json_file(args.report)
    elapsed = time.perf_counter() - started
    print(report.summary())
    processes = f" on {accelerator.num_processes} processes" if accelerator is not None else ""
    print(f"wall time {elapsed:.1f} s{processes}; grown model written to {output}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
