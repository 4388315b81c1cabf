"""Checks of the command's arguments that fail before any work: a problem the user can fix is a `CommandError`,
printed as one line (exit status 2) before any model or text is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .. import hub
from ..adapters import get_adapter
from ..config import DEFAULT_P, FOR_TRAINING, GrowthConfig
from ..data import matching_paths
from ..growth import check_growth, check_statistics, check_weight_sample
from ..statistics import GrowthStatistics, check_method_runs, check_offload_dir, checkpoint_weight_sample, parse_bytes


class CommandError(Exception):
    """A problem the user can fix: printed as one line, exit status 2."""


@contextlib.contextmanager
def as_command_error(*errors: type[Exception]) -> Iterator[None]:
    """The library's refusals (``errors``, default ValueError) as a `CommandError`: their message, one line."""
    try:
        yield
    except errors or (ValueError,) as error:
        raise CommandError(str(error)) from None


#: The files a model's save writes (weights, configs, tokenizer, modeling code, card), by suffix: a folder of these
#: alone (and a SentenceTransformer's module folders) is the only kind of non-empty folder ``--overwrite`` replaces.
MODEL_FILE_SUFFIXES = frozenset(
    {".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".json", ".py", ".md", ".txt", ".model", ".jinja",
     ".tiktoken"}
)

#: What transformers' Trainer writes beside a saved model: a checkpoint's training state (``checkpoint-*`` folders)
#: and an output folder's results. A folder holding any is not replaced by ``--overwrite`` (``training_args.bin``
#: alone is part of the Trainer's own model save, ``save_model``).
TRAINER_FILES = re.compile(
    r"(optimizer|scheduler|scaler)\.(pt|bin)|rng_state(_\d+)?\.pth|trainer_state\.json"
    r"|(all|train|eval|test|predict)_results\.json"
)


#: The options of a `datasets` dataset (--dataset), with their defaults (the parsers'): refused with --data, which
#: they do not change.
DATASET_ONLY_OPTIONS = {"dataset_config": None, "split": "train", "eval_split": "validation", "text_column": "text",
                        "streaming": False}


def check_data_arguments(args: argparse.Namespace) -> None:
    for name in ("seq_len", "batch_size", "max_tokens", "eval_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CommandError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.seq_len is not None and args.seq_len < 2:
        raise CommandError(f"--seq-len must be at least 2 (a token and one to predict), got {args.seq_len}")
    if not -(2**63) <= args.seed < 2**64 - 1:  # what torch.manual_seed takes, for the held-out masks' seed + 1 too
        raise CommandError(f"--seed must fit in 64 bits (from -2**63 to 2**64 - 2), got {args.seed}")
    if not 0 < args.mlm_probability < 1:
        raise CommandError(f"--mlm-probability must be between 0 and 1, got {args.mlm_probability}")
    if args.data and args.dataset:
        raise CommandError("give either --data or --dataset, not both")
    dataset_options = [f"--{name.replace('_', '-')}" for name, default in DATASET_ONLY_OPTIONS.items()
                       if getattr(args, name, default) != default]
    if args.data and dataset_options:  # they were ignored: a .csv's --text-column read the whole file as text
        raise CommandError(
            f"{', '.join(dataset_options)} apply to --dataset, not to --data (text files, read whole); to read one "
            "column of a .csv or .jsonl file, put it in a folder of its own and pass --dataset FOLDER --text-column "
            "COLUMN --eval-split train"
        )
    if not args.data and not getattr(args, "pairs", None) and importlib.util.find_spec("datasets") is None:
        raise CommandError(
            f"text from {'--dataset' if args.dataset else 'the default dataset wikitext'} needs the datasets "
            'library: pip install "hf_grow[data]", or pass local text with --data FILE'
        )
    if args.eval_fraction is not None:
        if not 0 < args.eval_fraction < 1:
            raise CommandError(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
        if args.eval_tokens is not None:
            raise CommandError("give either --eval-tokens or --eval-fraction, not both")
        if not held_out_of_the_same_text(args):
            raise CommandError(
                f"--eval-fraction applies to held-out text cut from the statistics' text; here it is read from "
                f"--eval-split {args.eval_split} (--eval-tokens sets how much)"
            )


def held_out_of_the_same_text(args: argparse.Namespace) -> bool:
    """Whether the held-out text is the tail of the statistics' text (local files, or one dataset split)."""
    return bool(args.data) or args.eval_split == args.split


#: Options of the main command that do nothing without another: the one they need.
UNUSED_WITHOUT = {"private": "push_to_hub", "revision": "push_to_hub", "commit_message": "push_to_hub",
                  "eval_pairs": "pairs", "pair_columns": "pairs", "negative_column": "pairs"}


def check_arguments(args: argparse.Namespace) -> None:
    if args.budget is not None and args.p is not None:
        raise CommandError("give either --p or --budget, not both")
    if args.budget is None:
        args.p = DEFAULT_P if args.p is None else args.p
        if args.p <= 0:
            raise CommandError(f"--p must be a positive number of dimensions to add, got {args.p}")
        if args.multiple_of != 1:
            raise CommandError("--multiple-of applies to --budget")
    elif args.multiple_of <= 0 or args.budget <= 0 or args.budget % args.multiple_of:
        raise CommandError(
            f"--budget must be a positive multiple of --multiple-of, got --budget {args.budget} --multiple-of "
            f"{args.multiple_of}"
        )
    check_data_arguments(args)
    check_memory_flags(args)
    unused = {name: needs for name, needs in UNUSED_WITHOUT.items()
              if getattr(args, name) is not None and getattr(args, name) is not False and not getattr(args, needs)}
    if unused:  # a forgotten --push-to-hub (or --pairs) would pass without a word
        flags = [f"--{name.replace('_', '-')}" for name in unused]
        needed = " and ".join(sorted({f"--{needs.replace('_', '-')}" for needs in unused.values()}))
        raise CommandError(f"{', '.join(flags)} appl{'ies' if len(flags) == 1 else 'y'} to {needed}, which is not "
                           "given")
    if args.push_to_hub:
        with as_command_error():
            hub.check_push(args.push_to_hub)
    check_device(args)
    if args.output_dir is None and not args.dry_run:
        raise CommandError("--output-dir is required (the folder for the grown model), except with --dry-run")
    check_inputs_kept(args, ("--output-dir", args.output_dir), ("--report", args.report))
    if args.output_dir is not None:
        check_output_folder(Path(args.output_dir), args.overwrite)
        if args.report and Path(args.report).resolve().is_relative_to(Path(args.output_dir).resolve()):
            raise CommandError(
                f"--report {args.report} lies inside --output-dir {args.output_dir}, which is written as a whole "
                "(with growth_report.json in it): write the report elsewhere"
            )
    check_file_folders(("--report", args.report))
    args.config = _growth_config(args)
    check_statistics_flags(args, collecting=not args.stats)


def check_memory_flags(args: argparse.Namespace) -> None:
    """``--memory-budget`` and ``--max-memory`` are sizes."""
    for option in ("memory_budget", "max_memory"):
        if getattr(args, option) is not None:
            with as_command_error():
                parse_bytes(getattr(args, option), "--" + option.replace("_", "-"))


def check_statistics_flags(args: argparse.Namespace, collecting: bool = True) -> None:
    """The statistics method of ``args.config`` runs on ``--device`` where statistics are ``collecting``, and its
    ``--offload-dir`` is a folder the run may use, apart from its inputs."""
    if collecting:
        with as_command_error():
            check_method_runs(args.config.statistics_method, torch.device(args.device))
    if args.config.offload_dir is not None:
        with as_command_error():
            check_offload_dir(args.config.offload_dir, torch.device(args.device), "--offload-dir")
        check_inputs_kept(args, ("--offload-dir", args.config.offload_dir), holding=False)


def _growth_config(args: argparse.Namespace) -> GrowthConfig:
    """The `GrowthConfig` of the growth flags (on top of `GrowthConfig.for_training` with ``--for-training``); its
    checks as one-line errors, before any data is read."""
    options = {option.name: getattr(args, option.name) for option in dataclasses.fields(GrowthConfig)}
    for name in ("eval_fraction", *FOR_TRAINING):  # None: not given (the parser's default), the config's default
        if options[name] is None:
            del options[name]
    with as_command_error(TypeError, ValueError):
        return GrowthConfig.for_training(**options) if args.for_training else GrowthConfig(**options)


def check_device(args: argparse.Namespace) -> None:
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CommandError(f"--device {args.device!r} is not a device: write e.g. cpu, cuda or cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {args.device}: this PyTorch sees no CUDA device; use --device cpu")


def check_output_folder(output: Path, overwrite: bool) -> None:
    """A ready or creatable output folder, refused if it holds anything, unless ``overwrite`` and what it holds is a
    saved model: a folder of other files (a project, the current folder) is never emptied."""
    if os.path.ismount(output):
        raise CommandError(
            f"--output-dir {output} is a mount point, which the finished model cannot be renamed into: give a folder "
            "inside it"
        )
    cwd = Path.cwd().resolve()
    if output.resolve() in (cwd, *cwd.parents):  # replaced whole, a shell in it would sit in the deleted old folder
        raise CommandError(
            f"--output-dir {output} is the current folder or holds it: the finished model replaces the folder whole, "
            "leaving this shell in a deleted copy; give a folder beside it (e.g. --output-dir ../NAME) or cd out first"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise CommandError(f"{output} exists and is not empty: choose another --output-dir or pass --overwrite")
        foreign = not_a_saved_model(output)
        if foreign is not None:
            raise CommandError(
                f"--overwrite replaces only a folder that holds a saved model and nothing else, and {output} "
                f"{foreign}: choose another --output-dir, or empty it yourself"
            )
    ancestor = output.resolve().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise CommandError(f"--output-dir {output}: cannot create folders in {ancestor}")


def not_a_saved_model(folder: Path) -> str | None:
    """Why ``folder`` is not a saved model's folder alone (what `--overwrite` may replace), or None where it is:
    a transformers config with a ``model_type`` or a SentenceTransformer's ``modules.json``, and besides only files
    a save writes (`MODEL_FILE_SUFFIXES`) and the listed module folders: no hidden entries (``.git``), no other
    folders (a project's sources, a Trainer's checkpoints)."""
    modules = _read_json(folder / "modules.json")
    config = _read_json(folder / "config.json")
    modules = modules if isinstance(modules, list) else []
    module_folders = {str(module.get("path") or "") for module in modules if isinstance(module, dict)}
    if not (isinstance(config, dict) and "model_type" in config) and not module_folders:
        return "holds no transformers config.json with a model_type, nor a SentenceTransformer's modules.json"
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            why = "a hidden entry"
        elif entry.is_dir():
            why = None if entry.name in module_folders else "a folder that is none of its modules"
        elif TRAINER_FILES.fullmatch(entry.name):  # by suffix a model's, but a checkpoint's state or results
            why = "a file of a Trainer's checkpoint or output, not of a model save"
        else:
            code = isinstance(config, dict) and "auto_map" in config  # a model that ships its own modules
            why = None if _saved_by_a_model(entry.name, code) else "a file that no model save writes"
        if why is not None:
            return f"holds {entry.name!r} ({why})"
    return None


def _saved_by_a_model(name: str, code: bool) -> bool:
    """Whether a file of this name is one a model's save writes: by suffix (`MODEL_FILE_SUFFIXES`), and for text,
    code and markdown by name (a vocabulary, merges, modeling code, the card), not a user's notes or scripts.
    ``code``: the model ships its own modules (``auto_map``, as a grown model does), any of which a save writes."""
    suffix = Path(name).suffix
    if name.upper().startswith(("LICENSE", "NOTICE", "USE_POLICY")):  # a model's terms, which the command copies
        return True
    if suffix == ".txt":
        return "vocab" in name or "merges" in name
    if suffix == ".py":
        return code or name.startswith(("modeling_", "configuration_", "tokenization_", "processing_"))
    if suffix == ".md":
        return name == "README.md"
    return suffix in MODEL_FILE_SUFFIXES


def _read_json(path: Path) -> object:
    """The JSON in ``path``, or None where there is none or it does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_cross_fit_batches(cross_fit: bool, batches: int, processes: int = 1, off: str = "--cross-fit false") -> None:
    """``--cross-fit`` (also of ``--for-training``) sums M over the odd-numbered statistics batches of each process
    too, which needs a second batch on one process at least (dealt in turn: ``processes + 1`` batches): refused
    once the text or pairs are tokenized, before the statistics pass (it failed after it). ``off``: how the
    command turns it off."""
    if cross_fit and batches < processes + 1:
        raise CommandError(
            f"--cross-fit sums M over two halves of the statistics batches, but the data gives {batches} batch(es)"
            f"{f' for {processes} processes' if processes > 1 else ''}: pass more data (--max-tokens, more pairs), a "
            f"smaller --batch-size, or {off}"
        )


def check_file_folders(*options: tuple[str, str | None]) -> None:
    """Output files' folders exist, and no two outputs are one file: found before any work, not when the results
    are written (the second would replace the first)."""
    named: dict[Path, str] = {}
    for option, path in options:  # the null device may take several
        target = Path(path).resolve() if path else None
        first = named.setdefault(target, option) if target is not None and target != Path(os.devnull) else option
        if first != option:
            raise CommandError(f"{first} and {option} name the same file {path}: give each a file of its own")
    for option, path in options:
        # the folder as written: "a/missing/../r.json" resolves lexically to "a", but cannot be opened
        if path and not os.path.isdir(os.path.dirname(path) or "."):
            raise CommandError(f"{option}: the folder of {path} does not exist")
        if path and Path(path).is_dir():
            raise CommandError(f"{option} {path} is a folder: give a file name")
        # written into as it is where it is a device or FIFO (/dev/stdout), else beside the file a link points to
        target = Path(path) if path and Path(path).exists() and not Path(path).is_file() else None
        if path and not os.access(target or Path(os.path.realpath(path)).parent, os.W_OK):
            raise CommandError(f"{option} {path}: {'it' if target else 'its folder'} cannot be written (permissions, "
                               "a read-only disk): give another path")


def check_inputs_kept(args: argparse.Namespace, *outputs: tuple[str, str | None], holding: bool = True) -> None:
    """Nothing the command writes replaces, contains or enters what it reads (the local model folder, ``--stats``,
    ``--pairs``, the ``--data`` files): the input checkpoint is never modified on disk. ``holding=False``: an
    output folder that only gets a new subfolder (``--offload-dir``) may hold the inputs, not be or enter them."""
    inputs = [Path(path) for path in (args.model, getattr(args, "stats", None), getattr(args, "pairs", None)) if path]
    inputs += [Path(path) for pattern in getattr(args, "data", None) or [] for path in matching_paths(pattern)]
    inputs = [path.resolve() for path in inputs if path.exists()]
    for option, written in outputs:
        if written is None:
            continue
        target = Path(written).resolve()  # a "~" the shell left is a folder named so, where it is written too
        for read in inputs:
            if (read.is_relative_to(target) and (holding or read == target)) or (
                read.is_dir() and target.is_relative_to(read)
            ):
                where = "is" if read == target else "holds" if read.is_relative_to(target) else "is inside"
                raise CommandError(
                    f"{option} {written} {where} the input {read}: the command never writes over or into what it "
                    "reads; choose another path"
                )


def check_model_growth(
    model: nn.Module, config: GrowthConfig, statistics: GrowthStatistics | None, checkpoint: str | None = None
) -> None:
    """What needs the model but no data (``model`` may be on the meta device): a growth it can take (`check_growth`)
    and ``statistics`` collected on it, their weights compared with those saved in the ``checkpoint`` folder where
    it holds them in safetensors (`checkpoint_weight_sample`); refused before any text or weights are read."""
    adapter = get_adapter(model)
    with as_command_error(ValueError, FloatingPointError):
        check_growth(model, adapter, config, mode=None)
        if statistics is not None:
            check_statistics(statistics, model, adapter, config.cross_fit)
            saved = None if checkpoint is None else checkpoint_weight_sample(model, checkpoint)
            if saved is not None:
                check_weight_sample(saved, statistics)
