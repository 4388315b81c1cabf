"""Benchmark: growth where the query/key rank binds, measured by learning speed across seeds.

Three tasks, each trained with the variants of `recipes/progressive_gpt2.py` (fixed small Q/K width, fixed large,
grown small -> large by hf_grow in "refactor" and "append" mode, and the same schedule with zero-initialised
keys or small random new dims), at the same steps and growth schedule, over several seeds, plus the preset's
option variants (a grown variant with other options of `grow_in_training`, e.g. ``new_moments`` or a
``step_scale`` fraction of the searched step):

- ``plateau``: key -> value retrieval where training itself stalls. One attention layer, learned embeddings of
  ``keys`` (1024) keys and ``values`` values, ``pairs`` stored pairs per sequence (one per position, the sum of
  the key's and the value's embedding), then ``queries`` stored keys asked (the key's embedding plus a learned
  marker), loss at the query positions only. Until embeddings and W_Q, W_K align, attention is near-uniform
  and the loss sits at log(values) for hundreds of steps, at d_k = 8 and d_k = 32 alike. Growth 8 -> 16 -> 24
  -> 32 happens on that plateau. "Steps to escape" is the first evaluation below half of log(values).
- ``retrieval``: the easy contrast. Key -> value lookup in one attention layer with fixed random embeddings:
  each position holds a stored pair, E_key[k] + E_value[v]; the last position holds a query key. With the cpu
  preset a head of d_k = 2 plateaus near 60% accuracy while d_k = 8 learns the task in ~120 steps, so every
  widened variant learns it soon after the growth.
- ``text``: byte-level language modelling of the Python standard library's sources with a deliberately tiny
  initial d_k (2) grown to the standard n_embd / n_head.

For each variant it reports, as mean ± standard deviation over seeds: the final held-out loss (and accuracy),
the area under the held-out loss curve (mean loss over training) and its ratio to the better of the zero and
random baselines, for the plateau task the steps to escape, the steps and FLOPs (growth overhead included) at
which a run first reaches fixed-large's final loss (the worst over its seeds, so that every fixed-large run
reaches it; with how many seeds get there), for the retrieval tasks the steps to 99% accuracy, and the
held-out loss just before and right after each growth. Each variant's final loss and AUC are compared with the
zero and random baselines: a difference smaller than the sum of the two standard deviations is reported as no
difference. Writes a PNG of the loss curves (mean ± std) per task and a JSON of every run. Without fixed-large
among the ``--variants``, the table leaves out the steps to its loss.

    python recipes/benchmarks/bench_bottleneck.py --preset cpu --tasks plateau &          # side by side on
    python recipes/benchmarks/bench_bottleneck.py --preset cpu --tasks retrieval text    # 2 cores: ~20 min
    python recipes/benchmarks/bench_bottleneck.py --preset gpu --device cuda
    python recipes/benchmarks/bench_bottleneck.py --preset tiny       # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics as pystats
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace

import torch
from transformers.utils import logging as transformers_logging


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from progressive_gpt2 import (  # noqa: E402
    CurvePoint, GrowthEvent, Run, Task, Variant, standard_variants, text_task, train_variant,
)

from bottleneck_tasks import plateau_task, retrieval_task  # noqa: E402
from hf_grow import GrownGPT2Config  # noqa: E402


#: Variants beyond the standard ones: (standard variant, options of `grow_in_training`), named after both.
#: ``step_scale``: the fraction of the line-searched step taken at each growth (issue #35: a step for the training
#: after); `grow_in_training` takes a tenth by default (`hf_grow.config.FOR_TRAINING`), the whole step with 1.0.
#: ``keep_attention_scale=False``: the change of attention scale folded into the queries at each growth (the
#: default keeps every layer's initial scale); ``cross_fit=False``: the solve from all of M, not from what the
#: statistics' two halves agree on (the default). Both False: the defaults until 2026-11-27.
OPTION_VARIANTS = [
    ("grown-refactor", {"new_moments": "head_mean"}),
    ("grown-append", {"new_moments": "head_mean"}),
    ("grown-refactor", {"step_scale": 1.0}),
    ("grown-refactor", {"step_scale": 0.25}),
    ("grown-refactor", {"cross_fit": False, "keep_attention_scale": False, "rtol": 1e-6}),
    ("grown-refactor", {"cross_fit": False}),
    ("grown-refactor", {"keep_attention_scale": False}),
    ("grown-append", {"cross_fit": False, "keep_attention_scale": False, "rtol": 1e-6}),
    ("zero", {"keep_attention_scale": False}),
    ("grown-refactor", {"rtol": 1e-6}),
    ("grown-append", {"rtol": 1e-6}),
    ("grown-append", {"rtol": 1e-3}),
]
PRESETS = {
    "cpu": dict(
        seeds=3,
        retrieval=dict(
            keys=32, values=8, pairs=16, n_embd=64, n_head=1, small=2, large=8, schedule={150: 8},
            steps=500, batch_size=64, eval_every=25, eval_batches=2, lr=3e-3, warmup=20,
        ),
        plateau=dict(
            keys=1024, values=16, pairs=32, queries=8, n_embd=64, n_inner=64, n_head=1, small=8, large=32,
            schedule={150: 16, 300: 24, 450: 32}, steps=800, batch_size=64, eval_every=25, eval_batches=2, lr=3e-3,
            warmup=50, statistics_batches=4, search_batches=4, option_variants=OPTION_VARIANTS,
        ),
        text=dict(
            n_embd=64, n_layer=2, n_head=4, seq_len=64, small=2, large=16, schedule={200: 16},
            steps=600, batch_size=16, eval_every=50, eval_batches=8, lr=3e-3, warmup=50,
            option_variants=OPTION_VARIANTS,
        ),
    ),
    "gpu": dict(
        seeds=5,
        retrieval=dict(
            keys=128, values=32, pairs=64, n_embd=256, n_head=4, small=4, large=32, schedule={500: 16, 1000: 32},
            steps=4000, batch_size=128, eval_every=100, eval_batches=4, lr=1e-3, warmup=100,
        ),
        plateau=dict(
            keys=4096, values=32, pairs=64, queries=16, n_embd=128, n_head=1, small=8, large=32,
            schedule={300: 16, 600: 24, 900: 32}, steps=2000, batch_size=128, eval_every=25, eval_batches=4, lr=2e-3,
            warmup=100, option_variants=OPTION_VARIANTS,
        ),
        text=dict(
            n_embd=256, n_layer=4, n_head=8, seq_len=256, small=4, large=32, schedule={1000: 16, 2000: 32},
            steps=6000, batch_size=32, eval_every=200, eval_batches=32, lr=1e-3, warmup=200,
            option_variants=OPTION_VARIANTS,
        ),
    ),
    "tiny": dict(
        seeds=2,
        retrieval=dict(
            keys=16, values=4, pairs=8, n_embd=32, n_head=1, small=2, large=8, schedule={20: 8},
            steps=60, batch_size=32, eval_every=20, eval_batches=1, lr=3e-3, warmup=5,
        ),
        plateau=dict(
            keys=64, values=4, pairs=8, queries=2, n_embd=32, n_head=1, small=4, large=8, schedule={10: 6, 20: 8},
            steps=40, batch_size=16, eval_every=10, eval_batches=1, lr=3e-3, warmup=5,
            option_variants=[("grown-append", {"new_moments": "head_mean"})],
        ),
        text=dict(
            n_embd=32, n_layer=1, n_head=2, seq_len=32, small=2, large=16, schedule={20: 16},
            steps=60, batch_size=8, eval_every=20, eval_batches=2, lr=3e-3, warmup=5,
        ),
    ),
}
TASKS = ("retrieval", "plateau", "text")
#: The widening baselines every variant is compared with: zero-initialised keys, small random new dims.
BASELINES = ("zero", "random")
#: Retrieval: the accuracy at which the task counts as learnt.
ACCURACY_TARGET = 0.99


def build_task(name: str, settings: dict) -> Task:
    if name == "plateau":
        keys = ("keys", "values", "pairs", "queries", "n_embd", "n_head", "batch_size", "eval_batches", "n_inner")
        return plateau_task(**{key: settings.get(key) for key in keys})
    if name == "retrieval":
        keys = ("keys", "values", "pairs", "n_embd", "n_head", "batch_size", "eval_batches")
        return retrieval_task(**{key: settings[key] for key in keys})
    config = GrownGPT2Config(
        vocab_size=256, n_positions=settings["seq_len"], n_embd=settings["n_embd"], n_layer=settings["n_layer"],
        n_head=settings["n_head"], bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return text_task(config, None, settings["seq_len"], settings["batch_size"], settings["eval_batches"])


def task_variants(settings: dict) -> list[Variant]:
    """The standard variants, then the preset's option variants (a standard one with options of its own)."""
    variants = standard_variants(settings["small"], settings["large"], settings["schedule"])
    by_name = {variant.name: variant for variant in variants}
    for base, options in settings.get("option_variants", []):
        label = ", ".join(f"{key}={value}" for key, value in options.items())
        variants.append(replace(by_name[base], name=f"{base} ({label})", options=dict(options)))
    return variants


def escape_loss(task: str, settings: dict) -> float | None:
    """The plateau task's escape threshold: half the plateau's loss log(values), between it and the solution."""
    return 0.5 * math.log(settings["values"]) if task == "plateau" else None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return pystats.fmean(values), (pystats.stdev(values) if len(values) > 1 else 0.0)


def fmt(values: Sequence[float], digits: int = 4) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def compare(a: Sequence[float], b: Sequence[float]) -> str:
    """'lower' / 'higher' / 'no difference' for mean(a) against mean(b), against the sum of their spreads."""
    (mean_a, std_a), (mean_b, std_b) = mean_std(a), mean_std(b)
    if abs(mean_a - mean_b) <= std_a + std_b:
        return "no difference"
    return "lower" if mean_a < mean_b else "higher"


def _steps_to_accuracy(run: Run) -> int | None:
    return next((point.step for point in run.curve if point.metrics.get("accuracy", 0.0) >= ACCURACY_TARGET), None)


def steps_to_escape(run: Run, threshold: float) -> int | None:
    """The first scheduled evaluation step whose held-out loss is below ``threshold`` (None: never)."""
    return next((point.step for point in run.curve if point.scheduled and point.eval_loss < threshold), None)


def _reached(steps: Sequence[int | None]) -> str:
    """Mean ± std of the runs that got there, with how many did."""
    got = [step for step in steps if step is not None]
    return f"{fmt(got, 0)} ({len(got)}/{len(steps)})" if got else f"never (0/{len(steps)})"


def summary(task: str, runs: dict[str, list[Run]], escape: float | None = None) -> str:
    """The task's table: one row per variant, mean ± std over seeds (without fixed-large, no steps to its loss)."""
    target = max(run.final_loss for run in runs["fixed-large"]) if "fixed-large" in runs else None
    has_accuracy = "accuracy" in next(iter(runs.values()))[0].curve[-1].metrics
    baselines = [name for name in BASELINES if name in runs]
    best_baseline = min((pystats.fmean(r.area_under_curve() for r in runs[name]) for name in baselines), default=None)
    header = ["variant", "final held-out loss"] + (["final accuracy"] if has_accuracy else []) + ["mean loss (AUC)"]
    header += ["AUC / best of zero, random"] if best_baseline else []
    header += [f"steps to escape (loss < {escape:.3f})"] if escape is not None else []
    header += [f"steps to {target:.4f}", "GFLOPs to it"] if target is not None else []
    header += [f"steps to {ACCURACY_TARGET:.0%} accuracy"] if has_accuracy else []
    header += ["loss before -> after growth"] + [f"final loss / AUC vs {baseline}" for baseline in baselines]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, variant_runs in runs.items():
        finals = [run.final_loss for run in variant_runs]
        areas = [run.area_under_curve() for run in variant_runs]
        growths = []
        for index in range(len(variant_runs[0].growths)):
            events = [run.growths[index] for run in variant_runs]
            growths.append(
                f"@{events[0].step}: {fmt([e.eval_loss_before for e in events], 3)} -> "
                f"{fmt([e.eval_loss_after for e in events], 3)}"
            )
        cells = [variant, fmt(finals)]
        if has_accuracy:
            cells.append(fmt([run.curve[-1].metrics["accuracy"] for run in variant_runs], 3))
        cells.append(fmt(areas))
        if best_baseline:
            cells.append(f"{pystats.fmean(areas) / best_baseline:.2f}")
        if escape is not None:
            cells.append(_reached([steps_to_escape(run, escape) for run in variant_runs]))
        if target is not None:
            reached = [(run.steps_to_reach(target), run.flops_to_reach(target)) for run in variant_runs]
            flops = [f / 1e9 for s, f in reached if s is not None]
            cells += [_reached([s for s, _ in reached]), fmt(flops, 2) if flops else "-"]
        if has_accuracy:
            cells.append(_reached([_steps_to_accuracy(run) for run in variant_runs]))
        cells.append("; ".join(growths) or "-")
        for baseline in baselines:
            others = runs[baseline]
            other_finals, other_areas = [r.final_loss for r in others], [r.area_under_curve() for r in others]
            cells.append(
                "-" if variant == baseline else f"{compare(finals, other_finals)} / {compare(areas, other_areas)}"
            )
        rows.append("| " + " | ".join(cells) + " |")
    return f"### {task}\n\n" + "\n".join(rows)


def plot(results: dict[str, dict[str, list[Run]]], path: str) -> bool:
    """Held-out loss against steps, mean ± std over seeds, one panel per task; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, panels = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for axes, (task, runs) in zip(panels[0], results.items()):
        for variant, variant_runs in runs.items():
            curves = [[point for point in run.curve if point.scheduled] for run in variant_runs]
            steps = [point.step for point in curves[0]]
            losses = torch.tensor([[point.eval_loss for point in curve] for curve in curves])
            mean, std = losses.mean(0), (losses.std(0) if len(curves) > 1 else torch.zeros(len(steps)))
            (line,) = axes.plot(steps, mean, label=variant)
            axes.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        for step in variant_runs[0].growths:
            axes.axvline(step.step, color="grey", linewidth=0.5, linestyle=":")
        axes.set_yscale("log")
        axes.set_xlabel("training step")
        axes.set_ylabel("held-out loss")
        axes.set_title(f"{task} (mean ± std over {len(variant_runs)} seeds)")
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def load_runs(path: str) -> tuple[dict, dict[str, dict[str, list[Run]]]]:
    """The settings and runs a bench_bottleneck JSON holds."""
    with open(path) as handle:
        saved = json.load(handle)
    results = {
        task: {
            variant: [
                Run(**{
                    **run,
                    "curve": [CurvePoint(**point) for point in run["curve"]],
                    "growths": [GrowthEvent(**event) for event in run["growths"]],
                })
                for run in variant_runs
            ]
            for variant, variant_runs in runs.items()
        }
        for task, runs in saved["results"].items()
    }
    return saved["settings"], results


def merge(paths: Sequence[str], output: str) -> None:
    """One table and one plot per task from runs of several parts (e.g. variants run side by side)."""
    settings: dict[str, dict] = {}
    results: dict[str, dict[str, list[Run]]] = {}
    for path in paths:
        part_settings, part = load_runs(path)
        settings.update(part_settings)
        for task, runs in part.items():
            for variant, variant_runs in runs.items():
                results.setdefault(task, {}).setdefault(variant, []).extend(variant_runs)
    order = {task: [variant.name for variant in task_variants(settings[task])] for task in results}
    for task, runs in results.items():
        runs = {name: runs[name] for name in order[task] if name in runs}
        results[task] = runs
        print("\n" + summary(task, runs, escape_loss(task, settings[task])), flush=True)
    if plot(results, f"{output}.png"):
        print(f"\nwrote {output}.png")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--tasks", nargs="*", choices=TASKS, default=list(TASKS))
    parser.add_argument("--seeds", type=int, help="override the preset's number of seeds")
    parser.add_argument("--steps", type=int,
                        help="override the preset's training steps (growth steps, warmup and evaluations scale along)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="bench_bottleneck", help="prefix of the .png and .json outputs")
    parser.add_argument("--variants", nargs="*", help="run only these variants (merge the parts with --merge)")
    parser.add_argument("--merge", nargs="*", metavar="JSON", help="print the tables of these runs' JSONs together")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.output)
        return
    preset = PRESETS[args.preset]
    seeds = args.seeds or preset["seeds"]
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    print(
        f"# bench_bottleneck  preset={args.preset}  seeds={seeds}  {datetime.date.today()}  torch {torch.__version__}  "
        f"threads {torch.get_num_threads()}  {platform.machine()}  device {args.device}"
    )
    results: dict[str, dict[str, list[Run]]] = {}
    used_settings: dict[str, dict] = {}
    for task_name in args.tasks:
        settings = dict(preset[task_name])
        if args.steps:
            scale = args.steps / settings["steps"]
            settings["schedule"] = {max(1, round(step * scale)): width for step, width in settings["schedule"].items()}
            settings["eval_every"] = max(1, round(settings["eval_every"] * scale))
            settings["warmup"] = max(1, round(settings["warmup"] * scale))
            settings["steps"] = args.steps
        used_settings[task_name] = settings
        task = build_task(task_name, settings)
        print(f"\n## {task_name}: {settings}", flush=True)
        runs: dict[str, list[Run]] = {}
        for variant in task_variants(settings):
            if args.variants and variant.name not in args.variants:
                continue
            for seed in range(seeds):
                run = train_variant(
                    variant, task, settings["steps"], settings["lr"], settings["warmup"], settings["eval_every"], seed,
                    statistics_batches=settings.get("statistics_batches", 8),
                    search_batches=settings.get("search_batches", 4), device=args.device, log=lambda message: None,
                )
                runs.setdefault(variant.name, []).append(run)
                accuracy = run.curve[-1].metrics.get("accuracy")
                print(
                    f"  {variant.name:38s} seed {seed}: final held-out loss {run.final_loss:.4f}"
                    + ("" if accuracy is None else f", accuracy {accuracy:.3f}")
                    + f"  ({run.seconds:.0f} s)",
                    flush=True,
                )
        results[task_name] = runs
        if runs:
            print("\n" + summary(task_name, runs, escape_loss(task_name, settings)), flush=True)
    with open(f"{args.output}.json", "w") as handle:
        serialized = {
            task: {v: [asdict(run) for run in rs] for v, rs in runs.items()} for task, runs in results.items()
        }
        json.dump(
            {"preset": args.preset, "seeds": seeds, "settings": used_settings, "results": serialized},
            handle,
            indent=1,
            default=str,
        )
    plotted = not args.variants and plot(results, f"{args.output}.png")
    written = [f"{args.output}.json"] + ([f"{args.output}.png"] if plotted else [])
    print(f"\nwrote {', '.join(written)}")


if __name__ == "__main__":
    main()
