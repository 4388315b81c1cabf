"""Benchmark: grow the query/key width of a small trained GPT-2 and measure what it buys.

Trains byte-level GPT-2 LMs on the Python standard library's own sources, then for each model runs
`hf_grow.grow_model` for p in {0, 4, 8, 16} x truncation in {whitened, frobenius} (p=0: the same solve without
adding dimensions) with the default step mode, the original notes' formula at p = 8 as a named baseline
(Frobenius truncation, lam_l = t * ||Z_l||_F / ||P_l||_F per layer), plus the unconstrained full-rank update
Z - lam P as an upper reference (search="fast").
The files are split into four disjoint sets: training, statistics, line-search held-out, and a final test
split that growth never sees (the line search picks lam on the held-out batches, so the held-out "after"
loss is optimistically biased; the test loss is not).

Also times `hf_grow.collect_statistics` against plain training steps (forward + backward, sdpa attention)
on the same batches and reports the ratio.

    python recipes/benchmarks/bench_growth.py                 # --preset small, ~10 min on 2 CPU cores
    python recipes/benchmarks/bench_growth.py --preset tiny   # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import copy
import datetime
import glob
import json
import math
import os
import platform
import random
import statistics as pystats
import sysconfig
import time
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

import hf_grow


PRESETS = {
    # Each model: (seed, n_embd, n_layer, n_head, train steps). d_k = n_embd / n_head = 16 in both.
    "small": dict(
        models=[(0, 128, 4, 8, 600), (1, 96, 3, 6, 500)],
        seq_len=128,
        batch_size=16,
        stats_batches=24,
        eval_batches=12,
        test_batches=24,
        timing_batches=6,
        timing_rounds=3,
        ps=[0, 4, 8, 16],
    ),
    "tiny": dict(
        models=[(0, 64, 2, 4, 60)],
        seq_len=64,
        batch_size=8,
        stats_batches=4,
        eval_batches=3,
        test_batches=4,
        timing_batches=2,
        timing_rounds=1,
        ps=[0, 8],
    ),
}
TRUNCATIONS = ("whitened", "frobenius")


def split_files(seed: int) -> dict[str, list[str]]:
    """Disjoint file sets of the stdlib's top-level .py sources: 60% train, 15% stats, 10% eval, 15% test."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if len(files) < 50:
        raise SystemExit(f"expected the standard library's .py sources, found {len(files)} files")
    random.Random(seed).shuffle(files)
    n = len(files)
    cuts = [0, int(0.60 * n), int(0.75 * n), int(0.85 * n), n]
    names = ["train", "stats", "eval", "test"]
    return {name: files[cuts[i] : cuts[i + 1]] for i, name in enumerate(names)}


def load_bytes(files: list[str]) -> torch.Tensor:
    return torch.tensor(list(b"".join(open(f, "rb").read() for f in files)), dtype=torch.long)


def lm_batches(data: torch.Tensor, count: int, batch_size: int, seq_len: int, seed: int) -> list[dict]:
    """``count`` batches of random windows of ``data``, labelled for next-token loss."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids})
    return batches


def make_model(n_embd: int, n_layer: int, n_head: int, seq_len: int, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")
    return model


def train(model, data, steps: int, batch_size: int, seq_len: int, seed: int, log_every: int = 100) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) * 0.9 + 0.1,
    )
    generator = torch.Generator().manual_seed(10_000 + seed)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"  step {step + 1:5d}/{steps}  train loss {loss_value:.4f}", flush=True)
    model.eval()
    return loss_value


def time_statistics_vs_training(model, batches: list[dict], rounds: int) -> dict:
    """Seconds for len(batches) plain training steps (fwd + bwd, sdpa) vs collect_statistics on the same batches.

    Rounds interleave the two (the CPU is shared) and the medians are compared.
    """
    adapter = hf_grow.get_adapter(model)
    trainee = copy.deepcopy(model)
    trainee.set_attn_implementation("sdpa")
    trainee.train()

    def train_steps() -> float:
        tick = time.perf_counter()
        for batch in batches:
            trainee.zero_grad(set_to_none=True)
            trainee(**batch).loss.backward()
        return time.perf_counter() - tick

    def statistics() -> float:
        tick = time.perf_counter()
        hf_grow.collect_statistics(model, batches, adapter)
        return time.perf_counter() - tick

    train_steps(), statistics()  # warm-up
    train_times, stats_times = [], []
    for _ in range(rounds):
        train_times.append(train_steps())
        stats_times.append(statistics())
    train_median, stats_median = pystats.median(train_times), pystats.median(stats_times)
    return dict(
        batches=len(batches),
        rounds=rounds,
        train_seconds=train_median,
        statistics_seconds=stats_median,
        ratio=stats_median / train_median,
        ratios=[s / t for s, t in zip(stats_times, train_times)],
    )


#: The original notes' formula, a named baseline: Frobenius truncation with lam_l = t * ||Z_l||_F / ||P_l||_F per
#: layer and one t searched (BENCHMARKS.md, "One step for all layers or a step per layer").
NOTES = dict(truncation="frobenius", step_mode="per_layer")


def grow_row(
    model, stats, eval_batches, test_batches, test_before, p, truncation, search="exact", step_mode=None, label=None
) -> dict:
    n_layer = model.config.n_layer
    p_arg = {layer: 0 for layer in range(n_layer)} if p == 0 else p
    grown = hf_grow.grow_model(
        model,
        stats,
        p=p_arg,
        eval_dataloader=eval_batches,
        truncation=truncation,
        search=search,
        measure_realized_gains=False,
        **({} if step_mode is None else {"step_mode": step_mode}),
    )
    report = grown.growth_report
    test_after = hf_grow.evaluate_loss(grown, test_batches)[0]
    return dict(
        p=p,
        truncation=label or truncation,
        step_mode=report.step_mode,
        search=search,
        heldout_before=report.eval_loss_before,
        heldout_after=report.eval_loss_after,
        test_before=test_before,
        test_after=test_after,
        step_size=report.step_size,
        unconstrained=report.unconstrained_eval_loss,
        line_search_points=len(report.line_search),
        parameters_added=report.parameters_added,
        expected_gain=sum(layer.expected_gain for layer in report.layers),
        seconds=report.seconds,
    )


def fmt_table(rows: list[dict]) -> str:
    lines = [
        "| p | truncation | step mode | held-out before | held-out after | held-out decrease "
        "| test before | test after | test decrease | step size |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['p']} | {r['truncation']} | {r['step_mode']} | {r['heldout_before']:.4f} | {r['heldout_after']:.4f} "
            f"| {r['heldout_before'] - r['heldout_after']:.4f} | {r['test_before']:.4f} | {r['test_after']:.4f} "
            f"| {r['test_before'] - r['test_after']:.4f} | {r['step_size']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the file split and the batch windows")
    parser.add_argument("--models", type=int, default=None, help="use only the first N models of the preset")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default: on a shared 2-core CPU, 2 threads were >10x slower (contention)",
    )
    parser.add_argument("--json", default=None, help="also write all results to this JSON file")
    args = parser.parse_args()

    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    models = preset["models"][: args.models] if args.models else preset["models"]
    seq_len, batch_size = preset["seq_len"], preset["batch_size"]

    print(
        f"# bench_growth  preset={args.preset}  data_seed={args.data_seed}  "
        f"{datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
        f"{platform.processor() or platform.machine()}",
        flush=True,
    )
    files = split_files(args.data_seed)
    data = {name: load_bytes(chosen) for name, chosen in files.items()}
    print("files/bytes: " + ", ".join(f"{k} {len(files[k])}/{len(v):,}" for k, v in data.items()), flush=True)
    stats = lm_batches(data["stats"], preset["stats_batches"], batch_size, seq_len, args.data_seed + 1)
    eval_batches = lm_batches(data["eval"], preset["eval_batches"], batch_size, seq_len, args.data_seed + 2)
    test_batches = lm_batches(data["test"], preset["test_batches"], batch_size, seq_len, args.data_seed + 3)

    results = []
    started = time.perf_counter()
    for seed, n_embd, n_layer, n_head, steps in models:
        name = (
            f"seed {seed}, n_embd {n_embd}, n_layer {n_layer}, n_head {n_head} (d_k {n_embd // n_head}), "
            f"{steps} steps"
        )
        print(f"\n## model: {name}", flush=True)
        model = make_model(n_embd, n_layer, n_head, seq_len, seed)
        tick = time.perf_counter()
        train_loss = train(model, data["train"], steps, batch_size, seq_len, seed)
        train_seconds = time.perf_counter() - tick
        test_before = hf_grow.evaluate_loss(model, test_batches)[0]
        print(f"  trained in {train_seconds:.0f}s; test loss {test_before:.4f}", flush=True)

        timing = time_statistics_vs_training(model, stats[: preset["timing_batches"]], preset["timing_rounds"])
        print(
            f"  statistics / training-step time: {timing['ratio']:.2f}x "
            f"(per-round {', '.join(f'{r:.2f}' for r in timing['ratios'])})",
            flush=True,
        )

        rows = []
        for p in preset["ps"]:
            for truncation in TRUNCATIONS:
                tick = time.perf_counter()
                row = grow_row(model, stats, eval_batches, test_batches, test_before, p, truncation)
                rows.append(row)
                print(
                    f"  p={p:2d} {truncation:9s} held-out {row['heldout_before']:.4f} -> {row['heldout_after']:.4f}"
                    f"  test {row['test_before']:.4f} -> {row['test_after']:.4f}  step {row['step_size']:.3g}"
                    f"  ({time.perf_counter() - tick:.0f}s)",
                    flush=True,
                )
        # The original notes' formula as a baseline, at p = 8.
        row = grow_row(model, stats, eval_batches, test_batches, test_before, 8, label="notes' formula", **NOTES)
        rows.append(row)
        print(f"  p= 8 notes' formula test {row['test_before']:.4f} -> {row['test_after']:.4f}  "
              f"step {row['step_size']:.3g}", flush=True)
        # Upper reference: the full-rank update Z - lam P (searched on the same held-out batches; reported with one
        # step mode, not the default's choice between two).
        reference = grow_row(model, stats, eval_batches, test_batches, test_before, 0, "whitened", search="fast",
                             step_mode="per_head")
        print(f"  unconstrained full-rank held-out loss {reference['unconstrained']:.4f}", flush=True)
        results.append(
            dict(
                model=name,
                seed=seed,
                config=dict(n_embd=n_embd, n_layer=n_layer, n_head=n_head, steps=steps),
                train_loss=train_loss,
                train_seconds=train_seconds,
                timing=timing,
                rows=rows,
                unconstrained_heldout=reference["unconstrained"],
                fast_p0=reference,
            )
        )

    print(f"\n# Results (preset {args.preset}, total {time.perf_counter() - started:.0f}s)")
    for result in results:
        rows = result["rows"]
        before = rows[0]["heldout_before"]
        print(f"\n### {result['model']}; final train loss {result['train_loss']:.4f}\n")
        print(fmt_table(rows))
        unconstrained = result["unconstrained_heldout"]
        print(
            f"\nUnconstrained full-rank update (reference, search='fast'): held-out {before:.4f} -> "
            f"{unconstrained:.4f} (decrease {before - unconstrained:.4f})"
        )
        by_key = {(r["p"], r["truncation"]): r for r in rows}
        if 8 in preset["ps"]:
            default, notes = by_key[(8, "whitened")], by_key[(8, "notes' formula")]
            gain = lambda r: r["test_before"] - r["test_after"]  # noqa: E731
            print(f"p=8: the default over the notes' formula, test decrease {gain(default) / gain(notes):.2f}x"
                  if gain(notes) > 0 else "p=8: the notes' formula did not lower the test loss")
        for p in preset["ps"]:
            w, f = by_key[(p, "whitened")], by_key[(p, "frobenius")]
            dw, df = w["heldout_before"] - w["heldout_after"], f["heldout_before"] - f["heldout_after"]
            tw, tf = w["test_before"] - w["test_after"], f["test_before"] - f["test_after"]
            ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "n/a"  # noqa: E731
            print(f"p={p}: whitened/frobenius decrease, held-out {ratio(dw, df)}, test {ratio(tw, tf)}")
        timing = result["timing"]
        print(
            f"statistics collection / plain training step (fwd+bwd, sdpa), {timing['batches']} batches of "
            f"{batch_size}x{seq_len}, median of {timing['rounds']}: {timing['ratio']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(preset=args.preset, data_seed=args.data_seed, results=results), handle, indent=2)


if __name__ == "__main__":
    main()
