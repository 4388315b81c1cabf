"""Benchmark: the line search's cost (held-out passes, points) and what it chooses, on trained models.

bench_candidates' GPT-2s (BPE and byte vocabularies) and Llama (grouped-query attention, "append" growth), trained
``--steps`` steps on English prose of the standard library (cached under ``--cache``): statistics collected once
per model, then per split of the held-out pool (a third for the line search, the rest for the test) and per step
mode, one growth at p = 8. Each row gives the line search's points (held-out losses evaluated, step 0 included),
its cost in full held-out passes (`GrowthReport.line_search_passes`; and every held-out forward counted, step 0
included, divided by the held-out batches), the chosen step, the held-out and test losses after, the test
decrease and, for "auto" options, the candidate kept and how. Run it on two versions of hf_grow (``PYTHONPATH``)
to compare their searches point for point.

    python recipes/benchmarks/bench_line_search.py --cache runs/candidates      # ~5 minutes on 2 CPU cores
    python recipes/benchmarks/bench_line_search.py --cache runs/candidates --step-modes per_head auto

A step mode ``auto`` means ``truncation="auto", step_mode="auto"``; ``frobenius/per_layer`` sets both options.
``--trace FILE`` writes every line search's points (each candidate's too) as JSON lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
from transformers.utils import logging as transformers_logging

import hf_grow
from hf_grow.growth import candidates, layer_steps, line_search

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_candidates import english_setups  # noqa: E402
from bench_step_modes import line_search_and_test  # noqa: E402


def settings_of(name: str) -> dict[str, str]:
    """Growth options of a ``--step-modes`` entry: a step mode, ``auto`` (both options auto), or ``TRUNCATION/MODE``."""
    if name == "auto":
        return {"truncation": "auto", "step_mode": "auto"}
    if "/" in name:
        truncation, step_mode = name.split("/")
        return {"truncation": truncation, "step_mode": step_mode}
    return {"step_mode": name}


class HeldOutForwards:
    """Counts the held-out forwards (`compute_loss` calls of the line search and of the passes per layer) and
    records every line search's points."""

    def __init__(self) -> None:
        self.calls, self.searches = 0, []
        for module in (line_search, layer_steps):
            module.compute_loss = self.counted(module.compute_loss)
        searched = candidates.search.line_search

        def traced(prepared, problem, target, eval_batches, **kwargs):
            outcome = searched(prepared, problem, target, eval_batches, **kwargs)
            self.searches.append({
                "truncation": problem.truncation, "step_mode": problem.step_mode, "batches": len(eval_batches),
                "near": kwargs.get("near"), "step": outcome.step_size, "loss": outcome.loss_after,
                "points": [(point.step_size, point.loss) for point in outcome.points],
            })
            return outcome

        candidates.search.line_search = traced

    def counted(self, compute_loss):
        def run(*args, **kwargs):
            self.calls += 1
            return compute_loss(*args, **kwargs)

        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("bpe-en", "bytes-en", "llama-en"),
                        default=["bpe-en", "bytes-en", "llama-en"])
    parser.add_argument("--cache", help="folder of the trained models (reused when there)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--splits", type=int, default=3, help="ways of cutting each held-out pool")
    parser.add_argument("--step-modes", nargs="+", default=["global", "coordinate"])
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--trace", help="write every line search's points here (JSON lines)")
    args = parser.parse_args()
    forwards = HeldOutForwards()
    transformers_logging.set_verbosity_error()
    print(f"# bench_line_search {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; hf_grow from "
          f"{os.path.dirname(hf_grow.__file__)}; p {args.p}", flush=True)
    print(f"{'model':<10}{'split':>6} {'step mode':<11}{'points':>7}{'passes':>8}{'step':>11}"
          f"{'held-out before':>17}{'held-out after':>16}{'test after':>12}{'forwards':>9}{'test decrease':>14}  kept")
    for name, model, stats, pool, loss_fn in english_setups(args.models, False, args.cache, args.steps):
        statistics = hf_grow.collect_statistics(model, stats, hf_grow.get_adapter(model), loss_fn)
        for split in range(args.splits):
            held_out, test = line_search_and_test(pool, split)
            test_before = hf_grow.evaluate_loss(model, test, loss_fn=loss_fn)[0]
            for step_mode in args.step_modes:
                forwards.calls, forwards.searches = 0, []
                grown = hf_grow.grow_model(model, None, p=args.p, statistics=statistics, eval_dataloader=held_out,
                                           loss_fn=loss_fn, measure_realized_gains=False, **settings_of(step_mode))
                passes = forwards.calls / len(held_out)
                report = grown.growth_report
                test_loss = hf_grow.evaluate_loss(grown, test, loss_fn=loss_fn)[0]
                kept = f"{report.truncation}/{report.step_mode} ({report.selection})" if report.selection else ""
                print(f"{name:<10}{split:>6} {step_mode:<11}{len(report.line_search):>7}"
                      f"{report.line_search_passes:>8.2f}{report.step_size:>11.5g}{report.eval_loss_before:>17.6f}"
                      f"{report.eval_loss_after:>16.6f}{test_loss:>12.6f}{passes:>9.2f}"
                      f"{test_before - test_loss:>14.6f}  {kept}", flush=True)
                if args.trace:
                    with open(args.trace, "a") as trace:
                        trace.write(json.dumps({
                            "model": name, "split": split, "setting": step_mode, "searches": forwards.searches,
                            "candidates": [vars(candidate) for candidate in report.candidates],
                        }) + "\n")


if __name__ == "__main__":
    main()
