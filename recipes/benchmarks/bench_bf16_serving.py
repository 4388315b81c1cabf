"""Benchmark: what growth costs a model served in bfloat16, and where the cost comes from.

bench_train_after_growth_lm's English GPT-2s (``bpe-en``: a 2,048-token BPE; ``bytes-en``; 128 x 4 layers x 8 heads,
trained ``--train-steps`` on English prose of the standard library, cached under ``--cache``) are grown at p = 8 by
each arm, from statistics on that benchmark's statistics text with the step searched on its line-search text. Per
arm, one-shot (no training after): the chosen step, the test loss, the bfloat16 model's logits against the float32
model's (largest and mean absolute difference over ``--test-batches`` test batches), the same with only the Q/K
weights rounded to bfloat16 (the rest of the model in float32), and each layer's Q/K weight norms against the
original's (||W_Q|| / ||W_Q,original||, the bias row included, and the same for W_K).

Arms (``--arms``, as bench_train_after_growth's): ``zero`` (step 0: the function kept), ``default``, and growth
options as ``name={json}``; an arm's ``"rotate": "dct"`` multiplies each layer's grown Q/K factors by one
orthogonal matrix (the same scores, Z split into other columns than its singular directions).

    python recipes/benchmarks/bench_bf16_serving.py --cache runs/candidates      # both models, ~8 min on 2 cores
    python recipes/benchmarks/bench_bf16_serving.py --quick                     # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import sys

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from bench_candidates import BATCH_SIZE, SEQ_LEN, english_documents, english_model, english_streams
from bench_train_after_growth import grow, parse_arm
from bench_train_after_growth_lm import bfloat16_errors, split_documents, windows

import hf_grow

ARMS = ["zero", "default", 'x0.25={"step_scale": 0.25}', 'rtol1e-3={"rtol": 1e-3}', 'rtol1e-2={"rtol": 1e-2}',
        'frobenius={"truncation": "frobenius"}', 'dct={"rotate": "dct"}', 'append={"mode": "append"}']


def qk_rounding_error(model: PreTrainedModel, batches: list[dict]) -> float:
    """The mean absolute logits difference when only the Q/K weights are rounded to bfloat16."""
    rounded = copy.deepcopy(model)
    adapter = hf_grow.get_adapter(rounded)
    for attention in adapter.attention_modules(rounded):
        query, key = adapter.read_qk(attention)
        adapter.write_qk(attention, query.to(torch.bfloat16).double(), key.to(torch.bfloat16).double())
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            logits = model.eval()(input_ids=batch["input_ids"]).logits
            total += float((logits - rounded.eval()(input_ids=batch["input_ids"]).logits).abs().mean())
    return total / len(batches)


def qk_norms(model: PreTrainedModel) -> list[tuple[float, float]]:
    """Each layer's (||W_Q||, ||W_K||), augmented (the bias row included)."""
    adapter = hf_grow.get_adapter(model)
    return [tuple(float(weight.norm()) for weight in adapter.read_qk(attention))
            for attention in adapter.attention_modules(model)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("bpe-en", "bytes-en"), default=["bpe-en", "bytes-en"])
    parser.add_argument("--arms", nargs="+", default=ARMS)
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--statistics-batches", type=int, default=20)
    parser.add_argument("--search-batches", type=int, default=8)
    parser.add_argument("--test-batches", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=300, help="the models' own training")
    parser.add_argument("--cache", default=None, help="folder for the trained models (reused when there)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="bytes-en trained 40 steps, few batches and arms")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(models=["bytes-en"], train_steps=40, statistics_batches=2, search_batches=2,
                            test_batches=1, arms=["zero", "default", 'dct={"rotate": "dct"}'])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    documents = split_documents(english_documents())
    counts = {"statistics": args.statistics_batches, "search": args.search_batches, "test": args.test_batches}
    for model_name in args.models:
        streams, size = english_streams("bpe" if model_name == "bpe-en" else "bytes", documents)
        model = english_model(model_name, streams["train"], size, args.train_steps, args.cache).eval()
        batches = {text: windows(streams[text], count, BATCH_SIZE, SEQ_LEN) for text, count in counts.items()}
        statistics = hf_grow.collect_statistics(model, batches["statistics"], hf_grow.get_adapter(model))
        original_norms = qk_norms(model)
        test_loss = hf_grow.evaluate_loss(model, batches["test"])[0]
        largest, mean = bfloat16_errors(model, batches["test"])
        rows = [f"| original | – | {test_loss:.4f} | {largest:.3f} | {mean:.5f} | "
                f"{qk_rounding_error(model, batches['test']):.5f} | – |"]
        for arm in args.arms:
            name, options = parse_arm(arm)
            grown = grow(model, options, batches["statistics"], batches["search"], statistics, args.p)
            largest, mean = bfloat16_errors(grown, batches["test"])
            ratios = "  ".join(f"{query / old_query:.2f} / {key / old_key:.2f}" for (query, key), (old_query, old_key)
                               in zip(qk_norms(grown), original_norms))
            loss = hf_grow.evaluate_loss(grown, batches["test"])[0]
            rows.append(
                f"| {name} | {grown.growth_report.step_size:.4g} | {loss:.4f} | {largest:.3f} | {mean:.5f} | "
                f"{qk_rounding_error(grown, batches['test']):.5f} | {ratios} |"
            )
        sizes = ", ".join(f"{text} {len(batches[text])}" for text in counts)
        print(f"\n# bench_bf16_serving ({datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s)): {model_name} trained {args.train_steps} steps, p {args.p}, "
              f"batches of {BATCH_SIZE} x {SEQ_LEN} tokens ({sizes})\n")
        print("| arm | step | test loss | bf16 logits' largest error | mean error | Q/K rounded alone: mean error | "
              "Q/K norm / the original's, per layer (query / key) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
