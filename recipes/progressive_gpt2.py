"""Progressive growth of the query/key width during training, against fixed widths, at the same token budget.

Trains small GPT-2s (byte-level) on a local corpus, the Python standard library's sources by default, and
compares at the same number of training tokens:

    (a) fixed-small    fixed small Q/K width
    (b) fixed-large    fixed large Q/K width (the target)
    (c) grown-refactor grown small -> large on a schedule by hf_grow, mode "refactor"
        grown-append   the same with mode "append"
    (d) zero           the same schedule, new dims: random queries, zero keys (plain function-preserving widening)
    (e) random         the same schedule, new dims: small random queries and keys

It prints a table (final held-out loss, training FLOPs, growth overhead, FLOPs at which each run first reaches
(b)'s final held-out loss, the held-out loss just before and right after each growth) and writes a PNG of the
held-out loss against training FLOPs (with matplotlib). The FLOPs of (c) include the statistics collection
(forward, backward to the inputs, the C and M products), the line-search forward passes and the solve.

    python recipes/progressive_gpt2.py --preset cpu            # a few minutes on 1-2 CPU cores
    python recipes/progressive_gpt2.py --preset gpu --device cuda
    python recipes/progressive_gpt2.py --data 'my_corpus/*.txt' --preset cpu

The pieces (`Variant`, `standard_variants`, `Task`, `train_variant`, the FLOP counts) are importable, so that
other benchmarks can run the same variants on their own tasks.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers.utils import logging as transformers_logging

from hf_grow import GrownGPT2Config, GrownGPT2LMHeadModel, evaluate_loss, grow_in_training


PRESETS = {
    "cpu": dict(
        n_embd=64, n_layer=2, n_head=4, seq_len=64, batch_size=16, steps=1000, small=4, large=16,
        schedule={250: 8, 500: 16}, eval_every=50, eval_batches=16, lr=3e-3, warmup=50, threads=1,
    ),
    "gpu": dict(
        n_embd=256, n_layer=4, n_head=8, seq_len=256, batch_size=32, steps=6000, small=8, large=32,
        schedule={1000: 16, 2000: 32}, eval_every=200, eval_batches=32, lr=1e-3, warmup=200, threads=None,
    ),
}
VARIANT_NAMES = ("fixed-small", "fixed-large", "grown-refactor", "grown-append", "zero", "random")


@dataclass
class Variant:
    """One training run's Q/K plan: the starting width and, for grown runs, ``{step: width}``, a mode and
    options of `grow_in_training` (e.g. ``{"new_moments": "zero"}``)."""

    name: str
    qk_start: int
    mode: str | None = None
    schedule: dict[int, int] = field(default_factory=dict)
    options: dict = field(default_factory=dict)


def standard_variants(
    small: int, large: int, schedule: dict[int, int], names: Sequence[str] = VARIANT_NAMES
) -> list[Variant]:
    """The variants (a)-(e): fixed small, fixed large, and the schedule grown by hf_grow and the baselines."""
    modes = {"grown-refactor": "refactor", "grown-append": "append", "zero": "zero", "random": "random"}
    variants = {"fixed-small": Variant("fixed-small", small), "fixed-large": Variant("fixed-large", large)}
    variants.update({name: Variant(name, small, mode, dict(schedule)) for name, mode in modes.items()})
    unknown = [name for name in names if name not in variants]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(variants)}")
    return [variants[name] for name in names]


@dataclass
class Task:
    """What a run trains on: the model config (its Q/K widths are set per variant) and the data.

    ``train_batch(step)`` gives the batch of a training step (the same for every variant);
    ``growth_batches(step, count)`` gives batches of training data for the statistics and line search at a
    growth; ``eval_batches`` are held out; ``metrics(model)`` adds numbers to each evaluation (optional).
    """

    config: GrownGPT2Config
    train_batch: Callable[[int], dict]
    growth_batches: Callable[[int, int], list[dict]]
    eval_batches: list[dict]
    metrics: Callable[[GrownGPT2LMHeadModel], dict[str, float]] | None = None
    loss_fn: Callable[[GrownGPT2LMHeadModel, dict], torch.Tensor] | None = None

    def loss(self, model: GrownGPT2LMHeadModel, batch: dict) -> torch.Tensor:
        return self.loss_fn(model, batch) if self.loss_fn is not None else model(**batch).loss


@dataclass
class CurvePoint:
    step: int
    tokens: int
    flops: float
    eval_loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    #: False for the extra evaluations just before and right after a growth (left out of the AUC).
    scheduled: bool = True


@dataclass
class GrowthEvent:
    step: int
    qk_dims: list[int]
    eval_loss_before: float
    eval_loss_after: float
    overhead_flops: float
    step_size: float | None = None
    search_loss_before: float | None = None
    search_loss_after: float | None = None


@dataclass
class Run:
    variant: str
    curve: list[CurvePoint]
    growths: list[GrowthEvent]
    training_flops: float
    overhead_flops: float
    seconds: float

    @property
    def final_loss(self) -> float:
        return self.curve[-1].eval_loss

    def flops_to_reach(self, loss: float) -> float | None:
        """Total FLOPs (training and growth overhead) at the first evaluation at or below ``loss``."""
        return next((point.flops for point in self.curve if point.eval_loss <= loss), None)

    def steps_to_reach(self, loss: float) -> int | None:
        return next((point.step for point in self.curve if point.eval_loss <= loss), None)

    def area_under_curve(self) -> float:
        """Mean held-out loss over training (trapezoids over the scheduled evaluations)."""
        points = [point for point in self.curve if point.scheduled]
        area = sum((b.step - a.step) * (a.eval_loss + b.eval_loss) / 2 for a, b in zip(points, points[1:]))
        return area / (points[-1].step - points[0].step)


def forward_flops_per_token(config: GrownGPT2Config, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass per token: projections, causal attention (s/2 keys on average), LM head."""
    d, heads, value_dim = config.n_embd, config.n_head, config.n_embd // config.n_head
    inner = config.n_inner or 4 * d
    keys = (seq_len + 1) / 2
    total = 2 * d * config.vocab_size
    for qk_dim in config.qk_head_dims:
        total += 2 * d * (2 * heads * qk_dim + d) + 2 * d * d + 2 * 2 * d * inner
        total += 2 * heads * keys * (qk_dim + value_dim)
    return total


def training_flops(config: GrownGPT2Config, tokens: int, seq_len: int) -> float:
    """Forward and backward (twice the forward) over ``tokens``."""
    return 3 * forward_flops_per_token(config, seq_len) * tokens


def statistics_flops(config: GrownGPT2Config, tokens: int, seq_len: int) -> float:
    """`collect_statistics` over ``tokens``: forward, backward to the inputs (no weight gradients: about one
    forward), and per layer C (2 d'^2 per token) and per head M = X'^T G X' (recomputed softmax, G, G X',
    X'^T (G X'))."""
    d_aug, heads, value_dim = config.n_embd + 1, config.n_head, config.n_embd // config.n_head
    keys = (seq_len + 1) / 2
    per_token = 2 * forward_flops_per_token(config, seq_len)
    for qk_dim in config.qk_head_dims:
        per_token += 2 * d_aug * d_aug + heads * (2 * keys * (qk_dim + 2 * value_dim + d_aug) + 2 * d_aug * d_aug)
    return per_token * tokens


def solve_flops(config: GrownGPT2Config, decompositions: int) -> float:
    """Eigendecompositions and products of the solve: about 20 d'^3 per head and decomposition, plus C per layer."""
    d_aug = config.n_embd + 1
    return config.n_layer * (10 * d_aug**3 + config.n_head * (8 * d_aug**3 + decompositions * 20 * d_aug**3))


def _tokens(batch: dict) -> int:
    """Positions the model runs over (ids or embeddings): what the FLOP counts scale with."""
    return batch["labels"].numel()


def _evaluate(model: GrownGPT2LMHeadModel, task: Task) -> tuple[float, dict[str, float]]:
    loss = evaluate_loss(model, task.eval_batches, loss_fn=task.loss_fn)[0]
    return loss, (task.metrics(model) if task.metrics else {})


def _schedule_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_variant(
    variant: Variant,
    task: Task,
    steps: int,
    lr: float,
    warmup: int,
    eval_every: int,
    seed: int = 0,
    statistics_batches: int = 8,
    search_batches: int = 4,
    growth_kwargs: dict | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> Run:
    """Train one variant with AdamW (weight decay 0.01), growing in place at its scheduled steps."""
    torch.manual_seed(seed)
    config = GrownGPT2Config(**{**task.config.to_dict(), "qk_head_dims": [variant.qk_start] * task.config.n_layer})
    model = GrownGPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    seq_len = task.eval_batches[0]["labels"].shape[1]
    flops = overhead = 0.0
    tokens = 0
    curve, growths = [], []
    started = time.perf_counter()

    def record(step: int, scheduled: bool = True) -> float:
        loss, metrics = _evaluate(model, task)
        curve.append(CurvePoint(step, tokens, flops + overhead, loss, metrics, scheduled))
        return loss

    record(0)
    for step in range(1, steps + 1):
        batch = {key: value.to(device) for key, value in task.train_batch(step).items()}
        for group in optimizer.param_groups:
            group["lr"] = _schedule_lr(step - 1, steps, lr, warmup)
        model.train()
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        batch_tokens = _tokens(batch)
        tokens += batch_tokens
        flops += training_flops(model.config, batch_tokens, seq_len)
        if step in variant.schedule and variant.mode is not None:
            width = variant.schedule[step]
            before = record(step, scheduled=False)
            added = {layer: width - dim for layer, dim in enumerate(model.config.qk_head_dims) if width > dim}
            drawn = task.growth_batches(step, statistics_batches + search_batches)
            stats, search = drawn[:statistics_batches], drawn[statistics_batches:]
            config_before = GrownGPT2Config(**model.config.to_dict())
            report = grow_in_training(
                model, optimizer, stats, added, mode=variant.mode, eval_dataloader=search, seed=seed + step,
                loss_fn=task.loss_fn, **{**(growth_kwargs or {}), **variant.options},
            )
            cost = 0.0
            if report is not None:
                stat_tokens = sum(_tokens(b) for b in stats)
                search_tokens = sum(_tokens(b) for b in search)
                evaluations = report.line_search_passes  # full held-out passes, per-layer searches included
                if evaluations is None:
                    evaluations = 1 + sum(point.step_size != 0 for point in report.line_search)
                decompositions = 1 if variant.mode == "append" else len(report.line_search) + 1
                cost = (
                    statistics_flops(config_before, stat_tokens, seq_len)
                    + evaluations * forward_flops_per_token(model.config, seq_len) * search_tokens
                    + solve_flops(model.config, decompositions)
                )
            overhead += cost
            after = record(step, scheduled=False)  # right after growth, overhead included
            growths.append(
                GrowthEvent(
                    step, list(model.config.qk_head_dims), before, after, cost,
                    report.step_size if report else None,
                    report.eval_loss_before if report else None,
                    report.eval_loss_after if report else None,
                )
            )
            log(f"  {variant.name} step {step}: qk {model.config.qk_head_dims}, held-out {before:.4f} -> {after:.4f}")
        if step % eval_every == 0 or step == steps:
            record(step)
    return Run(variant.name, curve, growths, flops, overhead, time.perf_counter() - started)


def stdlib_files() -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def text_task(
    config: GrownGPT2Config, patterns: Sequence[str] | None, seq_len: int, batch_size: int, eval_batches: int
) -> Task:
    """Byte-level language modelling on text files, split by file (every 10th file held out)."""
    files = (
        sorted({path for pattern in patterns for path in glob.glob(pattern, recursive=True)})
        if patterns
        else stdlib_files()
    )
    if len(files) < 2:
        raise SystemExit(f"need at least 2 text files, found {len(files)} for {patterns}")
    held_out = files[::10]
    training = [path for path in files if path not in held_out]

    def read(paths: list[str]) -> torch.Tensor:
        return torch.tensor(list(b"\n".join(open(path, "rb").read() for path in paths)), dtype=torch.long)

    train_bytes, eval_bytes = read(training), read(held_out)

    def windows(data: torch.Tensor, count: int, generator: torch.Generator) -> dict:
        starts = torch.randint(0, len(data) - seq_len, (count,), generator=generator)
        ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def train_batch(step: int) -> dict:
        return windows(train_bytes, batch_size, torch.Generator().manual_seed(step))

    def growth_batches(step: int, count: int) -> list[dict]:
        generator = torch.Generator().manual_seed(10**6 + step)
        return [windows(train_bytes, batch_size, generator) for _ in range(count)]

    generator = torch.Generator().manual_seed(-1 % 2**31)
    evaluation = [windows(eval_bytes, batch_size, generator) for _ in range(eval_batches)]
    return Task(config, train_batch, growth_batches, evaluation)


def summary_table(runs: list[Run], target: str = "fixed-large") -> str:
    reference = next(run for run in runs if run.variant == target)
    goal = reference.final_loss
    rows = [
        "| variant | final held-out loss | mean loss (AUC) | training GFLOPs | growth overhead GFLOPs | "
        f"GFLOPs to reach {target}'s final loss ({goal:.4f}) | vs {target} "
        "| held-out loss before -> after each growth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total_reference = reference.training_flops + reference.overhead_flops
    for run in runs:
        reached = run.flops_to_reach(goal)
        ratio = "-" if reached is None else f"{reached / total_reference:.2f}x"
        growths = (
            "; ".join(f"{g.step}: {g.eval_loss_before:.4f} -> {g.eval_loss_after:.4f}" for g in run.growths) or "-"
        )
        rows.append(
            f"| {run.variant} | {run.final_loss:.4f} | {run.area_under_curve():.4f} | {run.training_flops / 1e9:.1f} | "
            f"{run.overhead_flops / 1e9:.2f} | {'not reached' if reached is None else f'{reached / 1e9:.1f}'} | "
            f"{ratio} | {growths} |"
        )
    return "\n".join(rows)


def plot(runs: list[Run], path: str) -> bool:
    """Held-out loss against total FLOPs; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        axes.plot([p.flops / 1e9 for p in run.curve[1:]], [p.eval_loss for p in run.curve[1:]], label=run.variant)
        for growth in run.growths:
            point = next(p for p in run.curve if p.step == growth.step)
            axes.plot(point.flops / 1e9, point.eval_loss, "k.", markersize=4)
    axes.set_xlabel("training GFLOPs (growth overhead included)")
    axes.set_ylabel("held-out loss (nats/byte)")
    axes.set_title("Progressive Q/K growth vs fixed widths, same token budget")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--data", nargs="*", help="text files or globs (default: the standard library's sources)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANT_NAMES), choices=VARIANT_NAMES)
    parser.add_argument("--steps", type=int,
                        help="override the preset's training steps (growth steps, warmup and evaluations scale along)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: the preset's)")
    parser.add_argument("--output", default="progressive_gpt2", help="prefix of the .png and .json outputs")
    args = parser.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    if args.steps:
        scale = args.steps / preset["steps"]
        schedule = {max(1, round(step * scale)): width for step, width in preset["schedule"].items()}
        if len(schedule) < len(preset["schedule"]):  # two growths at one step: the later width alone
            parser.error(f"--steps {args.steps} puts the preset's {len(preset['schedule'])} growths on fewer steps: "
                         f"pass at least {preset['steps'] // min(preset['schedule'])}")
        preset["schedule"] = schedule
        preset["eval_every"] = max(1, round(preset["eval_every"] * scale))
        preset["warmup"] = max(1, round(preset["warmup"] * scale))
        preset["steps"] = args.steps
    threads = args.threads or preset["threads"]
    if threads:
        torch.set_num_threads(threads)
    transformers_logging.set_verbosity_error()

    config = GrownGPT2Config(
        vocab_size=256, n_positions=preset["seq_len"], n_embd=preset["n_embd"], n_layer=preset["n_layer"],
        n_head=preset["n_head"], bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    task = text_task(config, args.data, preset["seq_len"], preset["batch_size"], preset["eval_batches"])
    variants = standard_variants(preset["small"], preset["large"], preset["schedule"], args.variants)
    if "fixed-large" not in args.variants:
        raise SystemExit("--variants must include fixed-large, the target")
    print(
        f"preset {args.preset}: n_embd {preset['n_embd']}, {preset['n_layer']} layers, {preset['n_head']} heads, "
        f"Q/K {preset['small']} -> {preset['large']} at {preset['schedule']}, {preset['steps']} steps of "
        f"{preset['batch_size']}x{preset['seq_len']} tokens, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    runs = []
    for variant in variants:
        run = train_variant(
            variant, task, preset["steps"], preset["lr"], preset["warmup"], preset["eval_every"], args.seed,
            device=args.device,
        )
        print(f"{run.variant}: final held-out loss {run.final_loss:.4f} ({run.seconds:.0f} s)")
        runs.append(run)
    print()
    print(summary_table(runs))
    with open(f"{args.output}.json", "w") as handle:
        json.dump(
            {
                "preset": args.preset,
                "settings": {k: v for k, v in preset.items()},
                "runs": [asdict(run) for run in runs],
            },
            handle,
            indent=1,
            default=str,
        )
    if plot(runs, f"{args.output}.png"):
        print(f"\nwrote {args.output}.png and {args.output}.json")
    else:
        print(f"\nwrote {args.output}.json (install matplotlib for the plot)")


if __name__ == "__main__":
    sys.exit(main())
