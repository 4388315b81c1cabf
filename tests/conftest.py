"""Shared fixtures: small GPT-2s and real text (the Python standard library's own sources, byte-level)."""

from __future__ import annotations

import glob
import os
import sysconfig


# hf_grow's Triton kernels run in Triton's interpreter on this CPU. Set before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging


transformers_logging.set_verbosity_error()


def tiny_gpt2_config(**overrides) -> GPT2Config:
    settings = dict(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    settings.update(overrides)
    return GPT2Config(**settings)


@pytest.fixture(scope="session")
def stdlib_bytes() -> dict[str, torch.Tensor]:
    """Disjoint byte streams from the standard library's sources: train / stats / eval / test."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    assert len(files) > 100, "the standard library sources are the test corpus"
    splits = {"train": files[0:60:2], "stats": files[1:60:4], "eval": files[3:60:8], "test": files[7:60:8]}
    return {
        name: torch.tensor(list(b"".join(open(f, "rb").read() for f in chosen)), dtype=torch.long)
        for name, chosen in splits.items()
    }


def lm_batches(data: torch.Tensor, count: int, batch_size: int = 16, seq_len: int = 64, seed: int = 0) -> list[dict]:
    """``count`` batches of random windows of ``data``, labelled for next-token loss."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        input_ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids})
    return batches


def sum_of_outputs(model, batch) -> torch.Tensor:
    """A loss for any head class: the mean square of its first output (so every class has statistics)."""
    first = next(value for value in model(**batch).values() if isinstance(value, torch.Tensor))
    return first.float().square().mean()


def outputs_of(model, batch) -> list[torch.Tensor]:
    """Every tensor the model outputs on ``batch``, without gradients."""
    with torch.no_grad():
        outputs = model(**batch)
    return [value for value in outputs.values() if isinstance(value, torch.Tensor)]


def trained_on_text(model: torch.nn.Module, stdlib_bytes) -> torch.nn.Module:
    """``model`` trained for 200 AdamW steps on real text (so that its loss means something), in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in lm_batches(stdlib_bytes["train"], 200, seed=1):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="session")
def trained_gpt2(stdlib_bytes) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (d_k = 16) trained for 200 steps on real text."""
    torch.manual_seed(0)
    return trained_on_text(GPT2LMHeadModel(tiny_gpt2_config()), stdlib_bytes)


@pytest.fixture
def gpt2_copy(trained_gpt2) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(trained_gpt2.config)
    model.load_state_dict(trained_gpt2.state_dict())
    return model.eval()
