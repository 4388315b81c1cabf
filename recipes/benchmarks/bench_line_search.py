"""Benchmark: what the line search costs and finds on trained models: held-out passes, chosen step, held-out and
test loss of `grow_model` with three candidate settings (the default; Frobenius truncation with steps per layer,
the notes' formula; truncation="auto"), on bench_candidates' GPT-2s (BPE and byte vocabularies) and Llama trained
on English prose of the standard library, three held-out/test cuts each (a third for the line search).

Prints one JSON row per run and writes them to the file given; run it on two commits and compare the rows.

    python recipes/benchmarks/bench_line_search.py rows.json --cache runs/candidates     # ~20 min, one thread
"""

import argparse
import json
import random
import warnings

import torch
from transformers.utils import logging as transformers_logging

from bench_candidates import english_setups

import hf_grow

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("output")
parser.add_argument("--cache", help="folder of bench_candidates' trained models (reused when there)")
parser.add_argument("--steps", type=int, default=300, help="training steps of the models")
args = parser.parse_args()
transformers_logging.set_verbosity_error()
warnings.filterwarnings("ignore", message="query/key widths .* are not multiples of 8")
torch.set_num_threads(1)
out = []
for name in ["bpe-en", "bytes-en", "llama-en"]:
    _, model, stats, pool, loss_fn = next(english_setups([name], False, args.cache, args.steps))
    statistics = hf_grow.collect_statistics(model, stats, hf_grow.get_adapter(model), loss_fn)
    for split in range(3):
        order = list(range(len(pool)))
        random.Random(split).shuffle(order)
        cut = len(pool) // 3
        held_out, test = [pool[i] for i in order[:cut]], [pool[i] for i in order[cut:]]
        for settings in ({}, {"step_mode": "per_layer", "truncation": "frobenius"}, {"truncation": "auto"}):
            grown = hf_grow.grow_model(model, None, p=8, statistics=statistics, eval_dataloader=held_out,
                                       measure_realized_gains=False, **settings)
            report = grown.growth_report
            row = dict(model=name, split=split, settings=str(settings), step=report.step_size,
                       held=report.eval_loss_after, test=hf_grow.evaluate_loss(grown, test)[0],
                       passes=report.line_search_passes)
            print(json.dumps(row), flush=True)
            out.append(row)
with open(args.output, "w") as handle:
    json.dump(out, handle, indent=1)
