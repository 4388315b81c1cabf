"""Benchmark: does a grown trained GPT-2 or Llama continue training on new text at least as well as the original?
(issue: training after growth, part (b); part (a), MiniLM, is bench_train_after_growth.py, whose arms this shares)

Models (``--models``): bench_candidates' GPT-2 with a 2,048-token BPE (``bpe-en``), its byte-level GPT-2
(``bytes-en``) and its Llama (grouped-query attention, so `grow_model` grows it by "append"; ``llama-en``), trained
``--train-steps`` steps on its training documents (English prose from the standard library) and cached under
``--cache``. The documents it held out are cut again, by document, into four texts that training never saw:

- the statistics text: growth collects its statistics on all of it, cut into consecutive windows;
- other new text, as long;
- the line-search text (growth's held-out batches);
- the test text, seen by nothing but the scores.

Each arm then continues training on the statistics text (``--train-text same``: a user who grows on the text they
go on to train on, as part (a)'s ``--fine-tune-pairs same``) or on the other text (``disjoint``), with AdamW as the
models were trained (betas 0.9/0.95, weight decay 0.01, gradients clipped at 1) at the constant learning rate their
cosine schedule ended at (``--lr``, 3e-4: on these small texts it raises every arm's test loss; 3e-5 and 1e-4 lower
the original's), on random windows drawn from a generator seeded by the seed alone, so every arm of a seed sees
the same batches. Scored by the test loss at each step count in ``--at``.

Arms (``--arms``, as in part (a)): ``original``, ``zero`` (widened by p with step 0: the same function),
``default`` (`grow_model`'s defaults) and growth options as ``name={json}`` (with ``"cross_fit": true`` in any
arm the statistics also hold M's two halves; M itself is the same sum). Per grown arm, diagnostics: the chosen
step, the loss before -> after growth on the line-search, statistics and other texts, and the bfloat16 logits'
largest error against float32 on two test batches, the original's -> the grown model's (with part (a)'s
``"rotate"`` arm option, the grown factors rotated: the same scores).

    python recipes/benchmarks/bench_train_after_growth_lm.py --cache runs/candidates   # bpe-en, llama-en; 3 seeds
    python recipes/benchmarks/bench_train_after_growth_lm.py --quick                    # smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import random
import statistics as pystats
import sys
import time
import warnings

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from bench_candidates import BATCH_SIZE, SEQ_LEN, english_documents, english_model, english_streams
from bench_train_after_growth import any_cross_fits, grow, parse_arm

import hf_grow

TEXTS = {"statistics": 0.34, "other": 0.34, "search": 0.12, "test": 0.2}  # shares of the held-out documents


def split_documents(documents: dict[str, list[str]]) -> dict[str, list[str]]:
    """bench_candidates' training documents (so its BPE and cached models stay valid) and its statistics and
    held-out documents, shuffled and re-cut by document into the `TEXTS`."""
    rest = documents["stats"] + documents["held_out"]
    random.Random(1).shuffle(rest)
    split, start = {"train": documents["train"]}, 0
    for name, share in TEXTS.items():
        end = start + round(share * len(rest))
        split[name], start = rest[start:end], end
    return split


def windows(stream: torch.Tensor, count: int, batch_size: int, seq_len: int) -> list[dict]:
    """Up to ``count`` batches of consecutive, non-overlapping windows from the start of ``stream`` (each token
    once), labelled for next-token loss."""
    usable = min(count * batch_size, len(stream) // seq_len) // batch_size * batch_size
    input_ids = stream[: usable * seq_len].view(-1, batch_size, seq_len)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids in input_ids]


def continue_training(
    model: PreTrainedModel, text: torch.Tensor, test: list[dict], at: list[int], lr: float, seed: int,
    batch_size: int, seq_len: int,
) -> dict[int, float]:
    """Test loss at each step count in ``at`` while AdamW trains ``model`` on random windows of ``text`` (the
    optimizer the models were trained with, at a constant ``lr``); the windows depend on ``seed`` alone."""
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    losses = {0: hf_grow.evaluate_loss(model, test)[0]} if 0 in at else {}
    model.train()
    for step in range(1, max(at) + 1):
        starts = torch.randint(0, len(text) - seq_len + 1, (batch_size,), generator=generator)
        input_ids = torch.stack([text[start : start + seq_len] for start in starts.tolist()])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step in at:
            losses[step] = hf_grow.evaluate_loss(model, test)[0]  # in eval mode; the model's mode is kept
    return losses


def bfloat16_errors(model: PreTrainedModel, batches: list[dict]) -> tuple[float, float]:
    """(largest, mean) absolute difference of ``model``'s logits and its bfloat16 copy's over ``batches``: what
    serving in bfloat16 costs (BENCHMARKS, "The scores' size after the step")."""
    copied = copy.deepcopy(model).to(torch.bfloat16).eval()
    largest, total = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            error = (model.eval()(input_ids=batch["input_ids"]).logits
                     - copied(input_ids=batch["input_ids"]).logits.float()).abs()
            largest, total = max(largest, float(error.max())), total + float(error.mean())
    return largest, total / len(batches)


def run_model(
    model: PreTrainedModel, batches: dict[str, list[dict]], train_text: torch.Tensor, arms: list[str], p: int,
    at: list[int], lr: float, seeds: int,
) -> tuple[dict[str, list[dict[int, float]]], dict[str, dict]]:
    """Each arm of ``arms`` grown from statistics on ``batches["statistics"]`` (collected once, shared), then
    trained on ``train_text`` once per seed: (test losses per arm and seed, diagnostics per grown arm)."""
    batch_size, seq_len = batches["test"][0]["input_ids"].shape
    statistics = hf_grow.collect_statistics(
        model, batches["statistics"], hf_grow.get_adapter(model), cross_fit=any_cross_fits(arms)
    )
    losses = {name: hf_grow.evaluate_loss(model, batches[name])[0] for name in ("search", "statistics", "other")}
    results, diagnostics = {}, {}
    base_error = bfloat16_errors(model, batches["test"][:2])[0]
    for arm in arms:
        name, options = parse_arm(arm)
        tick = time.perf_counter()
        start = model
        if options is not None:
            start = grow(model, options, batches["statistics"], batches["search"], statistics, p)
            diagnostics[name] = {"step": start.growth_report.step_size} | {
                text: (before, hf_grow.evaluate_loss(start, batches[text])[0]) for text, before in losses.items()
            } | {"bf16": (base_error, bfloat16_errors(start, batches["test"][:2])[0])}
        results[name] = [
            continue_training(copy.deepcopy(start), train_text, batches["test"], at, lr, seed, batch_size, seq_len)
            for seed in range(seeds)
        ]
        print(f"# {name}: {time.perf_counter() - tick:.0f} s", flush=True)
    return results, diagnostics


def spread(values: list[float]) -> str:
    """``mean ± std`` of ``values`` (std 0 for one value)."""
    return f"{pystats.mean(values):.4f} ± {pystats.stdev(values) if len(values) > 1 else 0.0:.4f}"


def tables(results: dict[str, list[dict[int, float]]], diagnostics: dict[str, dict], at: list[int]) -> str:
    """Markdown: the diagnostics per grown arm, the test loss per arm and step count (mean ± std over seeds), and
    each arm's test loss minus the original's on the same seed (the same batches)."""
    lines = ["| arm | step size | line-search loss | statistics text's loss | other text's loss | bf16 logits' error |",
             "|---|---|---|---|---|---|"]
    for name, row in diagnostics.items():
        cells = " | ".join(f"{row[text][0]:.4f} -> {row[text][1]:.4f}" for text in ("search", "statistics", "other"))
        lines.append(f"| {name} | {row['step']:.4g} | {cells} | {row['bf16'][0]:.3g} -> {row['bf16'][1]:.3g} |")
    header = ["", "| arm | " + " | ".join(str(step) for step in at) + " |", "|---|" + "---|" * len(at)]
    lines += ["", "test loss after continued training steps (mean ± std over seeds)", *header]
    for name, runs in results.items():
        lines.append(f"| {name} | " + " | ".join(spread([run[step] for run in runs]) for step in at) + " |")
    if "original" in results:
        lines += ["", "minus the original's test loss on the same seed (mean ± std)", *header]
        for name, runs in results.items():
            if name != "original":
                differences = lambda step: [run[step] - base[step] for run, base in zip(runs, results["original"])]  # noqa: E731
                lines.append(f"| {name} | " + " | ".join(spread(differences(step)) for step in at) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("bpe-en", "bytes-en", "llama-en"),
                        default=["bpe-en", "llama-en"])
    parser.add_argument("--arms", nargs="+", default=["original", "zero", "default"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--at", type=int, nargs="+", default=[0, 25, 50, 100, 150], help="step counts scored")
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4, help="where the models' training schedule ended")
    parser.add_argument("--train-text", choices=("same", "disjoint"), default="same",
                        help="continue training on the statistics text, or on as much other new text")
    parser.add_argument("--statistics-batches", type=int, default=20, help="the statistics text's length")
    parser.add_argument("--search-batches", type=int, default=8)
    parser.add_argument("--test-batches", type=int, default=12)
    parser.add_argument("--train-steps", type=int, default=300, help="the models' own training")
    parser.add_argument("--cache", default=None, help="folder for the trained models (reused when there)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke-test defaults: bytes-en trained 40 steps, few "
                        "batches, steps, seeds (options given explicitly win)")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(models=["bytes-en"], at=[0, 2, 4], seeds=2, train_steps=40, statistics_batches=2,
                            search_batches=2, test_batches=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    documents = split_documents(english_documents())
    counts = {"statistics": args.statistics_batches, "other": args.statistics_batches, "search": args.search_batches,
              "test": args.test_batches}
    for model_name in args.models:
        streams, size = english_streams("bpe" if model_name == "bpe-en" else "bytes", documents)
        model = english_model(model_name, streams["train"], size, args.train_steps, args.cache)
        batches = {text: windows(streams[text], count, BATCH_SIZE, SEQ_LEN) for text, count in counts.items()}
        train_text = "statistics" if args.train_text == "same" else "other"
        trained_on = torch.cat([batch["input_ids"].flatten() for batch in batches[train_text]])  # what the batches hold
        results, diagnostics = run_model(model, batches, trained_on, args.arms, args.p, args.at, args.lr, args.seeds)
        sizes = ", ".join(f"{text} {len(batches[text])}" for text in counts)
        print(f"\n# bench_train_after_growth_lm ({datetime.date.today()}, {platform.machine()}, torch "
              f"{torch.__version__}, {torch.get_num_threads()} thread(s)): {model_name} trained {args.train_steps} "
              f"steps, p {args.p}, AdamW lr {args.lr}, batches of {BATCH_SIZE} x {SEQ_LEN} tokens ({sizes}), "
              f"trained on the {args.train_text} text as the statistics, {args.seeds} seeds\n")
        print(tables(results, diagnostics, args.at), flush=True)


if __name__ == "__main__":
    main()
