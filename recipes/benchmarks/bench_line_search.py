"""Benchmark: the line search's cost (held-out passes, points) and what it chooses, on trained models.

bench_candidates' GPT-2s (BPE and byte vocabularies) and Llama (grouped-query attention, "append" growth), trained
``--steps`` steps on English prose of the standard library (cached under ``--cache``): statistics collected once
per model, then per split of the held-out pool (a third for the line search, the rest for the test) and per step
mode, one growth at p = 8. Each row gives the line search's points (held-out losses evaluated, step 0 included),
its cost in full held-out passes (`GrowthReport.line_search_passes`), the chosen step and the held-out and test
losses after. Run it on two versions of hf_grow (``PYTHONPATH``) to compare their searches point for point.

    python recipes/benchmarks/bench_line_search.py --cache runs/candidates      # ~5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys

import torch
from transformers.utils import logging as transformers_logging

import hf_grow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_candidates import english_setups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("bpe-en", "bytes-en", "llama-en"),
                        default=["bpe-en", "bytes-en", "llama-en"])
    parser.add_argument("--cache", help="folder of the trained models (reused when there)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--splits", type=int, default=3, help="ways of cutting each held-out pool")
    parser.add_argument("--step-modes", nargs="+", default=["global", "coordinate"])
    parser.add_argument("--p", type=int, default=8)
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    print(f"# bench_line_search {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; hf_grow from "
          f"{os.path.dirname(hf_grow.__file__)}; p {args.p}", flush=True)
    print(f"{'model':<10}{'split':>6} {'step mode':<11}{'points':>7}{'passes':>8}{'step':>11}"
          f"{'held-out before':>17}{'held-out after':>16}{'test after':>12}")
    for name, model, stats, pool, loss_fn in english_setups(args.models, False, args.cache, args.steps):
        statistics = hf_grow.collect_statistics(model, stats, hf_grow.get_adapter(model), loss_fn)
        for split in range(args.splits):
            order = list(range(len(pool)))
            random.Random(split).shuffle(order)
            cut = len(pool) // 3
            held_out, test = [pool[i] for i in order[:cut]], [pool[i] for i in order[cut:]]
            for step_mode in args.step_modes:
                grown = hf_grow.grow_model(model, None, p=args.p, statistics=statistics, eval_dataloader=held_out,
                                           loss_fn=loss_fn, step_mode=step_mode, measure_realized_gains=False)
                report = grown.growth_report
                test_loss = hf_grow.evaluate_loss(grown, test, loss_fn=loss_fn)[0]
                print(f"{name:<10}{split:>6} {step_mode:<11}{len(report.line_search):>7}"
                      f"{report.line_search_passes:>8.2f}{report.step_size:>11.5g}{report.eval_loss_before:>17.6f}"
                      f"{report.eval_loss_after:>16.6f}{test_loss:>12.6f}", flush=True)


if __name__ == "__main__":
    main()
