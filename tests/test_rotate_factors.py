"""`rotate_factors`: refactored Q/K factors written times the DCT-II matrix, the same scores in other columns."""

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_grow import GrowthConfig, grow_model, linalg
from hf_grow.cli import build_parser

from conftest import lm_batches, outputs_of
from test_grown_llama import tiny_llama_config


def test_dct_rotation_is_orthogonal_and_mixes_every_column():
    rotation = linalg.dct_rotation(24)
    torch.testing.assert_close(rotation.mT @ rotation, torch.eye(24, dtype=torch.float64), rtol=0, atol=1e-14)
    assert ((rotation.abs() > 1e-3).sum(dim=1) >= 16).all()  # each singular direction spread over 16+ columns


def test_rotated_factors_compute_the_grown_function_in_other_columns(trained_gpt2, stdlib_bytes):
    """At a step, the scores and the report are those of the singular-direction factors; the weights are the
    rotated ones (every column a mix, not one singular direction each). A searched step may differ where
    held-out losses tie to their rounding: the search sees the weights written."""
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=8, seq_len=32, seed=91)
    held_out = lm_batches(stdlib_bytes["eval"], 2, batch_size=8, seq_len=32, seed=92)
    options = dict(p=8, step_size=0.01, eval_dataloader=held_out, measure_realized_gains=False)
    plain = grow_model(trained_gpt2, batches, **options)
    rotated = grow_model(trained_gpt2, batches, rotate_factors=True, **options)
    assert rotated.growth_report.eval_loss_after == pytest.approx(plain.growth_report.eval_loss_after, abs=1e-6)
    for before, after in zip(outputs_of(plain, held_out[0]), outputs_of(rotated, held_out[0])):
        torch.testing.assert_close(after, before, rtol=0, atol=2e-5)
    weights = [model.transformer.h[1].attn.c_attn.weight for model in (plain, rotated)]
    assert (weights[0] - weights[1]).abs().max() > 1e-2
    for plain_layer, rotated_layer in zip(plain.growth_report.layers, rotated.growth_report.layers):
        assert rotated_layer.weight_norm_ratio == pytest.approx(plain_layer.weight_norm_ratio, rel=1e-5)
    assert rotated.growth_report.config["rotate_factors"] is True


def test_append_growth_refuses_rotated_factors_before_any_work(stdlib_bytes):
    model = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match=r"rotate_factors rewrites refactored Q/K factors; LlamaForCausalLM grows "
                                         r"by 'append', .*: leave rotate_factors off \('append' is its only mode\)"):
        grow_model(model, iter(()), p=8, rotate_factors=True)  # refused before the (empty) data is read


def test_the_command_line_takes_rotated_factors():
    assert build_parser().parse_args(["gpt2", "--rotate-factors", "--output-dir", "out"]).rotate_factors is True
    with pytest.raises(ValueError, match="rotate_factors must be True or False"):
        GrowthConfig(rotate_factors="yes")
