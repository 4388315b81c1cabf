"""Statistics: M is dLoss/dZ, padding labelled -100 contributes nothing, the model is left exactly as it was."""

import pytest
import torch
from transformers import GPT2DoubleHeadsModel, GPT2LMHeadModel

from hf_grow import collect_statistics, evaluate_loss, get_adapter
from hf_grow.adapters.base import split_heads
from hf_grow.statistics import CPU_REFERENCE_MAX_LENGTH, choose_method, default_query_block, score_gradient_products
from hf_grow.statistics.kernels import COLLECTING

from conftest import lm_batches, tiny_gpt2_config


def padded_batch(batch: dict, pad_from: int, rows: int) -> dict:
    mask = torch.ones_like(batch["input_ids"])
    mask[:rows, pad_from:] = 0
    return {
        "input_ids": batch["input_ids"].masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": batch["input_ids"].masked_fill(mask == 0, -100),
    }


def test_gradient_statistic_is_dloss_dz(gpt2_copy, stdlib_bytes):
    """dLoss/dW'_Q = scaling * M W'_K and dLoss/dW'_K = scaling * M^T W'_Q, against plain autograd, for the
    loss over every label of two batches with different numbers of them (what `evaluate_loss` measures)."""
    model = gpt2_copy
    adapter = get_adapter(model)
    batches = [
        padded_batch(lm_batches(stdlib_bytes["stats"], 1, seed=3)[0], pad_from=40, rows=5),
        padded_batch(lm_batches(stdlib_bytes["stats"], 1, seed=4)[0], pad_from=10, rows=12),
    ]
    weights = [adapter.loss_weight(model, batch) for batch in batches]
    assert weights[0] != weights[1]
    statistics = collect_statistics(model, batches, adapter, compute_dtype=torch.float64)
    assert statistics.loss_weight == sum(weights)
    model.zero_grad()
    (sum(model(**batch).loss * weight for batch, weight in zip(batches, weights)) / sum(weights)).backward()
    for layer, attention in enumerate(adapter.attention_modules(model)):
        query, key = adapter.read_qk(attention)
        scaling = adapter.scaling(model.config, layer, query.shape[-1])
        width = query.shape[0] * query.shape[-1]
        weight_grad, bias_grad = attention.c_attn.weight.grad.double(), attention.c_attn.bias.grad.double()
        query_grad = split_heads(weight_grad[:, :width], bias_grad[:width], query.shape[0])
        key_grad = split_heads(weight_grad[:, width : 2 * width], bias_grad[width : 2 * width], query.shape[0])
        gradient = statistics.mean_gradient(layer)
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
    """One sequence alone, and the same sequence right-padded: identical C and M.

    The model runs in float64: in float32 the two shapes' matrix products round differently (by ~4e-8 with
    one BLAS thread), which is not padding leaking in.
    """
    model = gpt2_copy.double()
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
    collect_statistics(
        model, [batch], get_adapter(model), loss_fn=lambda m, b: losses.append(m(**b).loss) or losses[-1]
    )
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
    before = parameter_snapshot(model)
    calls = []

    def failing_loss(m, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return m(**batch).loss

    with pytest.raises(KeyboardInterrupt):
        collect_statistics(
            model, lm_batches(stdlib_bytes["stats"], 3), get_adapter(model), loss_fn=failing_loss, tf32=True
        )
    assert model.config._attn_implementation == "sdpa"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not COLLECTING
    assert torch.get_float32_matmul_precision() == "highest"
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_submodule_modes_and_gradient_mode_are_kept(gpt2_copy, stdlib_bytes):
    """A dropout the user turned off inside a training model stays off; callers under no_grad still get
    statistics (backward needs gradients on), while inference_mode, which no backward survives, is refused."""
    model = gpt2_copy.train()
    model.transformer.drop.eval()
    modes = {name: module.training for name, module in model.named_modules()}
    batches = lm_batches(stdlib_bytes["stats"], 2)
    with torch.no_grad():
        reference = collect_statistics(model, batches, get_adapter(model))
    assert reference.num_tokens == 2 * 16 * 64 and torch.isfinite(reference.gradients[0]).all()
    assert {name: module.training for name, module in model.named_modules()} == modes
    evaluate_loss(model, batches)
    assert {name: module.training for name, module in model.named_modules()} == modes
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside torch.inference_mode"):
        collect_statistics(model, batches, get_adapter(model))


@pytest.mark.parametrize("method", ["reference", "chunked"])
def test_float16_gradients_do_not_underflow(trained_gpt2, stdlib_bytes, method):
    """A float16 model's backward of a mean loss over 4096 tokens underflows part of G (M was 2.0% off here
    with the reference method, 1.3% with chunked, up to 38% on other models); backward of the loss scaled to
    the token count keeps M within float16's own precision of the float64 statistics."""
    model = GPT2LMHeadModel(trained_gpt2.config)
    model.load_state_dict(trained_gpt2.state_dict())
    model = model.half().eval()
    batches = lm_batches(stdlib_bytes["stats"], 1, batch_size=64, seed=7)
    exact = collect_statistics(trained_gpt2, batches, get_adapter(trained_gpt2), compute_dtype=torch.float64)
    half = collect_statistics(model, batches, get_adapter(model), method=method)
    for layer in range(2):
        error = (half.gradients[layer] - exact.gradients[layer]).norm() / exact.gradients[layer].norm()
        assert error < 5e-3, (layer, float(error))


def test_tokens_of_multiple_choice_inputs_are_all_counted(stdlib_bytes):
    """(batch, choices, length) inputs without an attention_mask: every token counts in C, and the length
    checked against the model's positions is the last dimension."""
    torch.manual_seed(0)
    model = GPT2DoubleHeadsModel(tiny_gpt2_config()).eval()
    input_ids = stdlib_bytes["stats"][: 2 * 3 * 20].reshape(2, 3, 20)
    statistics = collect_statistics(model, [{"input_ids": input_ids, "labels": input_ids}], get_adapter(model))
    assert statistics.num_tokens == 2 * 3 * 20
    flat = input_ids.reshape(6, 20)
    ones = torch.ones(6, 20, 1)
    for layer, module in enumerate(model.transformer.h[:1]):
        with torch.no_grad():
            hidden = model.transformer(flat, output_hidden_states=True).hidden_states[layer]
            inputs = torch.cat([module.ln_1(hidden), ones], dim=-1).reshape(-1, 65).double()
        torch.testing.assert_close(statistics.second_moments[layer], inputs.mT @ inputs, rtol=1e-5, atol=1e-6)
    too_long = torch.zeros(2, 3, 65, dtype=torch.long)
    with pytest.raises(ValueError, match="holds sequences of 65 tokens, but the model has 64 positions"):
        collect_statistics(model, [{"input_ids": too_long, "labels": too_long}], get_adapter(model))


def test_a_batch_product_is_added_in_the_sums_dtype_and_checked_entry_by_entry_only_when_its_sum_is_not_finite():
    """M += a batch's product without a converted copy: the sums of adding float64 copies, bit for bit; a float16
    product whose entries are finite but whose float16 sum overflows is accepted, one with a NaN or an Inf is
    not, and names the layer and batch."""
    from hf_grow.statistics.collector import Sums

    generator = torch.Generator().manual_seed(0)
    sums = Sums(2, 3, 5, [1], False, torch.device("cpu"), float16=True)
    reference = torch.zeros(3, 5, 5, dtype=torch.float64)
    for _ in range(3):
        product = torch.randn(3, 5, 5, generator=generator)
        sums.add_gradient(1, product)
        reference += product.to(torch.float64)
    assert torch.equal(sums.gradients[1], reference)
    large = torch.full((3, 5, 5), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(large.sum())
    sums.add_gradient(1, large)
    assert torch.equal(sums.gradients[1], reference + 60000.0)
    for bad in (float("nan"), float("inf")):
        product = torch.zeros(3, 5, 5)
        product[2, 1, 3] = bad
        with pytest.raises(FloatingPointError, match="layer 1 at batch 0 .float16 overflows"):
            sums.add_gradient(1, product)


def test_non_finite_loss_names_the_batch(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    before = parameter_snapshot(model)
    calls = []

    def loss_nan_on_second_batch(m, batch):
        calls.append(1)
        return m(**batch).loss * (float("nan") if len(calls) == 2 else 1.0)

    with pytest.raises(FloatingPointError, match="batch 1"):
        collect_statistics(
            model, lm_batches(stdlib_bytes["stats"], 3), get_adapter(model), loss_fn=loss_nan_on_second_batch
        )
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
    headless = model.transformer  # GPT2Model: its outputs have no loss field at all
    with pytest.raises(ValueError, match="no loss.*a model without a head"):
        collect_statistics(headless, [{"input_ids": torch.zeros(2, 4, dtype=torch.long)}], get_adapter(headless))
    all_padding = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "attention_mask": torch.zeros(2, 4, dtype=torch.long),
    }
    with pytest.raises(ValueError, match="padding"):
        collect_statistics(model, [all_padding], adapter, loss_fn=lambda m, b: m(**b).logits.sum() * 0)


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


def masked_causal_batch(seed: int = 0, batch_size: int = 4, seq_len: int = 20) -> dict:
    """Random tokens with a right-padded and a left-padded row. The first real token of the left-padded row has
    no label: its prediction would come from a pad position, whose attention is fully masked (eager and sdpa
    disagree on what such a row computes, so the comparison would measure transformers, not hf_grow)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 256, (batch_size, seq_len), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, seq_len - 6 :] = 0
    mask[2, :5] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[2, 5] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("architecture", ["gpt2", "bert"])
@pytest.mark.parametrize("query_block", [None, 3, 7])
def test_chunked_path_equals_the_reference(architecture, query_block):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    if architecture == "gpt2":
        model = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    else:
        config = BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        model = BertForMaskedLM(config).eval()
    batches = [masked_causal_batch(seed) for seed in range(2)]
    adapter = get_adapter(model)
    reference = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, method="reference")
    chunked = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, query_block=query_block)
    assert chunked.num_tokens == reference.num_tokens
    for layer in range(2):
        # The model itself runs in float32 (sdpa vs eager rounding, ~1e-7); the statistics in float64.
        for ours, theirs in (
            (chunked.gradients, reference.gradients),
            (chunked.second_moments, reference.second_moments),
        ):
            assert (ours[layer] - theirs[layer]).norm() <= 1e-5 * theirs[layer].norm()


def attention_problem(mask_kind: str, length: int = 21, qk_dim: int = 5, width: int = 19, seed: int = 2):
    """Random attention tensors, a mask and G = dLoss/dS from autograd of plain softmax attention (float64).

    The boolean and additive masks are causal with padded keys in one sequence and, in the other, left
    padding: its first queries attend to no key at all (no score gradient under a boolean mask; under an
    additive one, the gradient of a uniform row).
    """
    generator = torch.Generator().manual_seed(seed)
    batch, heads, v_dim = 2, 3, 4

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query, key = randn(batch, heads, length, qk_dim), randn(batch, heads, length, qk_dim)
    value, grad_output = randn(batch, heads, length, v_dim), randn(batch, heads, length, v_dim)
    inputs = randn(batch, length, width)
    allowed = torch.ones(batch, 1, length, length, dtype=torch.bool)
    if mask_kind != "none":
        allowed = torch.ones(length, length).tril().bool().expand(batch, 1, length, length).clone()
        if mask_kind != "causal":
            allowed[1, :, :, length - 5 :] = False
            allowed[0, :, :, :3] = False
    mask = {
        "causal": None,
        "none": None,
        "boolean": allowed,
        "additive": torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -1e30),
    }[mask_kind]
    scaling = 0.37
    scores = (query @ key.mT * scaling).requires_grad_(True)
    # A boolean mask replaces scores (no gradient where it is False); an additive one passes the gradient on.
    masked = scores + mask if mask_kind == "additive" else scores.masked_fill(~allowed, torch.finfo(torch.float64).min)
    output = torch.softmax(masked, dim=-1) @ value
    (output * grad_output).sum().backward()  # a loss whose dLoss/dO is `grad_output`
    expected = torch.einsum("bqd,bhqk,bke->hde", inputs, scores.grad, inputs)
    return (query, key, value, grad_output, inputs, mask, scaling, mask_kind == "causal"), expected



@pytest.mark.parametrize("mask_kind", ["causal", "boolean", "additive", "none"])
def test_block_products_equal_autograd(mask_kind):
    """score_gradient_products against G = dLoss/dS from autograd of a plain softmax attention (float64)."""
    problem, expected = attention_problem(mask_kind, length=11, width=7, seed=1)
    (query, key, value, grad_output, inputs, mask, scaling, causal) = problem
    for block in (1, 4, 11):
        products = score_gradient_products(*problem, block, torch.float64)
        torch.testing.assert_close(products, expected, rtol=1e-10, atol=1e-12)
    # bfloat16 attention tensors, computed in float32: within 1e-3 of the float64 result on the same values.
    rounded = [t.to(torch.bfloat16) for t in (query, key, value, grad_output, inputs)]
    exact = score_gradient_products(*[t.double() for t in rounded], mask, scaling, causal, 4, torch.float64)
    fast = score_gradient_products(*rounded, mask, scaling, causal, 4, torch.float32)
    assert (fast.double() - exact).norm() <= 1e-3 * exact.norm()


def test_chunked_path_on_a_bfloat16_model_is_finite_and_close(trained_gpt2, stdlib_bytes):
    """On a bfloat16 model both paths see the model's own bf16 rounding (~1e-2 relative); they agree to it."""
    model = GPT2LMHeadModel(trained_gpt2.config).to(torch.bfloat16)
    model.load_state_dict(trained_gpt2.state_dict())
    batches = lm_batches(stdlib_bytes["stats"], 2)
    chunked = collect_statistics(model, batches, get_adapter(model))
    reference = collect_statistics(model, batches, get_adapter(model), method="reference")
    for layer in range(2):
        assert torch.isfinite(chunked.gradients[layer]).all()
        error = (chunked.gradients[layer] - reference.gradients[layer]).norm()
        assert error <= 3e-2 * reference.gradients[layer].norm()


def test_bad_method_and_block_are_clear_errors(gpt2_copy, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 1)
    with pytest.raises(ValueError, match="method must be one of"):
        collect_statistics(gpt2_copy, batches, get_adapter(gpt2_copy), method="flash")
    for query_block in (0, 2.5, "8"):
        with pytest.raises(ValueError, match="query_block must be a positive int"):
            collect_statistics(gpt2_copy, batches, get_adapter(gpt2_copy), query_block=query_block)
    with pytest.raises(ValueError, match="loss_fn must be a function"):
        collect_statistics(gpt2_copy, batches, get_adapter(gpt2_copy), loss_fn="mse")


def test_inputs_given_as_embeddings(gpt2_copy, stdlib_bytes):
    """Batches of ``inputs_embeds`` (no embedding layer call) give the statistics of the same ids."""
    model = gpt2_copy
    batches = lm_batches(stdlib_bytes["stats"], 2)
    with torch.no_grad():
        embedded = [
            {**{k: v for k, v in b.items() if k != "input_ids"}, "inputs_embeds": model.transformer.wte(b["input_ids"])}
            for b in batches
        ]
    by_ids = collect_statistics(model, batches, get_adapter(model), compute_dtype=torch.float64)
    by_embeddings = collect_statistics(model, embedded, get_adapter(model), compute_dtype=torch.float64)
    assert by_embeddings.num_tokens == by_ids.num_tokens
    for layer in range(2):
        torch.testing.assert_close(
            by_embeddings.second_moments[layer], by_ids.second_moments[layer], rtol=1e-12, atol=0
        )
        torch.testing.assert_close(by_embeddings.gradients[layer], by_ids.gradients[layer], rtol=1e-9, atol=1e-12)


def left_padded_batch_with_every_label(seed: int = 0) -> dict:
    """Left-padded sequences with their first real token labelled: the pad position before it, whose query
    may attend to no key, predicts it (sdpa gives that query a zero output, eager a uniform one)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 256, (3, 12), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[0, :8] = 0
    mask[1, :5] = 0
    labels = input_ids.clone()
    labels[0, :7], labels[1, :4] = -100, -100  # the last pad position of each row keeps its label
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def losses_seen(model, batch, method) -> tuple[float, str]:
    losses = []
    statistics = collect_statistics(
        model, [batch], get_adapter(model), method=method, loss_fn=lambda m, b: losses.append(m(**b).loss) or losses[-1]
    )
    return float(losses[0].detach()), statistics.method


def test_every_method_follows_the_models_attention_where_a_query_sees_no_key():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    batches = [left_padded_batch_with_every_label(seed) for seed in range(2)]
    adapter = get_adapter(model)
    with torch.no_grad():
        sdpa_loss = float(model(**batches[0]).loss)
        model.set_attn_implementation("eager")
        eager_loss = float(model(**batches[0]).loss)
        model.set_attn_implementation("sdpa")
    assert abs(sdpa_loss - eager_loss) > 1e-4  # the two attentions disagree on this batch
    for method in ("chunked", "reference", "auto"):
        loss, used = losses_seen(model, batches[0], method)
        assert loss == pytest.approx(sdpa_loss, rel=1e-5) and used == ("reference" if method == "auto" else method)
    reference = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, method="reference")
    chunked = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, method="chunked")
    for layer in range(2):
        for ours, theirs in (
            (chunked.gradients, reference.gradients),
            (chunked.second_moments, reference.second_moments),
        ):
            assert (ours[layer] - theirs[layer]).norm() <= 1e-5 * theirs[layer].norm()
    model.set_attn_implementation("eager")  # an eager model: "auto" keeps its uniform rows
    loss, used = losses_seen(model, batches[0], "auto")
    assert loss == pytest.approx(eager_loss, rel=1e-5) and used == "reference"


def test_auto_picks_by_device_and_length():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_method(cpu, CPU_REFERENCE_MAX_LENGTH, eager_model=False) == "reference"
    assert choose_method(cpu, CPU_REFERENCE_MAX_LENGTH + 1, eager_model=False) == "chunked"
    assert choose_method(cuda, 128, eager_model=False) == "chunked"
    assert choose_method(cuda, 4096, eager_model=True) == "reference"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_positions=CPU_REFERENCE_MAX_LENGTH + 8, n_layer=1)).eval()
    short, long = (
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, CPU_REFERENCE_MAX_LENGTH + 8)))
    )
    assert collect_statistics(model, [short], get_adapter(model)).method == "reference"
    assert collect_statistics(model, [short, long], get_adapter(model)).method == "chunked+reference"


def test_default_query_block_fits_the_device_budget():
    """Block tensors (b, h, block, s) of at most 8 MiB of float32 on a CPU (cache-sized), 256 MiB on a GPU, but
    no blocks of fewer than 32 queries (their overhead outweighs the memory saved)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for device, budget in ((cpu, 2**21), (cuda, 2**26)):
        block = default_query_block(device, 2, 8, 4096)
        assert budget // 2 < 2 * 8 * block * 4096 <= budget
    assert default_query_block(cpu, 1, 2, 16) == 16  # never more than the sequence
    assert default_query_block(cpu, 64, 64, 2**16) == 32


def test_second_moment_is_the_float64_sum_of_the_statistics_pass_inputs(gpt2_copy, stdlib_bytes):
    """C is X'^T X' summed in float64 (the products too, not only the sum over batches): to float64 precision of
    the very inputs the statistics pass gave the attention, not within float32 rounding (rtol 1e-4 elsewhere)."""
    model = gpt2_copy
    adapter = get_adapter(model)
    batches = lm_batches(stdlib_bytes["stats"], 2, seed=4)
    inputs = []
    attention = adapter.attention_modules(model)[1]
    handle = adapter.qk_input_module(attention).register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    try:
        statistics = collect_statistics(model, batches, adapter)
    finally:
        handle.remove()
    hidden = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs]).double()
    augmented = torch.cat([hidden, torch.ones(len(hidden), 1, dtype=torch.float64)], dim=1)
    expected = augmented.T @ augmented
    tolerance = 1e-12 * expected.abs().max().item()
    torch.testing.assert_close(statistics.second_moments[1].double(), expected, rtol=1e-12, atol=tolerance)
