"""Benchmark: what growth during DDP training adds beyond the resize, at the GPT-2 small shape.

A grown-type GPT-2 of GPT-2 small's shape (124M parameters, d_k 32 per head, random weights) trains under
DistributedDataParallel (one CPU process, gloo: the bucket rebuild does the same work whatever the number of
processes) with AdamW on batches of 2 × 128 tokens. Timed: a training step (the fastest of ``--steps``), the
in-place growth to d_k 64 in mode "zero" (resize, optimizer remap and the bucket rebuild; no statistics), the
bucket rebuild alone (`hf_grow.distributed.rebuild_ddp_buckets_`), and a training step after growth.

    python recipes/benchmarks/bench_ddp_growth.py     # 2-5 minutes on 2 (shared) CPU cores
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time

import torch
from torch import distributed as dist
from transformers.utils import logging as transformers_logging

from hf_grow import GrownGPT2Config, GrownGPT2LMHeadModel, grow_in_training
from hf_grow.distributed import rebuild_ddp_buckets_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps timed before and after growth")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(GrownGPT2Config(n_layer=12, n_embd=768, n_head=12, qk_head_dims=[32] * 12))
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        started = time.perf_counter()
        wrapped(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    before = min(step() for _ in range(args.steps))
    started = time.perf_counter()
    grow_in_training(wrapped, optimizer, None, 32, mode="zero")
    growth = time.perf_counter() - started
    started = time.perf_counter()
    rebuild_ddp_buckets_(wrapped)
    rebuild = time.perf_counter() - started
    after = min(step() for _ in range(args.steps))
    dist.destroy_process_group()

    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    print("| training step before (s) | growth d_k 32 -> 64, zero mode (s) | bucket rebuild alone (s) "
          "| rebuild / step | training step after (s) |")
    print("|---|---|---|---|---|")
    print(f"| {before:.2f} | {growth:.3f} | {rebuild:.4f} | {rebuild / before:.4f} | {after:.2f} |")


if __name__ == "__main__":
    main()
