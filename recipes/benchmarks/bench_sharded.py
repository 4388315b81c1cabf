"""Benchmark: layers shared out among processes (`hf_grow.growth.sharding`): M held and solve time per process.

1. `grow_model` on a small GPT-2 (random weights) with 1, 2 and 3 CPU processes (gloo, an `accelerate.Accelerator`,
   one thread each, each process an equal share of the batches), statistics in passes of one layer. Per process:
   the layers it owns, the solve's wall time (`GrowthReport.seconds["solve"]`: its own layers' decompositions,
   then waiting for the other owners and receiving the skeletons of their layers), and the most bytes of M it
   held at any statistics batch (live (heads, d, d) tensors, found by the garbage collector), both in
   `grow_model` (each group's M freed by its solve) and in `collect_statistics(owners=)` keeping M (statistics
   collected once, to grow several ways).
2. The memory plan (`plan_memory`) of a Llama-3-8B shape (meta device, bfloat16, on a GPU) for 1 process and per
   process of 8, with the budget and truncation given.

    python recipes/benchmarks/bench_sharded.py    # ~3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import tempfile

import torch
import torch.multiprocessing as multiprocessing
from torch import distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

from hf_grow import GrowthConfig, collect_statistics, get_adapter, grow_model
from hf_grow.growth.memory_plan import plan_memory
from hf_grow.growth.sharding import plan_owners
from hf_grow.progress import format_bytes
from hf_grow.statistics import statistics_bytes


SMALL = dict(n_embd=256, n_layer=6, n_head=8, vocab_size=2048, batch_size=2, seq_len=64, batches=6, eval_batches=6)
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


def build(settings: dict) -> tuple[GPT2LMHeadModel, list[dict], list[dict]]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=settings["vocab_size"], n_positions=settings["seq_len"], n_embd=settings["n_embd"],
                        n_layer=settings["n_layer"], n_head=settings["n_head"])
    model = GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(settings["batches"] + settings["eval_batches"]):
        shape = (settings["batch_size"], settings["seq_len"])
        ids = torch.randint(0, settings["vocab_size"], shape, generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return model, batches[: settings["batches"]], batches[settings["batches"] :]


def held_m_bytes(heads: int, width: int) -> int:
    """Bytes of the live (heads, d, d) tensors, each storage once."""
    storages = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and tuple(obj.shape) == (heads, width, width):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def worker(rank: int, world_size: int, folder: str, queue) -> None:
    torch.set_num_threads(1)
    transformers_logging.set_verbosity_error()
    model, batches, eval_batches = build(SMALL)
    accelerator = None
    if world_size > 1:
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    heads, width, layers = SMALL["n_head"], SMALL["n_embd"] + 1, SMALL["n_layer"]
    peaks = []

    def counting_loss(m, batch):
        peaks.append(held_m_bytes(heads, width))
        return m(**batch).loss

    budget = statistics_bytes(layers, heads, SMALL["n_embd"], 2)  # one layer of M per pass
    shard, eval_shard = batches[rank::world_size], eval_batches[rank::world_size]
    grown = grow_model(model, shard, p=8, eval_dataloader=eval_shard, loss_fn=counting_loss, memory_budget=budget,
                       accelerator=accelerator, truncation="whitened", step_mode="per_head",
                       measure_realized_gains=False)
    grow_peak, peaks = max(peaks), []
    owners = plan_owners([1.0] * layers, world_size)
    statistics = collect_statistics(model, shard, get_adapter(model), loss_fn=counting_loss, memory_budget=budget,
                                    accelerator=accelerator, owners=owners)
    kept_peak = max(*peaks, held_m_bytes(heads, width))
    del statistics
    owned = [layer for layer, owner in enumerate(owners) if owner == rank]
    queue.put((rank, owned, grown.growth_report.seconds["solve"], grow_peak, kept_peak,
               grown.growth_report.eval_loss_after))
    if accelerator is not None:
        accelerator.end_training()


def run(world_size: int) -> list[tuple]:
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        multiprocessing.start_processes(worker, args=(world_size, folder, queue), nprocs=world_size,
                                        start_method="spawn")
    return sorted(queue.get() for _ in range(world_size))


def llama_plans(budget: str, truncation: str) -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_8B)).to(torch.bfloat16)
    config = GrowthConfig(p=8, memory_budget=budget, truncation=truncation)
    for processes in (1, 8):
        plan = plan_memory(model, get_adapter(model), config, batch_size=1, seq_len=2048, eval_tokens=2**16,
                           device="cuda", processes=processes)
        print(f"\n### Llama-3-8B shape, {processes} process(es), memory_budget={budget}, truncation={truncation}\n")
        print("```\n" + plan.table() + "\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="30GB", help="memory_budget of the Llama-3-8B plan (default 30GB)")
    args = parser.parse_args()
    print(f"# bench_sharded.py, {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}")
    print(f"\n## grow_model, GPT-2 {SMALL}, one layer of M per pass\n")
    print("| processes | rank | layers owned | solve (s) | M held, grow_model | M held, kept | vs 1 process (kept) "
          "| held-out loss after |")
    print("|---|---|---|---|---|---|---|---|")
    single = None
    for world_size in (1, 2, 3):
        for rank, owned, solve, grow_peak, kept_peak, loss in run(world_size):
            single = single or kept_peak
            print(f"| {world_size} | {rank} | {owned} | {solve:.2f} | {format_bytes(grow_peak)} | "
                  f"{format_bytes(kept_peak)} | {kept_peak / single:.2f} | {loss:.6f} |")
    for truncation in ("auto", "whitened"):
        llama_plans(args.budget, truncation)


if __name__ == "__main__":
    main()
