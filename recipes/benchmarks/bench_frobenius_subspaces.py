"""Benchmark: Frobenius truncation taken on the whitened solve's subspaces, against the exact Frobenius truncation.

Since one compact solve serves both truncations (`hf_grow.compact`), Frobenius truncation (the original notes'
plain norm of Z) is the best plain-norm truncation of ``Z - lam P`` restricted to the subspaces the whitened
solve keeps. This script measures what that restriction changes, per model and held-out/test split, at p = 8:
the step that `grow_model(truncation="frobenius", step_mode=...)` line-searches, then at that step the exact
Frobenius truncation of the full d x d target (`linalg.truncate`, every head) against the library's:

- ``change apart``: ``||Z_lib - Z_exact|| / ||Z_exact - Z||`` per head (the two truncations' changes of Z, how
  far apart), median and largest over heads;
- ``excess error``: ``||T - Z_lib|| / ||T - Z_exact|| - 1``, the library's plain-norm error above the optimum;
- ``certificate``: the library's reported bound on the plain-norm perturbation over sigma_r (median over heads);
- the test-loss decrease of both weight sets at that step.

Models: all-MiniLM-L6-v2 on its contrastive loss (``minilm``, d = 385) and bench_candidates' GPT-2s trained on
English text (``bytes-en``, ``bpe-en``, d = 129; ``--cache`` as bench_candidates').

    python recipes/benchmarks/bench_frobenius_subspaces.py --models minilm bpe-en --cache runs/candidates
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings

import torch
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import hf_grow  # noqa: E402
from bench_step_modes import line_search_and_test  # noqa: E402
from hf_grow import linalg  # noqa: E402
from hf_grow.growth import GrowthProblem, write_weights  # noqa: E402


def exact_weights(model, statistics, problem, step_size):
    """Every layer's exact Frobenius truncation of the full Z - lam P at ``step_size``, and per head how far its
    change is from the library's, and the library's excess plain-norm error."""
    weights, apart, excess, certificate = {}, [], [], []
    for layer, part in enumerate(problem.layers):
        inputs = part.query.shape[-2]
        direction = linalg.solve_direction(statistics.mean_gradient(layer)[:, :inputs, :inputs], part.metric)
        lams = problem.head_lams(step_size, layer)
        full = part.bilinear - lams[:, None, None] * direction
        exact = linalg.truncate(full, part.qk_dim_after, None)
        decomposition = problem.decomposition(layer, step_size, "frobenius", part.qk_dim_after)
        ours = part.target.to_model(decomposition.truncate(part.qk_dim_after))
        norm = lambda matrix: matrix.norm(dim=(-2, -1))  # noqa: E731
        apart.append(norm(ours.product - exact.product) / norm(exact.product - part.bilinear))
        excess.append(norm(full - ours.product) / norm(full - exact.product) - 1)
        certificate.append(part.target.relative_perturbation(
            lams, decomposition.singular_values, part.qk_dim_after, "frobenius"))
        root = part.scaling_after**0.5
        weights[layer] = (exact.left / root, exact.right / root)
    return weights, *(torch.cat(values) for values in (apart, excess, certificate))


def run(name, model, stats_batches, pool, loss_fn, splits, p, step_mode) -> list[dict]:
    """One row per held-out/test split (each also printed as a JSON line as it is measured)."""
    rows = []
    adapter = hf_grow.get_adapter(model)
    statistics = hf_grow.collect_statistics(model, stats_batches, adapter, loss_fn)
    for split in range(splits):
        eval_batches, test_batches = line_search_and_test(pool, split)
        before = hf_grow.evaluate_loss(model, test_batches, loss_fn=loss_fn)[0]
        config = hf_grow.GrowthConfig(p=p, truncation="frobenius", step_mode=step_mode)
        grown = hf_grow.grow_model(model, None, config=config, statistics=statistics, eval_dataloader=eval_batches,
                                   loss_fn=loss_fn, measure_realized_gains=False)
        step = grown.growth_report.step_size
        ours = before - hf_grow.evaluate_loss(grown, test_batches, loss_fn=loss_fn)[0]
        widths = [dim + p for dim in adapter.qk_head_dims(model.config)]
        problem = GrowthProblem(model, adapter, statistics, widths, "frobenius", config.rtol, config.solver,
                                step_mode=step_mode)
        weights, apart, excess, certificate = exact_weights(model, statistics, problem, step)
        write_weights(adapter, grown, weights)
        exact = before - hf_grow.evaluate_loss(grown, test_batches, loss_fn=loss_fn)[0]
        row = dict(model=name, split=split, step_mode=step_mode, step=step, ours=ours, exact=exact,
                   apart_median=float(apart.median()), apart_max=float(apart.max()),
                   excess_median=float(excess.median()), excess_max=float(excess.max()),
                   certificate_median=float(certificate.median()))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as BENCHMARKS' table: the library's Frobenius truncation on the whitened subspaces against the
    exact one of the full target, at the step the library searched."""
    lines = ["| model | split | step mode | step | changes apart (median / max) | excess error (median / max) "
             "| certificate (median) | test decrease, library / exact |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['split']} | {r['step_mode']} | {r['step']:.4g} | {r['apart_median']:.1%} / "
              f"{r['apart_max']:.1%} | {r['excess_median']:.2%} / {r['excess_max']:.2%} | "
              f"{r['certificate_median']:.2f} | {r['ours']:.5f} / {r['exact']:.5f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("minilm", "bytes-en", "bpe-en"), default=("minilm",))
    parser.add_argument("--step-modes", nargs="+", default=("per_head", "per_layer"))
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    print(f"# bench_frobenius_subspaces {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s); p = {args.p}", flush=True)
    rows = []
    for model_name in args.models:
        if model_name == "minilm":
            from bench_step_modes import minilm_setup
            setups = minilm_setup(False)
        else:
            from bench_candidates import english_setups
            setups = english_setups([model_name], False, args.cache, 300)
        for setup in setups:
            for step_mode in args.step_modes:
                rows += run(*setup, args.splits, args.p, step_mode)
    print(table(rows))


if __name__ == "__main__":
    main()
