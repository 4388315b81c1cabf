"""Shared fixtures and helpers: small GPT-2s, real text (the Python standard library's own sources, byte-level), and
the checks that every grown causal LM must pass (generation, growing twice, loading without hf_grow)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import textwrap


# hf_grow's Triton kernels run in Triton's interpreter on this CPU. Set before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from safetensors.torch import save_file
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


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> list[float]:
    """One optimizer step per batch on the model's own loss, in train mode; the losses."""
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def trained_on_text(model: torch.nn.Module, stdlib_bytes) -> torch.nn.Module:
    """``model`` trained for 200 AdamW steps on real text (so that its loss means something), in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, optimizer, lm_batches(stdlib_bytes["train"], 200, seed=1))
    return model.eval()


def trainer_dataset(stdlib_bytes, count: int, seed: int) -> list[dict]:
    """``count`` sequences of real text labelled for next-token loss, one a row, for a `transformers.Trainer`."""
    return [
        {"input_ids": batch["input_ids"][0], "labels": batch["input_ids"][0]}
        for batch in lm_batches(stdlib_bytes["train"], count, batch_size=1, seed=seed)
    ]


def trainer_arguments(output_dir, batch_size: int = 4, gradient_accumulation_steps: int = 2,
                      learning_rate: float = 3e-3):
    """The growth-in-training tests' Trainer settings: 6 steps on the CPU with a linear schedule, every loss logged,
    a checkpoint at step 4 (after the growth at step 3)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=learning_rate,
        lr_scheduler_type="linear",
        save_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
    )


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


def run_without_hf_grow(script: str, tmp_path) -> None:
    """Run ``script`` in a fresh Python process in which hf_grow cannot be imported (as for someone who has only the
    saved folder and transformers), offline and with its own modules cache; it must run to its end."""
    prelude = """
        import sys
        sys.modules["hf_grow"] = None  # hf_grow is not importable in this process
        try:
            import hf_grow
        except ImportError:
            pass
        else:
            raise SystemExit("hf_grow should not be importable")
        """
    script = textwrap.dedent(prelude) + textwrap.dedent(script) + 'print("remote code ok")\n'
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote code ok" in result.stdout


#: A check for `assert_causal_lm_loads_without_hf_grow`: the loaded model's continuous batching (`generate_batch`)
#: gives greedy `generate`'s tokens for two prompts of different lengths.
CONTINUOUS_BATCHING_MATCHES_GENERATE = """
from transformers import ContinuousBatchingConfig, GenerationConfig
greedy = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
prompts = [expected["input_ids"][0, :12].tolist(), expected["input_ids"][1, :7].tolist()]
batching = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)
outputs = model.generate_batch(prompts, GenerationConfig(**greedy), continuous_batching_config=batching)
assert [output.prompt_ids for output in outputs.values()] == prompts, outputs
for output in outputs.values():
    ids = torch.tensor([output.prompt_ids])
    assert output.generated_tokens == model.generate(ids, **greedy)[0, ids.shape[1] :].tolist(), output
"""


def assert_causal_lm_loads_without_hf_grow(
    grown, folder, batch: dict, tmp_path, base_class: str, more_checks: str = ""
) -> None:
    """The saved ``folder`` of ``grown`` loads through trust_remote_code without hf_grow, as the same class from the
    folder's own modeling file, with exactly the logits of ``grown`` on ``batch``; AutoModel gives ``base_class``.
    ``more_checks``: more lines for that process, with ``model`` (in eval mode) and ``expected`` loaded."""
    expected = {"input_ids": batch["input_ids"], "logits": outputs_of(grown, batch)[1]}
    save_file(expected, tmp_path / "expected.safetensors")
    loading = f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoModelForCausalLM
        expected = load_file({str(tmp_path / "expected.safetensors")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == {type(grown).__name__!r}, type(model)
        assert not type(model).__module__.startswith("hf_grow"), type(model).__module__
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
        """
    base = f"""
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert type(base).__name__ == {base_class!r}
        """
    script = textwrap.dedent(loading) + textwrap.dedent(more_checks) + textwrap.dedent(base)
    run_without_hf_grow(script, tmp_path)


def assert_generation_is_unchanged(model, stdlib_bytes) -> None:
    """``model`` grown at step size 0 generates the same greedy tokens as ``model``, with and without the KV cache."""
    from hf_grow import grow_model

    grown = grow_model(model, lm_batches(stdlib_bytes["stats"], 2), p=8, step_size=0.0)
    prompt = lm_batches(stdlib_bytes["test"], 1, batch_size=2, seq_len=12, seed=6)[0]["input_ids"]
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **settings)
    assert torch.equal(grown.generate(prompt, **settings), expected)
    assert torch.equal(grown.generate(prompt, use_cache=False, **settings), expected)


def grown_twice(model, stdlib_bytes, p: int) -> tuple:
    """``model`` grown by ``p`` dims per head, then again by 4 (layer 0) and 8 (layer 1): the second growth keeps the
    class, starts from the first's held-out loss and does not raise it, and the once-grown model regrown at step
    size 0 keeps its outputs. Returns both grown models."""
    from hf_grow import grow_model

    batches = lm_batches(stdlib_bytes["stats"], 6)
    evaluation = lm_batches(stdlib_bytes["eval"], 2, seed=11)
    once = grow_model(model, batches, p=p, eval_dataloader=evaluation, measure_realized_gains=False)
    twice = grow_model(once, batches, p={0: 4, 1: 8}, eval_dataloader=evaluation, measure_realized_gains=False)
    assert type(twice) is type(once)
    assert twice.growth_report.eval_loss_before == pytest.approx(once.growth_report.eval_loss_after, abs=1e-5)
    assert twice.growth_report.eval_loss_after <= twice.growth_report.eval_loss_before
    exact = grow_model(once, batches, p=8, step_size=0.0)
    batch = evaluation[0]
    assert (outputs_of(once, batch)[1] - outputs_of(exact, batch)[1]).abs().max() <= 1e-4
    return once, twice
