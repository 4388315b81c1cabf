"""Benchmark: how much sharper the searched step makes attention, by how long the model was trained.

A small byte-level GPT-2 (n_embd 64 x 2 layers x 4 heads, d_k = 16) is trained for each of ``--steps`` on the
standard library's sources, then grown by `grow_model` at p = 8 (the default options) on statistics and held-out
batches of files it never saw. Per model the table gives the searched step, the held-out loss before and after,
the report's score size (`HeadReport.score_rms_before` / `score_rms_after`: each layer's root mean square of the
pre-softmax scores over pairs of statistics tokens; the largest ratio of the layers), the largest absolute scaled
score on a test batch, and the bfloat16 model's logits against the float32 model's (max abs difference, over the
test batch), before and after, and after with the grown Q/K factors rotated by the orthonormal DCT-II matrix
(``Q A``, ``K A``: the same scores, each product spread over every column instead of the truncation's singular
directions one per column; not what hf_grow writes, a comparison).

    python recipes/benchmarks/bench_score_scale.py                 # ~5 min on 2 CPU cores
    python recipes/benchmarks/bench_score_scale.py --steps 40 --quick
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_growth import lm_batches, load_bytes, make_model, split_files, train  # noqa: E402

import hf_grow  # noqa: E402
from hf_grow.adapters import get_adapter  # noqa: E402


def max_scaled_score(model, input_ids: torch.Tensor) -> float:
    """The largest |pre-softmax score| of any head on ``input_ids`` (GPT-2's scaling), over the layers."""
    adapter = get_adapter(model)
    scale_dims = adapter.attention_scale_dims(model.config)
    inputs: dict[int, torch.Tensor] = {}
    attentions = adapter.attention_modules(model)
    hooks = [adapter.qk_input_module(attention).register_forward_pre_hook(
        lambda module, args, layer=layer: inputs.setdefault(layer, args[0].detach())) for layer, attention in
        enumerate(attentions)]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    largest = 0.0
    for layer, attention in enumerate(attentions):
        query, key = adapter.read_qk(attention)
        hidden = inputs[layer].double()
        x = torch.cat([hidden, torch.ones_like(hidden[..., :1])], dim=-1)[:, None]  # (b, 1, s, d + 1)
        scores = adapter.scaling(model.config, layer, scale_dims[layer]) * (x @ query) @ (x @ key).mT
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        largest = max(largest, float(scores.masked_fill(~causal, 0).abs().max()))
    return largest


def bfloat16_error(model, input_ids: torch.Tensor) -> float:
    """Max |logits in bfloat16 - logits in float32| on ``input_ids``."""
    low = type(model)(model.config).to(torch.bfloat16).eval()
    low.load_state_dict(model.state_dict())
    with torch.no_grad():
        return float((model(input_ids=input_ids).logits - low(input_ids=input_ids).logits.float()).abs().max())


def rotated(model):
    """A copy of a grown model whose Q/K factors are rotated by the orthonormal DCT-II matrix: the same function."""
    model = copy.deepcopy(model)
    adapter = get_adapter(model)
    for attention in adapter.attention_modules(model):
        query, key = adapter.read_qk(attention)
        width = query.shape[-1]
        n = torch.arange(width, dtype=query.dtype)
        rotation = torch.cos(math.pi * (n[:, None] + 0.5) * n[None, :] / width) * math.sqrt(2 / width)
        rotation[:, 0] /= math.sqrt(2)
        adapter.write_qk(attention, query @ rotation, key @ rotation)
    return model


def row(steps: int, data: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    model = make_model(64, 2, 4, args.seq_len, seed=args.seed)
    train(model, data["train"], steps, args.batch_size, args.seq_len, seed=args.seed, log_every=10**9)
    model.eval()
    stats = lm_batches(data["stats"], args.stats_batches, args.batch_size, args.seq_len, seed=1)
    held_out = lm_batches(data["eval"], args.eval_batches, args.batch_size, args.seq_len, seed=2)
    probe = lm_batches(data["test"], 1, args.batch_size, args.seq_len, seed=3)[0]["input_ids"]
    grown = hf_grow.grow_model(model, stats, p=8, eval_dataloader=held_out)
    report = grown.growth_report
    ratios = [layer.score_rms_after / layer.score_rms_before for layer in report.layers]
    return {
        "steps": steps,
        "step": report.step_size,
        "loss": f"{report.eval_loss_before:.4f} -> {report.eval_loss_after:.4f}",
        "score rms": "  ".join(f"{layer.score_rms_before:.3g}->{layer.score_rms_after:.3g}" for layer in report.layers),
        "rms x": max(ratios),
        "max abs score": f"{max_scaled_score(model, probe):.3g} -> {max_scaled_score(grown, probe):.3g}",
        "bf16 error": f"{bfloat16_error(model, probe):.3f} -> {bfloat16_error(grown, probe):.3f}",
        "bf16 error, rotated": f"{bfloat16_error(rotated(grown), probe):.3f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="training steps, one model each")
    parser.add_argument("--quick", action="store_true", help="smoke test: two short trainings, fewer batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--stats-batches", type=int, default=None)
    parser.add_argument("--eval-batches", type=int, default=None)
    args = parser.parse_args()
    quick = {"steps": [20, 60], "stats_batches": 4, "eval_batches": 2}
    full = {"steps": [40, 100, 200, 500, 1000], "stats_batches": 8, "eval_batches": 4}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    files = split_files(args.seed)
    data = {name: load_bytes(paths) for name, paths in files.items()}
    rows = [row(steps, data, args) for steps in args.steps]
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}")
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for values in rows:
        cells = [f"{value:.4g}" if isinstance(value, float) else str(value) for value in values.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
