"""Benchmark: the spectrum of C = Σ X'ᵀX' at the growth step of bench_growth_callback's models: how many of its
directions each tolerance ``rtol`` keeps, and how much of the inputs' variance the dropped ones hold (issue #35: C's
tolerance in growth during training)

The model is trained as bench_growth_callback trains it (the same preset, seed, batches and schedule) and stopped
at ``--grow-at``; C is then summed over ``--batches`` training batches of each layer's attention input (with the
ones column) by the growth's own `collect_statistics`, in float64. Per layer: the number of eigenvalues at or above
``rtol`` times the largest, the share of C's trace below it, and the largest eigenvalue over the mean (how
dominant the top direction is).

    python recipes/benchmarks/bench_input_spectrum.py --preset cpu
    python recipes/benchmarks/bench_input_spectrum.py --preset gpu --json runs/spectrum.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from transformers import PrinterCallback, Trainer, TrainerCallback

from hf_grow import GrownGPT2LMHeadModel
from hf_grow.adapters import get_adapter
from hf_grow.statistics import collect_statistics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_growth_callback import PRESETS, corpus, initial_model, training_arguments, training_windows  # noqa: E402
from grow_with_trainer import byte_windows  # noqa: E402

TOLERANCES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


class StopAt(TrainerCallback):
    """Ends training after ``step`` optimizer steps (the schedule stays that of the whole run)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def trained_to_growth(settings: dict, seed: int) -> GrownGPT2LMHeadModel:
    """bench_growth_callback's original arm, trained until the growth step."""
    train_files, _ = corpus()
    model = initial_model(settings, seed, settings["qk_dim"])
    with tempfile.TemporaryDirectory() as output_dir:
        args = training_arguments(settings, seed, output_dir, logging_steps=10**9)
        train = training_windows(settings, seed, train_files)
        trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[StopAt(settings["grow_at"])])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return model.eval()


def input_second_moments(model: GrownGPT2LMHeadModel, windows: list[dict], batch_size: int) -> list[torch.Tensor]:
    """C = Σ X'ᵀX' of every layer's attention input X' = [X | 1] over ``windows``, as the growth collects it
    (`collect_statistics`, float64 products)."""
    batches = [{key: torch.stack([w[key] for w in windows[start : start + batch_size]]) for key in windows[0]}
               for start in range(0, len(windows), batch_size)]
    statistics = collect_statistics(model, batches, get_adapter(model), compute_dtype=torch.float64)
    return [moment.cpu() for moment in statistics.second_moments]


def spectrum_rows(moments: list[torch.Tensor]) -> list[dict]:
    """Per layer: directions kept and trace share dropped at each tolerance, and the largest over the mean."""
    rows = []
    for layer, moment in enumerate(moments):
        eigenvalues = torch.linalg.eigvalsh(moment).flip(0).clamp_min(0)
        largest, total = eigenvalues[0].item(), eigenvalues.sum().item()
        row = {"layer": layer, "dim": len(eigenvalues), "largest_over_mean": largest * len(eigenvalues) / total}
        for rtol in TOLERANCES:
            kept = eigenvalues >= rtol * largest
            row[f"kept@{rtol:g}"] = int(kept.sum())
            row[f"dropped_trace@{rtol:g}"] = eigenvalues[~kept].sum().item() / total
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    header = " | ".join(f"kept @{rtol:g}" for rtol in TOLERANCES)
    dropped = " | ".join(f"trace dropped @{rtol:g}" for rtol in TOLERANCES)
    lines = [f"| layer | dims | {header} | {dropped} | largest / mean |", "|---" * (3 + 2 * len(TOLERANCES)) + "|"]
    for row in rows:
        kept = " | ".join(str(row[f"kept@{rtol:g}"]) for rtol in TOLERANCES)
        share = " | ".join(f"{100 * row[f'dropped_trace@{rtol:g}']:.2f}%" for rtol in TOLERANCES)
        lines.append(f"| {row['layer']} | {row['dim']} | {kept} | {share} | {row['largest_over_mean']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=8, help="training batches C is summed over")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is available")
    parser.add_argument("--json", default=None, help="write the rows here")
    for name, value in PRESETS["cpu"].items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    args = parser.parse_args()
    given = {name: value for name, value in vars(args).items() if name in PRESETS["cpu"] and value is not None}
    settings = {**PRESETS[args.preset], **given, "cpu": args.cpu}
    if not 0 < settings["grow_at"] <= settings["steps"]:
        parser.error(f"--grow-at {settings['grow_at']} must fall within the {settings['steps']} training steps")
    print(f"# bench_input_spectrum {' '.join(sys.argv[1:])}: {settings}", flush=True)
    model = trained_to_growth(settings, args.seed)
    train_files, _ = corpus()
    windows = byte_windows(train_files, args.batches * settings["batch_size"], settings["seq_len"], seed=7)
    rows = spectrum_rows(input_second_moments(model, windows, settings["batch_size"]))
    print(f"\nC's eigenvalues at step {settings['grow_at']} (seed {args.seed}, {args.batches} batches):\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(settings=settings, seed=args.seed, rows=rows), file, indent=1)


if __name__ == "__main__":
    main()
