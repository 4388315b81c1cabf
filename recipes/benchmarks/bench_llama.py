"""Benchmark: grow small trained Llamas (rotary heads, with and without grouped-query attention) by content dims.

Part 1, one-shot growth: byte-level Llama LMs trained on the Python standard library's sources (files split
into disjoint train / statistics / line-search / test sets), grown by `hf_grow.grow_model` with default
arguments (mode "append": the rotary dims are kept, p unrotated content dims are solved per GQA group) for
p in {0, 8, 16}; p = 0 takes the same line search without adding dims (append then changes nothing, so its
decrease must be 0). Reports held-out and test loss before and after.

Part 2, learning speed: the same text with tiny rotary heads (head_dim 4, where the Q/K rank binds), trained
for ``steps`` with the same AdamW schedule: fixed small (no content dims), fixed large (8 content dims from the
start), and grown small -> large at ``grow_at`` by `grow_in_training` in mode "append" (solved), "zero"
(new keys zero) and "random" (small random new dims), over several seeds. Reports the final held-out loss and
the mean held-out loss over training (AUC), mean ± std over seeds.

    python recipes/benchmarks/bench_llama.py                  # --preset small, ~15 min on a shared 2-core CPU
    python recipes/benchmarks/bench_llama.py --preset tiny    # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics as pystats
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

from bench_growth import load_bytes, lm_batches, split_files
from hf_grow import GrownLlamaConfig, GrownLlamaForCausalLM, evaluate_loss, get_adapter, grow_in_training, grow_model


PRESETS = {
    "small": dict(
        # (name, hidden, layers, heads, key/value heads, head_dim, train steps)
        models=[("mha", 64, 2, 4, 4, 16, 300), ("gqa", 64, 2, 4, 2, 16, 300)],
        seq_len=64, batch_size=16, stats_batches=16, eval_batches=8, test_batches=16, ps=[0, 8, 16],
        speed=dict(hidden=64, layers=2, heads=4, head_dim=4, key_value_heads=2, p=8, steps=300, grow_at=100,
                   eval_every=50, seeds=2, seq_len=64, batch_size=16),
    ),
    "tiny": dict(
        models=[("gqa", 64, 2, 4, 2, 16, 60)],
        seq_len=64, batch_size=8, stats_batches=4, eval_batches=3, test_batches=4, ps=[0, 8],
        speed=dict(hidden=64, layers=2, heads=4, head_dim=4, key_value_heads=2, p=8, steps=40, grow_at=20,
                   eval_every=10, seeds=1, seq_len=64, batch_size=8),
    ),
}


def llama_config(hidden: int, layers: int, heads: int, key_value_heads: int, head_dim: int, seq_len: int) -> dict:
    return dict(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=key_value_heads, head_dim=head_dim,
        max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def make_optimizer(
    model: torch.nn.Module, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) * 0.9 + 0.1,
    )
    return optimizer, schedule


def train_steps(model, optimizer, schedule, data, steps: range, batch_size: int, seq_len: int, seed: int) -> None:
    model.train()
    for step in steps:
        generator = torch.Generator().manual_seed(10_000 * (seed + 1) + step)
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()


def one_shot(preset: dict, data: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    seq_len, batch_size = preset["seq_len"], preset["batch_size"]
    stats = lm_batches(data["stats"], preset["stats_batches"], batch_size, seq_len, seed=1)
    held_out = lm_batches(data["eval"], preset["eval_batches"], batch_size, seq_len, seed=2)
    test = lm_batches(data["test"], preset["test_batches"], batch_size, seq_len, seed=3)
    for name, hidden, layers, heads, key_value_heads, head_dim, steps in preset["models"]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**llama_config(hidden, layers, heads, key_value_heads, head_dim, seq_len)))
        optimizer, schedule = make_optimizer(model, steps)
        train_steps(model, optimizer, schedule, data["train"], range(steps), batch_size, seq_len, seed=0)
        adapter = get_adapter(model)
        test_before = evaluate_loss(model, test, adapter)[0]
        for p in preset["ps"]:
            growth = p if p else {layer: 0 for layer in range(layers)}  # p = 0: the same search, no dims added
            grown = grow_model(model, stats, p=growth, eval_dataloader=held_out, measure_realized_gains=False)
            report = grown.growth_report
            test_after = evaluate_loss(grown, test, adapter)[0]
            rows.append(dict(
                model=f"{name} (d={hidden}, {layers}x{heads} heads / {key_value_heads} kv, head_dim {head_dim})", p=p,
                params=report.parameters_added, held_out_before=report.eval_loss_before,
                held_out_decrease=report.eval_loss_before - report.eval_loss_after, test_before=test_before,
                test_decrease=test_before - test_after, step=report.step_size,
            ))
            print(rows[-1], flush=True)
    return rows


def speed_run(speed: dict, data: dict[str, torch.Tensor], variant: str, seed: int) -> list[float]:
    """Held-out losses every ``eval_every`` steps (and at the end) of one variant and seed."""
    seq_len, batch_size, steps = speed["seq_len"], speed["batch_size"], speed["steps"]
    settings = llama_config(speed["hidden"], speed["layers"], speed["heads"], speed["key_value_heads"],
                            speed["head_dim"], seq_len)
    nope = speed["p"] if variant == "fixed-large" else 0
    torch.manual_seed(seed)
    model = GrownLlamaForCausalLM(GrownLlamaConfig(**settings, qk_nope_dims=[nope] * speed["layers"]))
    optimizer, schedule = make_optimizer(model, steps)
    held_out = lm_batches(data["eval"], 4, batch_size, seq_len, seed=2)
    adapter = get_adapter(model)
    curve = []
    for start in range(0, steps, speed["eval_every"]):
        if start == speed["grow_at"] and variant in ("append", "zero", "random"):
            stats = lm_batches(data["stats"], 6, batch_size, seq_len, seed=100 + seed)
            search = lm_batches(data["stats"], 3, batch_size, seq_len, seed=200 + seed)
            grow_in_training(model, optimizer, stats, speed["p"], mode=variant, eval_dataloader=search, seed=seed)
        stop = min(steps, start + speed["eval_every"])
        train_steps(model, optimizer, schedule, data["train"], range(start, stop), batch_size, seq_len, seed)
        curve.append(evaluate_loss(model, held_out, adapter)[0])
    return curve


def learning_speed(preset: dict, data: dict[str, torch.Tensor]) -> list[dict]:
    speed = preset["speed"]
    rows = []

    def spread(values: list[float]) -> float:
        return pystats.stdev(values) if len(values) > 1 else 0.0

    for variant in ("fixed-small", "fixed-large", "append", "zero", "random"):
        curves = [speed_run(speed, data, variant, seed) for seed in range(speed["seeds"])]
        finals = [curve[-1] for curve in curves]
        areas = [sum(curve) / len(curve) for curve in curves]
        rows.append(dict(variant=variant, final=pystats.mean(finals), final_std=spread(finals),
                         auc=pystats.mean(areas), auc_std=spread(areas)))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--part", choices=["both", "one-shot", "speed"], default="both")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more than 1 is slower on shared cores)")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths")
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    files = split_files(0)
    data = {name: load_bytes(paths) for name, paths in files.items()}
    print(f"# {datetime.date.today()}  torch {torch.__version__}  {platform.machine()}  preset {args.preset}")
    if args.part in ("both", "one-shot"):
        rows = one_shot(preset, data)
        print("\n| model | p | params added | held-out before | held-out decrease | test before | test decrease "
              "| step |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['p']} | {r['params']:,} | {r['held_out_before']:.4f} | "
                  f"{r['held_out_decrease']:.4f} | {r['test_before']:.4f} | {r['test_decrease']:.4f} | "
                  f"{r['step']:.3g} |")
    if args.part in ("both", "speed"):
        rows = learning_speed(preset, data)
        speed = preset["speed"]
        print(f"\nhead_dim {speed['head_dim']} (+{speed['p']} content dims), grown at step {speed['grow_at']} of "
              f"{speed['steps']}, {speed['seeds']} seeds, held-out loss")
        print("\n| variant | final | mean over training (AUC) |")
        print("|---|---|---|")
        for r in rows:
            final, area = f"{r['final']:.4f} ± {r['final_std']:.4f}", f"{r['auc']:.4f} ± {r['auc_std']:.4f}"
            print(f"| {r['variant']} | {final} | {area} |")


if __name__ == "__main__":
    main()
