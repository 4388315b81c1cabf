"""Benchmark: the compact solve's one decomposition per head, per solver, on a trained GPT-2 with real statistics.

Trains a byte-level GPT-2 (by default one GPT-2-small-sized layer: n_embd 768, 12 heads of d_k 64) on the
standard library's sources, collects the statistics once, then runs `grow_model` (p = 8, exact line search)
with each solver. The solve decomposes each head's whitened direction once, to the compact rank s
(`hf_grow.compact.compact_rank`): ``eigh`` (full eigendecomposition of A A^T; what ``auto`` takes for
"refactor" growth), ``subspace`` (top s + 16 directions by subspace iteration from a random start) and ``svd``.
Prints the seconds of the solve and of the line search, the steps tried and chosen, and the held-out and test
losses: the solvers should choose the same step and reach the same loss.

    python recipes/benchmarks/bench_solver.py            # ~7 minutes on 2 CPU cores
    python recipes/benchmarks/bench_solver.py --n-embd 1024 --n-head 16 --steps 60   # GPT-2 medium's width
    python recipes/benchmarks/bench_solver.py --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings

import torch
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_growth import lm_batches, load_bytes, make_model, split_files, train  # noqa: E402

import hf_grow  # noqa: E402
from hf_grow.compact import compact_rank  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps before growth (0: random weights)")
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-layer", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    seq_len, batch_size = 128, 16
    files = split_files(0)
    data = {name: load_bytes(chosen) for name, chosen in files.items()}
    qk_dim = args.n_embd // args.n_head
    print(f"# bench_solver {datetime.date.today()} torch {torch.__version__} threads {torch.get_num_threads()} "
          f"{platform.processor() or platform.machine()} device {args.device}; GPT-2 n_embd {args.n_embd}, "
          f"{args.n_layer} layers x {args.n_head} heads (d_k {qk_dim}), {args.steps} steps; compact rank s = "
          f"{compact_rank(args.n_embd + 1, qk_dim + 8)} of {args.n_embd + 1}", flush=True)
    model = make_model(args.n_embd, args.n_layer, args.n_head, seq_len, seed=0)
    if args.steps > 0:  # 0: random weights, as in bench_cli_size
        train(model, data["train"], args.steps, batch_size, seq_len, seed=0)
    model.to(args.device)
    to_device = lambda batches: [{k: v.to(args.device) for k, v in b.items()} for b in batches]  # noqa: E731
    stats = to_device(lm_batches(data["stats"], 12, batch_size, seq_len, 1))
    eval_batches = to_device(lm_batches(data["eval"], 6, batch_size, seq_len, 2))
    test_batches = to_device(lm_batches(data["test"], 12, batch_size, seq_len, 3))
    statistics = hf_grow.collect_statistics(model, stats, hf_grow.get_adapter(model))
    test_before = hf_grow.evaluate_loss(model, test_batches)[0]
    print(f"{'solver':<9} {'solve s':>8} {'vs eigh':>8} {'search s':>9} {'points':>6} {'step':>9} "
          f"{'held-out after':>15} {'test decrease':>13}")
    seconds = {}
    for solver in ("eigh", "subspace", "svd"):
        grown = hf_grow.grow_model(model, None, p=8, statistics=statistics, eval_dataloader=eval_batches, solver=solver,
                                   measure_realized_gains=False, progress=False)
        report = grown.growth_report
        seconds[solver] = report.seconds["solve"]
        test_after = hf_grow.evaluate_loss(grown, test_batches)[0]
        print(f"{report.solver:<9} {seconds[solver]:>8.2f} {seconds['eigh'] / seconds[solver]:>7.2f}x "
              f"{report.seconds['line_search']:>9.2f} {len(report.line_search):>6} {report.step_size:>9.4g} "
              f"{report.eval_loss_after:>15.6f} {test_before - test_after:>13.6f}", flush=True)


if __name__ == "__main__":
    main()
