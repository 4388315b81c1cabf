"""Benchmark: `GrowthCallback` inside `transformers.Trainer` pretraining: is the grown model ever behind the original?
(issue #35: the callback measured itself, not through `grow_in_training`, and on a model larger than
bench_bottleneck's)

A byte-level GPT-2 (no tokenizer, no network) is trained from scratch by `transformers.Trainer` on the standard
library's sources (every other top-level module), with AdamW (β₂ ``--adam-beta2``: 0.95 as GPT pretraining usually
takes, where the Trainer's default is 0.999), a cosine schedule after a warm-up, and its held-out loss evaluated
every ``--eval-every`` steps on fixed windows of other modules. Arms (``--arms``):

- ``original``: no growth, the old query/key width throughout;
- ``default``: `GrowthCallback`'s defaults (mode "append", steps per head, a tenth of the searched step, M
  cross-fitted, each layer's old attention scale kept, C's eigenvalues below 1e-5 of the largest dropped);
- ``append-rtol-1e-3``: the defaults with C's tolerance 1e-3 (the defaults from the evening of 2026-11-27 until
  2026-11-28);
- ``refactor``: ``append-rtol-1e-3`` in mode "refactor"; ``refactor-rtol-1e-6``: with C's tolerance 1e-6 (the
  defaults from the morning of 2026-11-27 until the evening: mode "refactor", ``rtol=1e-6``);
- ``previous-default``: the defaults before those of 2026-11-27: refactor, no cross-fitting, the change of
  attention scale folded into the queries, C's tolerance 1e-6 (``cross_fit=False, keep_attention_scale=False``);
- ``whole``: ``previous-default`` with the whole searched step (``step_scale=1.0``);
- ``keep``: ``previous-default`` with the scale kept (``keep_attention_scale=True``);
- ``zero``, ``zero-keep``: `GrowthCallback(mode="zero")` at ``--grow-at`` (the same function, new dims at zero),
  the scale folded into the queries, or kept (zero widening's default);
- ``wide``: trained at the grown width from the start (a reference; its initialisation differs);
- ``restart``: no growth, but at ``--grow-at`` the Q/K entries' optimizer moments restart at zero, as growth in
  mode "refactor" restarts them (a diagnostic: what the restart alone does);
- ``append-query-init``: the defaults with C's tolerance 1e-6 (as measured), then each head's
  new query dims scaled to the norm of a random initialisation and its new key dims by the inverse (the same
  function; a diagnostic of the balanced split of the new dims);
- ``name={json}``: `GrowthCallback` with these keyword arguments, e.g. ``'step0={"step_size": 0.0}'`` (refactored
  at step 0: the old function, its Q/K and their optimizer moments made anew) or ``'append={"mode": "append"}'``;
  one more key is the benchmark's own: ``"new_dims_lr": f`` trains the new dims after the growth at f times the
  learning rate (a diagnostic; modes "append" and "zero", whose new dims are the last p of each head).

``--probe`` measures, for 150 steps after the growth, the optimizer's updates of the old and new Q/K dims and the
rate at which the new dims' scores change (callback_diagnostics.UpdateProbe; the losses are unchanged).

Every arm of a seed starts from the same initialisation and sees the same batches in the same order (the
Trainer's seed; the callback draws its own batches from a generator of its own). Differences to the original are
paired by seed: mean ± standard deviation over seeds, and the number of seeds behind. One CPU thread per run is
deterministic (a rerun gives the same losses to the last digit, so arms of separate runs pair by seed); on a GPU
runs are not (arms of one seed differ by ~0.007 nats before the growth on the gpu preset): compare arms run
together. ``--parallel`` runs the seeds in as many processes (on a GPU, a small model leaves most of it idle).

    python recipes/benchmarks/bench_growth_callback.py --preset cpu
    python recipes/benchmarks/bench_growth_callback.py --preset gpu --parallel 3 --json runs/callback.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import statistics as pystats
import sys
import tempfile
import time

import torch
from transformers import PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as transformers_logging

import hf_grow
from hf_grow import GrowthCallback, GrownGPT2Config, GrownGPT2LMHeadModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from callback_diagnostics import MomentRestart, NewDimsLR, QueryInitSplit, UpdateProbe  # noqa: E402
from grow_with_trainer import byte_windows  # noqa: E402
from sentence_pairs import stdlib_files  # noqa: E402

PRESETS = {
    "cpu": dict(n_embd=128, n_layer=2, n_head=4, qk_dim=8, p=8, seq_len=128, batch_size=16, steps=300,
                grow_at=100, eval_every=25, eval_windows=64, lr=3e-3, adam_beta2=0.95),
    "gpu": dict(n_embd=512, n_layer=8, n_head=8, qk_dim=16, p=16, seq_len=256, batch_size=32, steps=1000,
                grow_at=300, eval_every=50, eval_windows=256, lr=1e-3, adam_beta2=0.95),
}
#: The named arms' `GrowthCallback` options (None: no callback).
#: Every arm but ``default`` names the options it was measured with, so that it keeps its meaning when defaults change.
FOLDED = dict(mode="refactor", cross_fit=False, keep_attention_scale=False, rtol=1e-6)
ARMS = {"original": None, "wide": None, "restart": None, "default": {}, "previous-default": FOLDED,
        "append-rtol-1e-3": dict(mode="append", rtol=1e-3),
        "refactor": dict(mode="refactor", rtol=1e-3), "refactor-rtol-1e-6": dict(mode="refactor", rtol=1e-6),
        "whole": dict(FOLDED, step_scale=1.0),
        "keep": dict(FOLDED, keep_attention_scale=True),
        "zero": dict(mode="zero", keep_attention_scale=False),
        "zero-keep": dict(mode="zero", keep_attention_scale=True),
        "append-query-init": dict(mode="append", rtol=1e-6)}


def parse_arm(text: str) -> tuple[str, dict | None]:
    """An ``--arms`` entry as (name, `GrowthCallback` options): a named arm, or ``name={json}``."""
    if text in ARMS:
        return text, ARMS[text]
    name, brace, options = text.partition("={")
    if not brace:
        raise argparse.ArgumentTypeError(f"an arm is one of {sorted(ARMS)} or name={{json options}}, got {text!r}")
    return name, json.loads(brace[1:] + options)


def corpus() -> tuple[list[str], list[str]]:
    """The standard library's top-level modules: every other one to train on, every eighth of the rest held out
    (grow_with_trainer.py's split)."""
    files = stdlib_files()
    return files[0::2], files[1::8]


def initial_model(settings: dict, seed: int, qk_dim: int) -> GrownGPT2LMHeadModel:
    """The byte-level GPT-2 every arm of ``seed`` starts from (Q/K width ``qk_dim``, no dropout)."""
    config = GrownGPT2Config(
        vocab_size=256, n_positions=settings["seq_len"], n_embd=settings["n_embd"], n_layer=settings["n_layer"],
        n_head=settings["n_head"], qk_head_dims=[qk_dim] * settings["n_layer"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,  # within the 256 bytes
    )
    torch.manual_seed(seed)
    return GrownGPT2LMHeadModel(config)


def training_arguments(settings: dict, seed: int, output_dir: str, **evaluation) -> TrainingArguments:
    """The Trainer's optimizer, schedule and seeds for every arm; ``evaluation``: its evaluation and logging."""
    cuda = torch.cuda.is_available() and not settings["cpu"]
    return TrainingArguments(
        output_dir=output_dir, max_steps=settings["steps"], per_device_train_batch_size=settings["batch_size"],
        learning_rate=settings["lr"], weight_decay=0.01, adam_beta2=settings["adam_beta2"], max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=settings["steps"] // 20, save_strategy="no", report_to=[],
        use_cpu=not cuda, bf16=cuda, seed=seed, data_seed=seed, disable_tqdm=True, **evaluation,
    )


def training_windows(settings: dict, seed: int, train_files: list[str]) -> list[dict[str, torch.Tensor]]:
    """The training set of ``seed``: one batch of windows per step, the same for every arm."""
    return byte_windows(train_files, settings["steps"] * settings["batch_size"], settings["seq_len"], seed=1000 + seed)


def run_arm(arm: str, options: dict | None, seed: int, settings: dict) -> dict:
    """Train one arm from scratch (with `GrowthCallback(**options)` unless None); its held-out loss at each
    evaluation, its growth and its time."""
    train_files, held_out_files = corpus()
    model = initial_model(settings, seed, settings["qk_dim"] + (settings["p"] if arm == "wide" else 0))
    with tempfile.TemporaryDirectory() as output_dir:
        args = training_arguments(
            settings, seed, output_dir, per_device_eval_batch_size=settings["batch_size"], eval_strategy="steps",
            eval_steps=settings["eval_every"], logging_steps=settings["eval_every"],
        )
        train = training_windows(settings, seed, train_files)
        held_out = byte_windows(held_out_files, settings["eval_windows"], settings["seq_len"], seed=1)
        trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out)
        trainer.remove_callback(PrinterCallback)  # the losses are the table's
        growth = probe = None
        if arm == "restart":
            trainer.add_callback(MomentRestart(settings["grow_at"]))
        if options is not None:
            options = dict(options)
            new_dims_lr = options.pop("new_dims_lr", None)
            growth = GrowthCallback({settings["grow_at"]: settings["p"]}, seed=seed, trainer=trainer, **options)
            trainer.add_callback(growth)
            if new_dims_lr is not None:
                trainer.add_callback(NewDimsLR(settings["grow_at"], settings["p"], new_dims_lr))
            if settings.get("probe"):  # after NewDimsLR: it measures the updates as applied
                probe = UpdateProbe(settings["grow_at"], settings["p"])
                trainer.add_callback(probe)
        if arm == "append-query-init":  # after the growth's callback: the new dims it wrote
            trainer.add_callback(QueryInitSplit(settings["grow_at"], settings["p"], model.config.initializer_range))
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    losses = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    result = dict(arm=arm, seed=seed, losses=losses, seconds=seconds, qk_head_dims=list(model.config.qk_head_dims))
    if probe is not None:
        result["probe"] = probe.summary()
    report = None if growth is None else growth.reports.get(settings["grow_at"])
    if report is not None:
        result.update(step_size=report.step_size, growth_loss=[report.eval_loss_before, report.eval_loss_after],
                      growth_seconds=report.seconds.get("total"))
    return result


def run_seed(seed: int, settings: dict) -> list[dict]:
    """Every arm of one seed, in order (one process)."""
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(settings["threads"])
    results = []
    for arm, options in settings["arms"].items():
        try:
            results.append(run_arm(arm, options, seed, settings))
        except Exception as error:  # the other arms still run; the error is printed with the results
            print(f"seed {seed} {arm}: {type(error).__name__}: {error}", flush=True)
            continue
        print(json.dumps(results[-1]), flush=True)  # a run cut short keeps what it finished
    return results


def paired(results: list[dict], arm: str, step: int) -> list[float]:
    """Per seed, the arm's held-out loss at ``step`` minus the original's."""
    original = {r["seed"]: r["losses"][step] for r in results if r["arm"] == "original"}
    return [r["losses"][step] - original[r["seed"]] for r in results if r["arm"] == arm and r["seed"] in original]


def spread(values: list[float], digits: int = 4) -> str:
    std = pystats.stdev(values) if len(values) > 1 else 0.0
    return f"{pystats.fmean(values):+.{digits}f} ± {std:.{digits}f}"


def probe_table(results: list[dict], arms: list[str]) -> str:
    """UpdateProbe's measures per arm and window of steps after the growth, mean over seeds."""
    runs = {arm: [r["probe"] for r in results if r["arm"] == arm and "probe" in r] for arm in arms}
    windows = list(next(iter(runs.values()))[0])
    measures = list(next(iter(runs.values()))[0][windows[0]])
    lines = ["Updates after the growth (UpdateProbe; mean over layers, steps of the window and seeds):", "",
             "| arm | steps | " + " | ".join(measures) + " |", "|---" * (len(measures) + 2) + "|"]
    for arm, probes in runs.items():
        for window in windows:
            cells = [f"{pystats.fmean(probe[window][name] for probe in probes):.3g}" for name in measures]
            lines.append(f"| {arm} | {window} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[dict], settings: dict) -> str:
    """Held-out loss per arm (mean over seeds) at each evaluation, then each arm's paired difference to the
    original, with the seeds behind it; the growth's step and held-out losses."""
    arms = [arm for arm in settings["arms"] if any(r["arm"] == arm for r in results)]
    steps = sorted(next(iter(results))["losses"])
    shown = [step for step in steps if step >= settings["grow_at"]][:: max(1, len(steps) // 8)] + [steps[-1]]
    shown = sorted(set(shown))
    lines = ["| arm | " + " | ".join(f"loss @{step}" for step in shown) + " | mean loss after growth | seconds |",
             "|---" * (len(shown) + 3) + "|"]
    after = [step for step in steps if step >= settings["grow_at"]]
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm]
        cells = [f"{pystats.fmean(r['losses'][step] for r in runs):.4f}" for step in shown]
        area = pystats.fmean(pystats.fmean(r["losses"][step] for step in after) for r in runs)
        seconds = pystats.fmean(r["seconds"] for r in runs)
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {area:.4f} | {seconds:.0f} |")
    paired_arms = [arm for arm in arms if arm != "original"] if "original" in arms else []
    if paired_arms:
        columns = " | ".join(f"@{step}" for step in shown)
        lines += ["", "Paired by seed, minus the original (seeds behind / seeds):", "",
                  f"| arm | {columns} | mean after growth | largest excess (step) |", "|---" * (len(shown) + 3) + "|"]
    for arm in paired_arms:
        cells = []
        for step in shown:
            differences = paired(results, arm, step)
            cells.append(f"{spread(differences)} ({sum(d > 0 for d in differences)}/{len(differences)})")
        means = [pystats.fmean(paired(results, arm, step)) for step in after]
        areas = [pystats.fmean(values) for values in zip(*(paired(results, arm, step) for step in after))]
        worst = max(range(len(after)), key=lambda index: means[index])
        cells += [spread(areas), f"{means[worst]:+.4f} (@{after[worst]})"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    probed = [arm for arm in arms if any("probe" in r for r in results if r["arm"] == arm)]
    if probed:
        lines += ["", probe_table(results, probed)]
    growths = [r for r in results if "step_size" in r]
    if growths:
        lines += ["", "| arm | seed | step | growth's held-out loss before -> after | growth seconds |",
                  "|---|---|---|---|---|"]
        for r in growths:
            before, after_loss = r["growth_loss"]
            lines.append(f"| {r['arm']} | {r['seed']} | {r['step_size']:.4g} | {before:.4f} -> {after_loss:.4f} | "
                         f"{r['growth_seconds'] or 0:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="cpu")
    default_arms = [parse_arm(arm) for arm in ("original", "zero-keep", "default", "previous-default")]
    parser.add_argument("--arms", nargs="+", type=parse_arm, default=default_arms,
                        help=f"{', '.join(ARMS)} or name={{json GrowthCallback options}}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="run seeds from this one (more seeds for an earlier run: one thread per run is "
                        "deterministic)")
    parser.add_argument("--parallel", type=int, default=1, help="processes, each running whole seeds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is available")
    parser.add_argument("--json", default=None, help="write every run's losses here")
    parser.add_argument("--probe", action="store_true",
                        help="measure the Q/K updates after the growth (UpdateProbe; printed, and in --json)")
    for name, value in PRESETS["cpu"].items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    args = parser.parse_args()
    given = {name: value for name, value in vars(args).items() if name in PRESETS["cpu"] and value is not None}
    settings = {**PRESETS[args.preset], **given}
    settings.update(arms=dict(args.arms), threads=args.threads, cpu=args.cpu, probe=args.probe)
    if not 0 < settings["grow_at"] < settings["steps"]:
        parser.error("--grow-at must fall within the training steps")
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"# bench_growth_callback {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, "
          f"torch {torch.__version__}, hf_grow {hf_grow.__version__}, Python {platform.python_version()}")
    print(f"# {' '.join(sys.argv[1:])}: {settings}", flush=True)
    started = time.perf_counter()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.parallel > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.parallel, mp_context=context) as pool:
            results = [r for part in pool.map(run_seed, seeds, [settings] * len(seeds)) for r in part]
    else:
        results = [r for seed in seeds for r in run_seed(seed, settings)]
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(settings=settings, results=results), file, indent=1)
    print(f"\n{table(results, settings)}\n\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
