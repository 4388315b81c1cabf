"""Offline quickstart: train a small GPT-2 and its tokenizer on local text, then grow it with `hf-grow`.

The corpus is the Python standard library's own source files, present on every machine, so this runs with
no network. Under a minute on 2 CPU cores (README: measured times):

    python recipes/quickstart.py --workdir runs/quickstart

It writes `WORKDIR/small-gpt2` (the trained model and tokenizer) and `WORKDIR/small-gpt2-grown` (the grown
model, its tokenizer, growth_report.json and a model card), and prints the held-out loss before and after.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_grow import cli


STDLIB = sysconfig.get_paths()["stdlib"]


def stdlib_files(pattern: str = "*.py") -> list[str]:
    return sorted(glob.glob(os.path.join(STDLIB, pattern)))


def train_tokenizer(files: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``files``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()  # decode() gives the text back (not "Ġ"-marked tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def train_small_gpt2(
    folder: str | os.PathLike,
    files: list[str],
    steps: int = 200,
    vocab_size: int = 1000,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    seq_len: int = 64,
    batch_size: int = 16,
    seed: int = 0,
) -> float:
    """Train a tokenizer and a small GPT-2 on ``files``, save both to ``folder``; returns the last batch loss."""
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(files, vocab_size)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=max(128, seq_len), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.tensor(tokenizer("".join(Path(f).read_text(errors="replace") for f in files))["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator).tolist()
        batch = torch.stack([ids[s : s + seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/quickstart")
    parser.add_argument("--steps", type=int, default=200, help="training steps of the small GPT-2")
    parser.add_argument("--p", type=int, default=8, help="query/key dimensions to add per head")
    args = parser.parse_args()
    # A model this small gains nothing from a second thread, and on a busy machine threads wait on each other
    # (a training step took 6-9x longer with two threads than with one on a loaded 2-core machine).
    torch.set_num_threads(1)

    workdir = Path(args.workdir)
    base, grown = workdir / "small-gpt2", workdir / "small-gpt2-grown"
    train_files = stdlib_files()[:40]
    loss = train_small_gpt2(base, train_files, steps=args.steps)
    print(f"trained {base} for {args.steps} steps (last batch loss {loss:.3f})")
    growth_text = os.path.join(STDLIB, "json", "*.py")  # text the model was not trained on
    arguments = [str(base), "--p", str(args.p), "--data", growth_text, "--seq-len", "64", "--output-dir", str(grown),
                 "--overwrite"]
    print("$ hf-grow", shlex.join(arguments))
    sys.exit(cli.main(arguments))  # the command itself, in this process (no second start of Python and torch)


if __name__ == "__main__":
    main()
