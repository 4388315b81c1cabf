"""Benchmark: the cost of collecting growth statistics, as a ratio to a plain training step.

For a GPT-2-small-sized config (n_embd 768, 12 layers, 12 heads) on a GPU in bf16 (batch 8), or a small config
on CPU, at several sequence lengths: time and peak memory of one statistics step (forward + backward +
accumulation of C and M) with each method, over one plain training step (forward + backward with parameter
gradients, sdpa attention) on the same batch. Also the FLOP floor of M and the solve time for all heads.

The floor: per layer and sequence, M costs h (2 s^2 d + 2 s d^2) FLOPs on top of the training step
(d = d_e + 1: G X' then X'^T (G X')); a training step costs about 6 N s + 12 L s^2 d_e FLOPs per sequence
(N the parameters of the blocks and the LM head, plus the attention scores and values forward and backward).
The floor ratio is (training + M) / training. Last, the solve (whitened decomposition of every head, eigh vs
full SVD) and, on the GPU preset, a whole `grow_model` line search at the preset's second sequence length.

    python recipes/benchmarks/bench_stats.py --preset cpu    # ~3 min on 2 CPU cores
    python recipes/benchmarks/bench_stats.py --preset gpu    # CUDA, bf16
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

import hf_grow
from hf_grow import linalg
from hf_grow.statistics import METHODS, collect_statistics


PRESETS = {
    "cpu": dict(n_embd=256, n_layer=4, n_head=8, vocab_size=2048, batch_size=2, seq_lens=[128, 256, 512], dtype="float32", rounds=2),
    "gpu": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, batch_size=8, seq_lens=[256, 1024, 2048, 4096], dtype="bfloat16", rounds=5),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step, device: torch.device, rounds: int) -> tuple[float, float | None]:
    """Median seconds of ``step()`` after a warm-up, and the peak memory above the baseline (CUDA only)."""
    step()
    synchronize(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    times = []
    for _ in range(rounds):
        synchronize(device)
        tick = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - tick)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    return sorted(times)[len(times) // 2], peak


def flops(config: GPT2Config, seq_len: int) -> tuple[float, float]:
    """Training-step FLOPs and the extra FLOPs of M, per sequence."""
    d_e, layers, heads = config.n_embd, config.n_layer, config.n_head
    parameters = layers * 12 * d_e**2 + config.vocab_size * d_e
    training = 6 * parameters * seq_len + 12 * layers * seq_len**2 * d_e
    extra = layers * heads * (2 * seq_len**2 * (d_e + 1) + 2 * seq_len * (d_e + 1) ** 2)
    return training, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="override the preset's sequence lengths")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    device = torch.device("cuda" if args.preset == "gpu" else "cpu")
    dtype = getattr(torch, preset["dtype"])
    config = GPT2Config(
        n_embd=preset["n_embd"], n_layer=preset["n_layer"], n_head=preset["n_head"], n_positions=max(preset["seq_lens"] + (args.seq_lens or [])),
        vocab_size=preset["vocab_size"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    model.set_attn_implementation("sdpa")
    adapter = hf_grow.get_adapter(model)
    name = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or platform.machine())
    print(f"# {datetime.date.today()}, {name}, torch {torch.__version__}, {preset['dtype']}, "
          f"GPT-2 n_embd {config.n_embd} x {config.n_layer} layers x {config.n_head} heads, batch {preset['batch_size']}")
    header = f"{'seq':>5} {'method':<10} {'train s':>8} {'stats s':>8} {'time x':>7} {'floor x':>7} {'meas/floor':>10} {'train GiB':>9} {'stats GiB':>9} {'mem x':>6}"
    print(header)
    print("-" * len(header))
    for seq_len in args.seq_lens or preset["seq_lens"]:
        input_ids = torch.randint(0, config.vocab_size, (preset["batch_size"], seq_len), device=device)
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}

        def train_step() -> None:
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()

        try:
            train_time, train_memory = measure(train_step, device, preset["rounds"])
        except torch.OutOfMemoryError:
            print(f"{seq_len:>5} {'train':<10} OOM")
            continue
        model.zero_grad(set_to_none=True)
        training, extra = flops(config, seq_len)
        floor = (training + extra) / training
        for method in args.methods:
            def statistics_step() -> None:
                collect_statistics(model, [batch], adapter, method=method)

            try:
                stats_time, stats_memory = measure(statistics_step, device, preset["rounds"])
            except torch.OutOfMemoryError:
                print(f"{seq_len:>5} {method:<10} {train_time:>8.3f} {'OOM':>8}")
                torch.cuda.empty_cache()
                continue
            ratio = stats_time / train_time
            memory = "" if train_memory is None else f"{train_memory:>9.2f} {stats_memory:>9.2f} {stats_memory / train_memory:>6.2f}"
            print(f"{seq_len:>5} {method:<10} {train_time:>8.3f} {stats_time:>8.3f} {ratio:>7.2f} {floor:>7.2f} {ratio / floor:>10.2f} {memory}", flush=True)

    # The solve: per layer, the whitened decomposition of Z - lam P for every head, as in one line-search step.
    heads, width = config.n_head, config.n_embd + 1
    generator = torch.Generator(device=device).manual_seed(0)
    targets = torch.randn(config.n_layer * heads, width, width, generator=generator, device=device, dtype=torch.float64)
    second = torch.randn(config.n_layer, width, 4 * width, generator=generator, device=device, dtype=torch.float64)
    metric = linalg.metric_from_second_moment((second @ second.mT)[:, None].expand(-1, heads, -1, -1).reshape(-1, width, width))
    rank = config.n_embd // heads + 8
    print(f"\n# solve: whitened decomposition of {config.n_layer * heads} heads of {width}x{width}, float64, truncated to rank {rank}")
    exact = linalg.decompose(targets, metric, "svd").truncate(rank).product
    scale = linalg.whitened_norm_sq(exact, metric).sqrt()
    for method in linalg.SVD_METHODS:
        seconds, _ = measure(lambda: linalg.decompose(targets, metric, method).truncate(rank), device, 3)
        product = linalg.decompose(targets, metric, method).truncate(rank).product
        error = float((linalg.whitened_norm_sq(product - exact, metric).sqrt() / scale).max())
        print(f"{method:>5}: {seconds:.3f} s, max relative error vs full SVD (metric norm) {error:.1e}")

    if device.type == "cuda":
        seq_len = preset["seq_lens"][1]
        generator = torch.Generator(device=device).manual_seed(1)
        batches = []
        for _ in range(4):
            input_ids = torch.randint(0, config.vocab_size, (preset["batch_size"], seq_len), device=device, generator=generator)
            batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids})
        statistics = hf_grow.collect_statistics(model, batches[:2], adapter)
        print(f"\n# grow_model at seq {seq_len}, 2 statistics + 2 held-out batches")
        for solver in ("eigh", "svd"):
            grown = hf_grow.grow_model(
                model, None, p=8, statistics=statistics, eval_dataloader=batches[2:], solver=solver, measure_realized_gains=False
            )
            report = grown.growth_report
            seconds = report.seconds
            print(
                f"{solver:>5}: {len(report.line_search)} line-search points, solve + line search "
                f"{seconds['solve'] + seconds['line_search']:.2f} s, step {report.step_size:.4g}, "
                f"held-out loss {report.eval_loss_before:.4f} -> {report.eval_loss_after:.4f}"
            )


if __name__ == "__main__":
    main()
