"""Benchmark: statistics with several processes, and the memory of one pass against several passes.

1. Throughput: `collect_statistics` on the same batches with 1 process and with 2 CPU processes (gloo, an
   `accelerate.Accelerator`, each process one thread and half of the batches), in tokens per second of
   wall time from a barrier to the summed statistics (the reduction included).
2. Memory: `collect_statistics` on a GPT-2-medium-sized config (n_embd 1024, 24 layers, 16 heads, random
   weights, a short sequence) in one pass and with a ``memory_budget``, each in a fresh process. Measured:
   the process's resident memory (RSS) after building the model and data, and its peak RSS (ru_maxrss) at
   the end; their difference is what the statistics added (accumulators, activations, allocator caching).
   The float64 accumulators live on the model's device during a pass (`statistics_bytes`, printed beside);
   finished layers go to the CPU. On a CPU-only machine both are the same memory, and the returned
   statistics (all layers' M) are part of the peak either way: the budget bounds GPU memory, not host RAM.

    python recipes/benchmarks/bench_distributed.py    # ~3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import tempfile
import time

import psutil
import torch
import torch.multiprocessing as multiprocessing
from torch import distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

from hf_grow import collect_statistics, get_adapter
from hf_grow.statistics import layer_groups, statistics_bytes


THROUGHPUT = dict(n_embd=256, n_layer=4, n_head=8, vocab_size=2048, batch_size=4, seq_len=128, batches=16)
MEMORY = dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, batch_size=1, seq_len=32, batches=2)


def build(settings: dict) -> tuple[GPT2LMHeadModel, list[dict]]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=settings["vocab_size"],
        n_positions=max(settings["seq_len"], 64),
        n_embd=settings["n_embd"],
        n_layer=settings["n_layer"],
        n_head=settings["n_head"],
    )
    model = GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(settings["batches"]):
        shape = (settings["batch_size"], settings["seq_len"])
        ids = torch.randint(0, settings["vocab_size"], shape, generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return model, batches


def throughput_worker(rank: int, world_size: int, folder: str, queue) -> None:
    torch.set_num_threads(1)
    transformers_logging.set_verbosity_error()
    model, batches = build(THROUGHPUT)
    accelerator = None
    if world_size > 1:
        os.environ.update(
            WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
        )
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    shard = batches[rank::world_size]
    adapter = get_adapter(model)
    collect_statistics(model, shard[:1], adapter, accelerator=accelerator)  # warm-up
    if accelerator is not None:
        accelerator.wait_for_everyone()
    tick = time.perf_counter()
    statistics = collect_statistics(model, shard, adapter, accelerator=accelerator)
    seconds = time.perf_counter() - tick
    if rank == 0:
        queue.put((statistics.num_tokens, seconds))
    if accelerator is not None:
        accelerator.end_training()


def memory_worker(rank: int, memory_budget: str | None, queue) -> None:
    transformers_logging.set_verbosity_error()
    model, batches = build(MEMORY)
    baseline = psutil.Process().memory_info().rss
    tick = time.perf_counter()
    collect_statistics(model, batches, get_adapter(model), memory_budget=memory_budget)
    seconds = time.perf_counter() - tick
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    queue.put((baseline, peak, seconds))


def in_process(function, args: tuple, nprocs: int = 1):
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    multiprocessing.start_processes(function, args=(*args, queue), nprocs=nprocs, start_method="spawn")
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GB", help="memory_budget of the multi-pass run (default 1GB)")
    args = parser.parse_args()
    print(f"# bench_distributed.py, {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")

    print(f"\n## Statistics throughput, {THROUGHPUT}")
    print("| processes | tokens | seconds | tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    single = None
    for world_size in (1, 2):
        with tempfile.TemporaryDirectory() as folder:
            tokens, seconds = in_process(throughput_worker, (world_size, folder), nprocs=world_size)
        rate = tokens / seconds
        single = single or rate
        print(f"| {world_size} | {tokens} | {seconds:.2f} | {rate:.0f} | {rate / single:.2f} |")

    layers, heads, width = MEMORY["n_layer"], MEMORY["n_head"], MEMORY["n_embd"]
    print(f"\n## Memory, GPT-2-medium-sized config {MEMORY}")
    print("| mode | passes | accumulators on the device (MB) | RSS before (MB) | peak RSS (MB) | added (MB) "
          "| seconds |")
    print("|---|---|---|---|---|---|---|")
    for budget in (None, args.budget):
        groups = layer_groups(layers, heads, width, budget)
        planned = statistics_bytes(layers, heads, width, max(len(group) for group in groups))
        baseline, peak, seconds = in_process(memory_worker, (budget,))
        mode = "one pass" if budget is None else f"memory_budget={budget}"
        print(f"| {mode} | {len(groups)} | {planned / 1e6:.0f} | {baseline / 1e6:.0f} | {peak / 1e6:.0f} | "
              f"{(peak - baseline) / 1e6:.0f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
