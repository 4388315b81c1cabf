"""Statistics: M is dLoss/dZ, padding contributes nothing, the model is left exactly as it was."""

import pytest
import torch
from transformers import GPT2LMHeadModel

from hf_grow import collect_statistics, get_adapter
from hf_grow.adapters.base import split_heads
from hf_grow.statistics import STATISTICS_ATTENTION

from conftest import lm_batches


def padded_batch(batch: dict, pad_from: int, rows: int) -> dict:
    mask = torch.ones_like(batch["input_ids"])
    mask[:rows, pad_from:] = 0
    return {
        "input_ids": batch["input_ids"].masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": batch["input_ids"].masked_fill(mask == 0, -100),
    }


def test_gradient_statistic_is_dloss_dz(gpt2_copy, stdlib_bytes):
    """dLoss/dW'_Q = scaling * M W'_K and dLoss/dW'_K = scaling * M^T W'_Q, against plain autograd."""
    model = gpt2_copy
    adapter = get_adapter(model)
    batch = padded_batch(lm_batches(stdlib_bytes["stats"], 1, seed=3)[0], pad_from=40, rows=5)
    statistics = collect_statistics(model, [batch], adapter, compute_dtype=torch.float64)
    model.zero_grad()
    model(**batch).loss.backward()
    for layer, attention in enumerate(adapter.attention_modules(model)):
        query, key = adapter.read_qk(attention)
        scaling = adapter.scaling(model.config, layer, query.shape[-1])
        width = query.shape[0] * query.shape[-1]
        weight_grad, bias_grad = attention.c_attn.weight.grad.double(), attention.c_attn.bias.grad.double()
        query_grad = split_heads(weight_grad[:, :width], bias_grad[:width], query.shape[0])
        key_grad = split_heads(weight_grad[:, width : 2 * width], bias_grad[width : 2 * width], query.shape[0])
        gradient = statistics.gradients[layer]
        torch.testing.assert_close(scaling * gradient @ key, query_grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(scaling * gradient.mT @ query, key_grad, rtol=1e-5, atol=1e-7)


def test_second_moment_counts_only_real_tokens(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    adapter = get_adapter(model)
    batch = padded_batch(lm_batches(stdlib_bytes["stats"], 1, seed=4)[0], pad_from=10, rows=16)
    inputs = {}
    handle = model.transformer.h[1].ln_1.register_forward_hook(lambda m, a, out: inputs.setdefault("x", out))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    real = inputs["x"][batch["attention_mask"] == 1].double()
    augmented = torch.cat([real, torch.ones(len(real), 1, dtype=torch.float64)], dim=1)
    statistics = collect_statistics(model, [batch], adapter, compute_dtype=torch.float64)
    assert statistics.num_tokens == 16 * 10
    # The stats pass runs its own eager attention: float32 rounding differs from sdpa by ~1e-6 relative.
    torch.testing.assert_close(statistics.second_moments[1], augmented.T @ augmented, rtol=1e-4, atol=1e-4)


def test_padding_contributes_exactly_nothing(gpt2_copy, stdlib_bytes):
    """One sequence alone, and the same sequence right-padded: identical C and M."""
    model = gpt2_copy
    adapter = get_adapter(model)
    sequence = lm_batches(stdlib_bytes["stats"], 1, batch_size=1, seq_len=24, seed=5)[0]["input_ids"]
    alone = {"input_ids": sequence, "attention_mask": torch.ones_like(sequence), "labels": sequence}
    padded_ids = torch.cat([sequence, torch.full((1, 8), 7)], dim=1)
    mask = torch.cat([torch.ones_like(sequence), torch.zeros(1, 8, dtype=torch.long)], dim=1)
    padded = {"input_ids": padded_ids, "attention_mask": mask, "labels": padded_ids.masked_fill(mask == 0, -100)}
    first = collect_statistics(model, [alone], adapter, compute_dtype=torch.float64)
    second = collect_statistics(model, [padded], adapter, compute_dtype=torch.float64)
    assert first.num_tokens == second.num_tokens == 24
    for layer in range(2):
        torch.testing.assert_close(first.second_moments[layer], second.second_moments[layer], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(first.gradients[layer], second.gradients[layer], rtol=1e-6, atol=1e-9)


def test_statistics_attention_is_masked_like_the_model(gpt2_copy, stdlib_bytes):
    """Under the statistics attention, the loss is the model's own: the causal mask is applied."""
    model = gpt2_copy
    batch = padded_batch(lm_batches(stdlib_bytes["stats"], 1, seed=6)[0], pad_from=30, rows=4)
    with torch.no_grad():
        expected = model(**batch).loss
    losses = []
    collect_statistics(model, [batch], get_adapter(model), loss_fn=lambda m, b: losses.append(m(**b).loss) or losses[-1])
    torch.testing.assert_close(losses[0].detach(), expected, rtol=1e-5, atol=1e-6)


def parameter_snapshot(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_model_is_left_as_it_was(gpt2_copy, stdlib_bytes):
    model = gpt2_copy.train()
    before = parameter_snapshot(model)
    collect_statistics(model, lm_batches(stdlib_bytes["stats"], 2), get_adapter(model))
    assert model.training and model.config._attn_implementation == "sdpa"
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_restored_on_error(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    calls = []

    def failing_loss(m, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return m(**batch).loss

    with pytest.raises(KeyboardInterrupt):
        collect_statistics(model, lm_batches(stdlib_bytes["stats"], 3), get_adapter(model), loss_fn=failing_loss)
    assert model.config._attn_implementation == "sdpa" != STATISTICS_ATTENTION
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not model.training


def test_non_finite_loss_names_the_batch(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    before = parameter_snapshot(model)
    calls = []

    def loss_nan_on_second_batch(m, batch):
        calls.append(1)
        return m(**batch).loss * (float("nan") if len(calls) == 2 else 1.0)

    with pytest.raises(FloatingPointError, match="batch 1"):
        collect_statistics(model, lm_batches(stdlib_bytes["stats"], 3), get_adapter(model), loss_fn=loss_nan_on_second_batch)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_bad_data_is_a_clear_error(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    adapter = get_adapter(model)
    with pytest.raises(ValueError, match="no batches"):
        collect_statistics(model, [], adapter)
    with pytest.raises(TypeError, match="dict batches"):
        collect_statistics(model, [torch.zeros(2, 4, dtype=torch.long)], adapter)
    with pytest.raises(ValueError, match="no loss"):
        collect_statistics(model, [{"input_ids": torch.zeros(2, 4, dtype=torch.long)}], adapter)
    all_padding = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="padding"):
        collect_statistics(model, [all_padding], adapter, loss_fn=lambda m, b: m(**b).logits.sum() * 0)
    batch = lm_batches(stdlib_bytes["stats"], 1)[0]
    with pytest.raises(ValueError, match="call the model once per batch"):
        collect_statistics(model, [batch], adapter, loss_fn=lambda m, b: m(**b).loss + m(**b).loss)


def test_bfloat16_model_gives_float64_statistics(trained_gpt2, stdlib_bytes):
    model = GPT2LMHeadModel(trained_gpt2.config).to(torch.bfloat16)
    model.load_state_dict(trained_gpt2.state_dict())
    statistics = collect_statistics(model, lm_batches(stdlib_bytes["stats"], 2), get_adapter(model))
    reference = collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 2), get_adapter(trained_gpt2))
    for layer in range(2):
        assert statistics.gradients[layer].dtype == torch.float64
        assert torch.isfinite(statistics.gradients[layer]).all()
        error = (statistics.second_moments[layer] - reference.second_moments[layer]).norm()
        assert error / reference.second_moments[layer].norm() < 0.05
