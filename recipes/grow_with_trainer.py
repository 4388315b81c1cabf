"""Grow a small GPT-2's query/key heads during `transformers.Trainer` training, on one process or several (DDP).

The same script runs on one process, under torchrun (CPU processes with gloo, or GPUs) and under
`accelerate launch`; the Trainer wraps the model in DistributedDataParallel and `GrowthCallback` grows the
wrapped model in place with the Trainer's accelerator. The corpus is the Python standard library's sources
(byte-level, no tokenizer, no network).

    python recipes/grow_with_trainer.py --output-dir runs/trainer-growth
    torchrun --nproc_per_node 2 recipes/grow_with_trainer.py --output-dir runs/trainer-growth
    accelerate launch --multi_gpu --num_processes 8 recipes/grow_with_trainer.py --output-dir runs/trainer-growth

The main process prints the held-out loss before and after each growth, the final held-out loss and the
widths, and the Trainer saves the final model (with its grown `qk_head_dims`) to OUTPUT_DIR/final.
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig

import torch
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as transformers_logging

from hf_grow import GrowthCallback, GrownGPT2Config, GrownGPT2LMHeadModel


def byte_windows(files: list[str], count: int, seq_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` random byte windows of the concatenated ``files``, labelled for next-token loss."""
    data = torch.tensor(list(b"".join(open(path, "rb").read() for path in files)), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len, (count,), generator=generator).tolist()
    return [{"input_ids": data[s : s + seq_len], "labels": data[s : s + seq_len]} for s in starts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--grow-at", type=int, nargs="+", default=[30], help="steps after which the heads grow")
    parser.add_argument("--p", type=int, default=8, help="query/key dims added per head at each growth")
    parser.add_argument("--qk-dim", type=int, default=8, help="query/key width per head at the start")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is available")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    train, held_out = files[0::2], files[1::8]
    torch.manual_seed(0)
    config = GrownGPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4, qk_head_dims=[args.qk_dim] * 2
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=3e-3,
        warmup_steps=max(1, args.steps // 10),
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=args.cpu,
        seed=0,
    )
    trainer = Trainer(
        model=GrownGPT2LMHeadModel(config),
        args=training_args,
        train_dataset=byte_windows(train, 64 * args.steps, args.seq_len, seed=1),
        eval_dataset=byte_windows(held_out, 256, args.seq_len, seed=2),
    )
    schedule = {step: args.p for step in args.grow_at}
    growth = GrowthCallback(schedule, statistics_batches=8, eval_batches=4, trainer=trainer)
    trainer.add_callback(growth)
    trainer.train()
    final_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        for step, report in growth.reports.items():
            print(
                f"step {step}: grew to qk_head_dims {report.qk_dims_after}, growth held-out loss "
                f"{report.eval_loss_before:.4f} -> {report.eval_loss_after:.4f}"
            )
        print(
            f"{training_args.world_size} process(es): final held-out loss {final_loss:.4f}, qk_head_dims "
            f"{trainer.model.config.qk_head_dims}, model saved to {os.path.join(args.output_dir, 'final')}"
        )


if __name__ == "__main__":
    main()
