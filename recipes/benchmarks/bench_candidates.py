"""Benchmark: the held-out loss choosing the truncation and the step normalization (``"auto"``), against each
candidate alone and against the original notes' formula, on trained models across tokenizers and corpora.

Variants, at p = 8, statistics collected once per model:

- the four candidates alone: truncation whitened or frobenius x ``step_mode`` per_head or per_layer; the
  notes' formula is frobenius, per_layer (λ_l = t·‖Z_l‖_F/‖P_l‖_F, one t searched, as in bench_step_modes);
- ``default``: `grow_model`'s defaults, ``step_mode="auto"`` with whitened truncation: per_head and per_layer
  line-searched on 2/3 of the line-search batches, per_layer kept only if it also beats per_head on the other
  third (`hf_grow.growth.candidates`);
- ``auto`` (with ``--auto``): ``truncation="auto", step_mode="auto"``, the four candidates chosen the same way;
- ``--extra NAME=JSON ...``: `grow_model` with those options, e.g. ``'rtol3={"rtol": 1e-3}'`` or
  ``'rtol3-rot={"rtol": 1e-3, "rotate_factors": true}'`` (a candidate default); ``rotate_factors`` is dropped
  where the model grows by "append" (the Llama), which refuses it.

Models (``--models``): GPT-2s trained here on English text (the standard library's ``pydoc_data`` topics and its
docstrings) with a byte vocabulary (``bytes-en``) and with a 2,048-token byte-level BPE vocabulary trained on the
same text (``bpe-en``); a Llama (grouped-query attention, "append" growth) on the English bytes (``llama-en``);
bench_step_modes' byte-level GPT-2 A and 8-layer GPT-2 on the standard library's sources (``gpt2-A``,
``gpt2-deep``); the pretrained all-MiniLM-L6-v2 on its contrastive loss (``minilm``). Each model's pool of
held-out batches (text no training or statistics saw) is cut ``--splits`` ways into a line-search third and a
test two thirds; the table gives each variant's test-loss decrease.

    python recipes/benchmarks/bench_candidates.py --cache runs/candidates                  # all models
    python recipes/benchmarks/bench_candidates.py --quick --models bytes-en minilm         # smoke test
    python recipes/benchmarks/bench_candidates.py --cache runs/candidates --extra 'rtol3={"rtol": 1e-3}'
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import random
import sys
import time
import warnings

import torch
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from bench_growth import lm_batches, make_model, train  # noqa: E402
from bench_llama import llama_config  # noqa: E402
from bench_step_modes import gpt2_setups, line_search_and_test, minilm_setup  # noqa: E402
from sentence_pairs import stdlib_files  # noqa: E402

import hf_grow  # noqa: E402


VARIANTS = {
    "whitened/per_head": dict(truncation="whitened", step_mode="per_head"),
    "whitened/per_layer": dict(truncation="whitened", step_mode="per_layer"),
    "frobenius/per_head": dict(truncation="frobenius", step_mode="per_head"),
    "notes": dict(truncation="frobenius", step_mode="per_layer"),
    "default": {},
    "auto": dict(truncation="auto", step_mode="auto"),
}
SINGLE = [name for name in VARIANTS if name not in ("default", "auto")]
SEQ_LEN, BATCH_SIZE = 128, 16


def english_documents() -> dict[str, list[str]]:
    """English prose from the standard library, split by document (train 70%, statistics 10%, held-out 20%):
    pydoc's topic texts and every module, class and function docstring of at least 40 characters."""
    from pydoc_data.topics import topics

    documents = list(topics.values())
    for path in stdlib_files():
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring) >= 40:
                    documents.append(docstring)
    random.Random(0).shuffle(documents)
    cuts = [0, int(0.7 * len(documents)), int(0.8 * len(documents)), len(documents)]
    return {name: documents[cuts[i] : cuts[i + 1]] for i, name in enumerate(("train", "stats", "held_out"))}


def english_streams(
    vocabulary: str, documents: dict[str, list[str]] | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """Token streams of the English splits (``documents``, by default `english_documents`), as bytes or by a BPE of
    2,048 tokens trained on the ``"train"`` split (the same BPE whenever that split is the same)."""
    documents = documents or english_documents()
    if vocabulary == "bytes":
        encode = lambda texts: [token for text in texts for token in (text + "\n\n").encode()]  # noqa: E731
        size = 256
    else:
        from tokenizers import ByteLevelBPETokenizer

        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train_from_iterator(documents["train"], vocab_size=2048, min_frequency=2, show_progress=False)
        encode = lambda texts: [  # noqa: E731
            token for encoded in tokenizer.encode_batch([text + "\n\n" for text in texts]) for token in encoded.ids
        ]
        size = tokenizer.get_vocab_size()
    return {name: torch.tensor(encode(texts), dtype=torch.long) for name, texts in documents.items()}, size


def english_model(
    name: str, stream: torch.Tensor, size: int, steps: int, cache: str | None
) -> GPT2LMHeadModel | LlamaForCausalLM:
    """The GPT-2 (``bytes-en``, ``bpe-en``) or Llama (``llama-en``) trained ``steps`` steps on ``stream``; read from
    ``cache``/``name``-``steps`` when there, saved there after training otherwise."""
    folder = os.path.join(cache, f"{name}-{steps}") if cache else None
    model_class = LlamaForCausalLM if name == "llama-en" else GPT2LMHeadModel
    if folder and os.path.isdir(folder):
        print(f"# {name}: trained model from {folder}", flush=True)
        return model_class.from_pretrained(folder).eval()
    print(f"# training {name} ({len(stream):,} training tokens, vocabulary {size}) for {steps} steps", flush=True)
    if name == "llama-en":
        torch.manual_seed(3)
        model = LlamaForCausalLM(LlamaConfig(**llama_config(128, 4, 8, 4, 16, SEQ_LEN)))
    else:
        model = make_model(128, 4, 8, SEQ_LEN, seed=4 if name == "bpe-en" else 5)
        model.resize_token_embeddings(size)
    train(model, stream, steps, BATCH_SIZE, SEQ_LEN, seed=0, log_every=steps)
    if folder:
        model.save_pretrained(folder)
    return model


def english_setups(names: list[str], quick: bool, cache: str | None, steps: int):
    """(name, model, statistics batches, held-out pool, loss_fn) for the models trained on English text."""
    for name in names:
        streams, size = english_streams("bpe" if name == "bpe-en" else "bytes")
        model = english_model(name, streams["train"], size, steps, cache)
        stats = lm_batches(streams["stats"], 4 if quick else 12, BATCH_SIZE, SEQ_LEN, 1)
        pool = lm_batches(streams["held_out"], 6 if quick else 30, BATCH_SIZE, SEQ_LEN, 2)
        yield name, model, stats, pool, None


def run_model(
    name, model, stats_batches, pool, loss_fn, splits: int, p: int, variants: dict[str, dict]
) -> list[dict]:
    appended = "llama" in model.config.model_type  # rotary: grown by "append", which refuses rotate_factors
    tick = time.perf_counter()
    statistics = hf_grow.collect_statistics(model, stats_batches, hf_grow.get_adapter(model), loss_fn)
    print(f"# {name}: statistics {time.perf_counter() - tick:.0f} s", flush=True)
    rows = []
    for split in range(splits):
        eval_batches, test_batches = line_search_and_test(pool, split)
        test_before = hf_grow.evaluate_loss(model, test_batches, loss_fn=loss_fn)[0]
        row = dict(model=name, split=split, decrease={}, seconds={}, passes={})
        for variant, settings in variants.items():
            if appended:
                settings = {key: value for key, value in settings.items() if key != "rotate_factors"}
            tick = time.perf_counter()
            grown = hf_grow.grow_model(
                model, None, p=p, statistics=statistics, eval_dataloader=eval_batches, loss_fn=loss_fn,
                measure_realized_gains=False, **settings,
            )
            row["seconds"][variant] = time.perf_counter() - tick
            row["decrease"][variant] = test_before - hf_grow.evaluate_loss(grown, test_batches, loss_fn=loss_fn)[0]
            row["passes"][variant] = grown.growth_report.line_search_passes
            if variant == "default":
                report = grown.growth_report
                row["chosen"] = f"{report.truncation}/{report.step_mode}"
                row["selection"], row["margin"] = report.selection, report.selection_margin
                row["candidates"] = [vars(candidate) for candidate in report.candidates]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict], variants: list[str], extra: list[str]) -> None:
    print("\nTest-loss decrease (nats); in brackets the ratio to the notes' formula; the default's choice:")
    print(f"{'model':<12}{'split':>6}" + "".join(f"{name:>26}" for name in variants) + "  chosen (how)")
    for row in rows:
        notes = row["decrease"]["notes"]
        cells = "".join(
            f"{value:>17.5f} ({value / notes:>6.2f})" if notes > 0 else f"{value:>26.5f}"
            for value in row["decrease"].values()
        )
        print(f"{row['model']:<12}{row['split']:>6}{cells}  {row['chosen']} ({row['selection']})")
    means = {name: sum(row["decrease"][name] for row in rows) / len(rows) for name in variants}
    best_single = max(SINGLE, key=means.get)
    below = sum(row["decrease"]["default"] < row["decrease"]["notes"] for row in rows)
    oracle = sum(max(row["decrease"][name] for name in SINGLE) for row in rows) / len(rows)
    print("\nmean test decrease: " + ", ".join(f"{name} {value:.5f}" for name, value in means.items()))
    print(f"default below the notes' formula on {below}/{len(rows)} rows; default / best single variant "
          f"({best_single}) on average: {means['default'] / means[best_single]:.3f}; default / each row's best: "
          f"{means['default'] / oracle:.3f}")
    for name in extra:
        below = sum(row["decrease"][name] < row["decrease"]["notes"] for row in rows)
        least = min(row["decrease"][name] / row["decrease"]["notes"] for row in rows if row["decrease"]["notes"] > 0)
        print(f"{name}: below the notes' formula on {below}/{len(rows)} rows (least ratio {least:.2f}); / best "
              f"single variant on average {means[name] / means[best_single]:.3f}; / each row's best "
              f"{means[name] / oracle:.3f}; / the default {means[name] / means['default']:.3f}")
    passes = {name: sum(row["passes"][name] for row in rows) / len(rows) for name in variants}
    print("mean held-out passes beyond the one at step 0 (line_search_passes): "
          + ", ".join(f"{name} {value:.1f}" for name, value in passes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--splits", type=int, default=3, help="ways of cutting each held-out pool")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--cache", default=None, help="folder for the trained models (reused when there)")
    models = ("bytes-en", "bpe-en", "llama-en", "gpt2-A", "gpt2-deep", "minilm")
    parser.add_argument("--models", nargs="+", choices=models, default=list(models))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--steps", type=int, help="training steps of the models trained on English text (default "
                        "600, with --quick 40)")
    parser.add_argument("--auto", action="store_true", help="also truncation and step_mode both auto")
    parser.add_argument("--extra", nargs="*", default=[], metavar="NAME=JSON", help="grow_model with these options")
    args = parser.parse_args()
    variants = {name: settings for name, settings in VARIANTS.items() if name != "auto" or args.auto}
    extra = dict(entry.split("=", 1) for entry in args.extra)
    variants.update((name, json.loads(settings)) for name, settings in extra.items())
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
    print(f"# bench_candidates {datetime.date.today()} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s); p = {args.p}, {args.splits} "
          "splits of each held-out pool (1/3 line search, 2/3 test)", flush=True)
    english = [name for name in args.models if name.endswith("-en")]
    gpt2 = [name for name in args.models if name.startswith("gpt2-")]
    steps = args.steps or (40 if args.quick else 600)
    setups = [english_setups(english, args.quick, args.cache, steps)]
    if gpt2:
        setups.append(gpt2_setups(args.quick, os.path.join(args.cache, "step_modes") if args.cache else None, gpt2))
    if "minilm" in args.models:
        setups.append(minilm_setup(args.quick))
    rows = []
    for setup in setups:
        for setup_row in setup:
            rows += run_model(*setup_row, splits=args.splits, p=args.p, variants=variants)
            if args.json:
                with open(args.json, "w") as handle:
                    json.dump(rows, handle, indent=1)
    summarize(rows, list(variants), list(extra))


if __name__ == "__main__":
    main()
