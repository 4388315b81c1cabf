"""The command's memory plan: printed before any data is read, the whole output of ``--dry-run``, and a one-line
refusal naming the flags that fix a run that would not fit (`hf_grow.growth.memory_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from ..adapters import get_adapter, supported_model_types
from ..data import DEFAULT_EVAL_TOKENS
from ..growth.activation_probe import activation_bytes, statistics_attention
from ..growth.memory_plan import OFFLOAD_PLACEHOLDER, MemoryPlan, fitting_changes, plan_memory
from ..progress import format_bytes
from ..statistics import GrowthStatistics, parse_bytes
from .checks import CommandError, check_model_growth
from .loading import DTYPES


#: Disk an output folder needs beside the grown model's weights: the config, the card, the modeling files (a
#: tokenizer, 17 MB for a Llama 3's, is not counted).
OUTPUT_DISK_MARGIN = 2**20


def check_memory(
    args: argparse.Namespace, objective: str, show_progress: bool, statistics: GrowthStatistics | None = None,
    inspection: bool = False,
) -> MemoryPlan:
    """Plan the run from the model's config alone (a model on the meta device), print the plan (on stdout with
    ``--dry-run``, else with the progress lines) and refuse a run that would not fit the free memory. Before
    that, refuse a growth the model cannot take (p too wide, a budget too large; ``statistics`` of another model).

    ``objective``: "causal" or "masked" (a language-model loss on ``--seq-len`` tokens), or "pairs" (a
    SentenceTransformer's contrastive loss: its transformers model without a head, anchors and positives of
    each batch in one graph, at the model's maximum sequence length unless ``--seq-len`` says less).

    With ``--offload-dir``, M is planned on disk, refused where that folder's free disk cannot hold it. Where M
    does not fit the memory even one layer at a time, the refusal names ``--offload-dir DIR`` and the disk it needs.

    ``inspection``: the plan of ``hf-grow inspect`` (statistics and gains; every layer's M kept with
    ``--save-stats``).
    """
    plan_with, model = _planner(args, objective, inspection)
    local = objective != "pairs" and Path(args.model).is_dir()  # a SentenceTransformer's model: checked when loaded
    if not inspection:
        check_model_growth(model, args.config, statistics, checkpoint=args.model if local else None)
    try:
        plan = plan_with({})
    except ValueError as error:  # a budget below one layer's statistics (`layer_groups`)
        raise CommandError(f"--memory-budget {args.config.memory_budget}: {error}") from None
    if os.environ.get("RANK", "0") == "0":  # launched with several, once (a dry run starts no process group)
        if args.dry_run:
            print(plan.table())
        elif show_progress:
            print("memory plan:\n" + plan.table(), file=sys.stderr)
        _warn_of_a_budget_that_saves_nothing(args, plan, plan_with)
    # The processes launched on this machine share its memory and the disk of --offload-dir (each maps its M
    # there); each has a device of its own.
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free_host, free_device = _free_memory(args.device)
    free_host //= sharing
    if args.max_memory is not None:
        limit = parse_bytes(args.max_memory, "--max-memory")
        free_host, free_device = (free_host, min(free_device, limit)) if plan.on_device else (
            min(free_host, limit), free_device)
    free_disk = shutil.disk_usage(plan.offload_dir).free // sharing if plan.offload_dir is not None else math.inf

    def fits(candidate: MemoryPlan, least: bool = False) -> bool:
        return _fits(candidate, free_host, free_device, least) and candidate.disk <= free_disk

    if args.ignore_memory_plan or fits(plan):
        _check_output_disk(args, plan, inspection)
        return plan
    stage = max(plan.stages, key=lambda stage: stage.device if plan.on_device else stage.host)
    where = "device" if plan.on_device else "host"
    free = free_device if plan.on_device else free_host
    limit = "allowed (--max-memory)" if args.max_memory is not None else "free"
    shared = f" for each of the {sharing} processes on this machine" if sharing > 1 else ""
    limit += shared if where == "host" else ""
    needed = stage.device if plan.on_device else stage.host
    if fits(plan, least=True):
        # The plan counts every head's compact solve at its rank ceiling, which flat spectra (random weights)
        # reach; the certified rank is known only during the solve: a run that fits at the least rank goes on.
        least = plan.least_peak_device if plan.on_device else plan.least_peak_host
        print(
            f"hf-grow: warning: the {stage.name} stage may need up to {format_bytes(needed)} of {where} memory, "
            f"{format_bytes(free)} is {limit}: that is every head's compact solve at its rank ceiling, which flat "
            f"spectra (random weights) reach; {format_bytes(least)} at the least rank: going on", file=sys.stderr
        )
        _check_output_disk(args, plan, inspection)
        return plan
    # changes that fit the rank ceiling, else the least rank (the rerun then warns and goes on); the model's dtype
    # only where neither fits without
    changes = next(filter(None, (
        fitting_changes(plan_with, args.config, fit, [model_dtype])
        for model_dtype in (None, "bfloat16") for fit in (fits, lambda candidate: fits(candidate, least=True))
    )), None)
    fix = _rerun_with(changes, plan_with) if changes else None
    if _fits(plan, free_host, free_device):  # only the disk of --offload-dir is short
        raise CommandError(
            f"M needs about {format_bytes(plan.disk)} of disk in --offload-dir {plan.offload_dir}, "
            f"{format_bytes(free_disk)} is free there{shared}: {fix or 'free disk there or name another folder'} (see "
            "--dry-run; --ignore-memory-plan runs anyway)"
        )
    raise CommandError(
        f"the {stage.name} stage needs about {format_bytes(needed)} of {where} memory, {format_bytes(free)} is "
        f"{limit}: {fix or 'use a machine with more memory'} (see --dry-run; --ignore-memory-plan runs anyway)"
    )


def _warn_of_a_budget_that_saves_nothing(
    args: argparse.Namespace, plan: MemoryPlan, plan_with: Callable[[dict], MemoryPlan]
) -> None:
    """A ``--memory-budget`` that splits the statistics into passes yet lowers neither peak of the plan (at the rank
    ceiling and at the least rank) nor the disk of ``--offload-dir`` costs a pass over the data per group and saves
    nothing: another stage peaks (the line search), or each layer's compact solve, held through the later passes,
    outweighs its M (GPT-2's widths, "refactor" at the rank ceiling)."""
    if args.config.memory_budget is None or len(plan.groups) < 2:
        return
    whole = plan_with({"memory_budget": None})

    def needs(candidate: MemoryPlan) -> tuple[int, int, int]:
        if candidate.on_device:
            return candidate.peak_device, candidate.least_peak_device, candidate.disk
        return candidate.peak_host, candidate.least_peak_host, candidate.disk

    if all(budgeted >= one_pass for budgeted, one_pass in zip(needs(plan), needs(whole))):
        peak = max(plan.stages, key=lambda stage: stage.device if plan.on_device else stage.host)
        print(
            f"hf-grow: warning: --memory-budget {args.config.memory_budget} takes {len(plan.groups)} passes over "
            f"the data but lowers no planned peak ({format_bytes(needs(plan)[0])}, {format_bytes(needs(whole)[0])} "
            f"in one pass; the {peak.name} stage peaks): leave it out (see --dry-run)", file=sys.stderr
        )


def _check_output_disk(args: argparse.Namespace, plan: MemoryPlan, inspection: bool) -> None:
    """Refuse an output folder whose disk cannot hold the grown model (its write failed after the whole run), on
    the main process (it writes)."""
    if inspection or args.dry_run or args.ignore_memory_plan or os.environ.get("RANK", "0") != "0":
        return
    write = next(stage for stage in plan.stages if stage.name == "write")
    needed = write.terms.get("grown model", 0) + OUTPUT_DISK_MARGIN  # the tokenizer, the card, the config
    folder = Path(args.output_dir).absolute()
    while not folder.exists():  # the folder is made by the run: the disk of its nearest existing parent
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise CommandError(
            f"the grown model needs about {format_bytes(needed)} of disk in {folder}, {format_bytes(free)} is free "
            "there: free disk there or pass another --output-dir (--ignore-memory-plan runs anyway)"
        )


def _rerun_with(changes: dict, plan_with: Callable[[dict], MemoryPlan]) -> str:
    """The flags of ``changes``; a folder to name for `OFFLOAD_PLACEHOLDER` comes with the disk it needs."""
    flags = [f"--{'' if value else 'no-'}{name}" if isinstance(value, bool) else f"--{name} {value}"
             for name, value in ((name.replace("_", "-"), value) for name, value in changes.items())]
    fix = "rerun with " + " ".join(flags)
    if changes.get("offload_dir") == OFFLOAD_PLACEHOLDER:
        fix += f", {OFFLOAD_PLACEHOLDER} a folder with {format_bytes(plan_with(changes).disk)} of free disk for M"
    return fix


def _planner(
    args: argparse.Namespace, objective: str, inspection: bool = False
) -> tuple[Callable[[dict], MemoryPlan], torch.nn.Module]:
    """``plan_with(changes)``: the plan with some options changed (config fields, batch_size, dtype); and the model
    as ``--dtype`` loads it, on the meta device. ``inspection``: `plan_memory`'s of ``hf-grow inspect``."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    auto_class = {"masked": AutoModelForMaskedLM, "causal": AutoModelForCausalLM, "pairs": AutoModel}[objective]
    seq_len, eval_tokens = args.seq_len, args.eval_tokens or DEFAULT_EVAL_TOKENS
    if objective == "pairs":
        folder, max_seq_length = _sentence_transformer_parts(args.model)
        try:
            model_config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError) as error:
            message = str(error).splitlines()[0]
            raise CommandError(f"cannot load {args.model!r} as a SentenceTransformer: {message}") from None
        if model_config.model_type not in supported_model_types():
            raise CommandError(f"hf_grow cannot grow {args.model!r} (model_type={model_config.model_type!r}); "
                               f"supported model types: {', '.join(supported_model_types())}")
        # the run's length: --seq-len where given (the run refuses one past the positions), else the saved one;
        # sentence-transformers caps either at the positions
        positions = getattr(model_config, "max_position_embeddings", None) or 512
        if args.seq_len is not None and args.seq_len > positions:  # the run refuses it too, after loading
            raise CommandError(f"--seq-len {args.seq_len} exceeds the {positions} positions of {args.model!r}")
        seq_len = min(args.seq_len or max_seq_length or positions, positions)
    else:
        model_config = AutoConfig.from_pretrained(args.model)
    # a batch of pairs: its anchors and its positives (and its hard negatives, a third column named)
    sequences = (3 if getattr(args, "negative_column", None) else 2) if objective == "pairs" else 1
    if objective == "pairs" and args.eval_pairs:
        eval_tokens = sequences * seq_len * args.eval_pairs
    # --stats: no statistics pass; the file's tensors are held through the solve and the line search
    stats = getattr(args, "stats", None)
    if stats and not Path(stats).is_file():  # a dry run reads no statistics: the file is checked here
        raise CommandError(f"--stats {stats}: no such file; pass the file written by `hf-grow inspect --save-stats`")
    given_statistics = os.path.getsize(stats) if stats else None
    weights_dtype = _saved_dtype(model_config)  # before from_config sets the config's dtype to the model's
    models: dict[str, torch.nn.Module] = {}
    activations: dict[tuple[str, int], int] = {}

    def meta_model(dtype: str) -> torch.nn.Module:
        if dtype not in models:
            with torch.device("meta"):
                models[dtype] = auto_class.from_config(model_config, dtype=DTYPES[dtype])
        return models[dtype]

    def plan_with(changes: dict) -> MemoryPlan:
        dtype = changes.get("dtype", args.dtype)
        batch_size = changes.get("batch_size", args.batch_size)
        model = meta_model(dtype)
        fields = {name: value for name, value in changes.items() if name not in ("dtype", "batch_size")}
        config = dataclasses.replace(args.config, **fields)
        attention = statistics_attention(seq_len, args.device)
        if (dtype, batch_size) not in activations:
            activations[dtype, batch_size] = activation_bytes(model, sequences * batch_size, seq_len, attention)
        plan = plan_memory(
            model, get_adapter(model), config, batch_size=sequences * batch_size, seq_len=seq_len,
            eval_tokens=eval_tokens, device=args.device, activations=activations[dtype, batch_size],
            processes=int(os.environ.get("WORLD_SIZE", "1")),  # launched with several: one process's plan
            weights_dtype=weights_dtype, given_statistics=given_statistics,
            inspection=inspection, keep_statistics=inspection and bool(args.save_stats),
        )
        return dataclasses.replace(plan, batch_size=batch_size)  # the flag's value, which a refusal may halve

    return plan_with, meta_model(args.dtype)


def _saved_dtype(model_config) -> torch.dtype:
    """The dtype of the model's weights file, as its config records it (float32 where it does not: checkpoints
    saved before transformers recorded it)."""
    dtype = getattr(model_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _sentence_transformer_parts(model: str) -> tuple[str, int | None]:
    """Where a SentenceTransformer (a local folder or a Hub id) keeps its transformers model's config, and its
    maximum sequence length where its folder says it (``modules.json``, ``sentence_bert_config.json``, else the
    tokenizer's ``model_max_length``, where sentence-transformers 6 saves it)."""
    folder = Path(model)
    if not (folder / "modules.json").is_file():
        return model, None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        inner = folder / next((module["path"] for module in modules if module["type"].endswith(".Transformer")), "")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CommandError(
            f"{folder / 'modules.json'} is damaged: a SentenceTransformer's list of modules, each with its type "
            "and path, is expected there"
        ) from None
    settings = inner / "sentence_bert_config.json"
    length = json.loads(settings.read_text()).get("max_seq_length") if settings.is_file() else None
    tokenizer = inner / "tokenizer_config.json"  # sentence-transformers 6 keeps it there only
    if length is None and tokenizer.is_file():
        length = json.loads(tokenizer.read_text()).get("model_max_length")
        length = length if isinstance(length, int) and length < 10**6 else None  # 1e30: "no limit"
    return str(inner), length


def _free_memory(device: str) -> tuple[int, int]:
    """Free host memory (what this process holds now, plus what is available) and free memory of ``device``."""
    host = psutil.virtual_memory().available + psutil.Process().memory_info().rss
    target = torch.device(device)
    if target.type == "cuda":
        return host, torch.cuda.mem_get_info(target)[0]
    return host, 0


def _fits(plan: MemoryPlan, free_host: int, free_device: int, least: bool = False) -> bool:
    """Whether the plan's peaks fit; ``least``: with every compact solve at its least rank (a lower bound)."""
    host, device = (plan.least_peak_host, plan.least_peak_device) if least else (plan.peak_host, plan.peak_device)
    return host <= free_host and (not plan.on_device or device <= free_device)
