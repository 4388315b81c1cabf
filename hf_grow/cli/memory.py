"""The command's memory plan: printed before any data is read, the whole output of ``--dry-run``, and a one-line
refusal naming the flags that fix a run that would not fit (`hf_grow.growth.memory_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import psutil
import torch

from ..adapters import get_adapter
from ..data import DEFAULT_EVAL_TOKENS
from ..growth.memory_plan import MemoryPlan, activation_bytes, fitting_changes, plan_memory, statistics_attention
from ..progress import format_bytes
from ..statistics import parse_bytes
from .checks import CommandError
from .loading import DTYPES


def check_memory(args: argparse.Namespace, objective: str, show_progress: bool) -> MemoryPlan:
    """Plan the run from the model's config alone (a model on the meta device), print the plan (on stdout with
    ``--dry-run``, else with the progress lines) and refuse a run that would not fit the free memory."""
    plan_with = _planner(args, objective)
    plan = plan_with({})
    if args.dry_run:
        print(plan.table())
    elif show_progress:
        print("memory plan:\n" + plan.table(), file=sys.stderr)
    free_host, free_device = _free_memory(args.device)
    if args.max_memory is not None:
        limit = parse_bytes(args.max_memory, "--max-memory")
        free_host, free_device = (free_host, min(free_device, limit)) if plan.on_device else (
            min(free_host, limit), free_device)
    if args.ignore_memory_plan or _fits(plan, free_host, free_device):
        return plan
    stage = max(plan.stages, key=lambda stage: stage.device if plan.on_device else stage.host)
    changes = fitting_changes(plan_with, args.config, lambda plan: _fits(plan, free_host, free_device))
    where = "device" if plan.on_device else "host"
    free = free_device if plan.on_device else free_host
    limit = "allowed (--max-memory)" if args.max_memory is not None else "free"
    needed = stage.device if plan.on_device else stage.host
    fix = (
        "rerun with " + " ".join(f"--{name.replace('_', '-')} {value}" for name, value in changes.items())
        if changes else "use a machine with more memory"
    )
    raise CommandError(
        f"the {stage.name} stage needs about {format_bytes(needed)} of {where} memory, {format_bytes(free)} is "
        f"{limit}: {fix} (see --dry-run; --ignore-memory-plan runs anyway)"
    )


def _planner(args: argparse.Namespace, objective: str):
    """``plan_with(changes)``: the plan with some options changed (config fields, batch_size, dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    auto_class = AutoModelForMaskedLM if objective == "masked" else AutoModelForCausalLM
    model_config = AutoConfig.from_pretrained(args.model)
    models: dict[str, torch.nn.Module] = {}
    activations: dict[tuple[str, int], int] = {}

    def plan_with(changes: dict) -> MemoryPlan:
        dtype = changes.get("dtype", args.dtype)
        batch_size = changes.get("batch_size", args.batch_size)
        if dtype not in models:
            with torch.device("meta"):
                models[dtype] = auto_class.from_config(model_config, dtype=DTYPES[dtype])
        model = models[dtype]
        fields = {name: value for name, value in changes.items() if name not in ("dtype", "batch_size")}
        config = dataclasses.replace(args.config, **fields)
        attention = statistics_attention(args.seq_len, args.device)
        if (dtype, batch_size) not in activations:
            activations[dtype, batch_size] = activation_bytes(model, batch_size, args.seq_len, attention)
        return plan_memory(
            model, get_adapter(model), config, batch_size=batch_size, seq_len=args.seq_len,
            eval_tokens=args.eval_tokens or DEFAULT_EVAL_TOKENS, device=args.device,
            activations=activations[dtype, batch_size],
        )

    return plan_with


def _free_memory(device: str) -> tuple[int, int]:
    """Free host memory (what this process holds now, plus what is available) and free memory of ``device``."""
    host = psutil.virtual_memory().available + psutil.Process().memory_info().rss
    target = torch.device(device)
    if target.type == "cuda":
        return host, torch.cuda.mem_get_info(target)[0]
    return host, 0


def _fits(plan: MemoryPlan, free_host: int, free_device: int) -> bool:
    return plan.peak_host <= free_host and (not plan.on_device or plan.peak_device <= free_device)
