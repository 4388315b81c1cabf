"""The report's score size: how much sharper a step makes attention, measured where the statistics were."""

import copy

import pytest
import torch

from hf_grow import grow_in_training, grow_model, to_grown_model
from hf_grow.adapters import get_adapter
from hf_grow.card import grown_model_card

from conftest import lm_batches
from test_grown_llama import trained_llama


def attention_inputs(model, batches) -> dict[int, torch.Tensor]:
    """Every layer's attention input X' = [X | 1] over the tokens of ``batches`` (no padding), in float64."""
    adapter = get_adapter(model)
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [
        adapter.qk_input_module(attention).register_forward_pre_hook(
            lambda module, args, layer=layer: inputs.setdefault(layer, []).append(args[0].detach())
        )
        for layer, attention in enumerate(adapter.attention_modules(model))
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    augmented = {}
    for layer, chunks in inputs.items():
        hidden = torch.cat([chunk.flatten(0, -2) for chunk in chunks]).double()
        augmented[layer] = torch.cat([hidden, torch.ones_like(hidden[:, :1])], dim=1)
    return augmented


def layer_forms(model):
    """Each layer's (index, scaling, augmented queries, keys repeated to one per query head), in float64, from
    ``model``'s weights: Z of head i = scaling * query[i] @ key[i]^T."""
    adapter = get_adapter(model)
    scale_dims = adapter.attention_scale_dims(model.config)
    for layer, attention in enumerate(adapter.attention_modules(model)):
        query, key = (weight.double() for weight in adapter.read_qk(attention))
        key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
        yield layer, adapter.scaling(model.config, layer, scale_dims[layer]), query, key


def weight_norms(model) -> torch.Tensor:
    """(layers, heads): ||scaling W'_Q W'_K^T||_F from ``model``'s weights, the product formed."""
    return torch.stack([(scaling * query @ key.mT).flatten(1).norm(dim=1) for _, scaling, query, key
                        in layer_forms(model)])


def score_rms(model, inputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """(layers, heads): the root mean square of x'^T Z y' over every pair of the tokens, from ``model``'s weights
    (rotary positions left out: relative position 0)."""
    result = []
    for layer, scaling, query, key in layer_forms(model):
        x = inputs[layer][:, : query.shape[-2]]  # without the ones column where Q/K have no bias (Llama)
        scores = scaling * (x @ query) @ (x @ key).mT  # (heads, tokens, tokens): every pair
        result.append(scores.square().mean(dim=(-2, -1)).sqrt())
    return torch.stack(result)


@pytest.mark.parametrize("architecture", ["gpt2-refactor", "gpt2-append", "llama-gqa-append"])
def test_report_gives_the_scores_size_over_pairs_of_statistics_tokens(architecture, trained_gpt2, stdlib_bytes):
    """Each head's reported score RMS, before and at the chosen step, is that of the scores the old and the grown
    weights give every pair of the statistics' tokens (at a large step, so that a missing term would show), in
    both modes and with grouped keys."""
    model = trained_llama(stdlib_bytes, key_value_heads=2) if architecture.startswith("llama") else trained_gpt2
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=8, seq_len=32, seed=81)
    held_out = lm_batches(stdlib_bytes["test"], 1, batch_size=8, seq_len=32, seed=82)
    options = dict(p=4, step_size=1.0, eval_dataloader=held_out, measure_realized_gains=False)
    norms_before = weight_norms(model)
    if architecture == "gpt2-append":  # growth in training appends (grow_model refactors GPT-2), in place
        grown = to_grown_model(copy.deepcopy(model))
        report = grow_in_training(grown, None, batches, mode="append", **options)
    else:
        grown = grow_model(model, batches, **options)
        report = grown.growth_report
    assert report.mode == architecture.rsplit("-", 1)[1]
    inputs = attention_inputs(model, batches)
    expected_before, expected_after = score_rms(model, inputs), score_rms(grown, inputs)
    before = torch.tensor([[head.score_rms_before for head in layer.heads] for layer in report.layers]).double()
    after = torch.tensor([[head.score_rms_after for head in layer.heads] for layer in report.layers]).double()
    torch.testing.assert_close(before, expected_before, rtol=1e-5, atol=0)
    torch.testing.assert_close(after, expected_after, rtol=1e-4, atol=0)
    assert ((after / before - 1).abs() > 0.05).any()  # the step changed the scores' size: the check has power
    # ||Z|| in model coordinates, before (from the solve, the grown model being the input's in place in training)
    # and after (from the weights written)
    for reported, expected in (("weight_norm_before", norms_before), ("weight_norm_after", weight_norms(grown))):
        values = torch.tensor([[getattr(head, reported) for head in layer.heads] for layer in report.layers])
        torch.testing.assert_close(values.double(), expected, rtol=1e-5, atol=0)
    layer = report.layers[0]
    ratio = float(weight_norms(grown)[0].square().mean().sqrt() / norms_before[0].square().mean().sqrt())
    assert layer.weight_norm_ratio == pytest.approx(ratio, rel=1e-5) and abs(ratio - 1) > 0.05
    assert layer.score_rms_after == pytest.approx(float(expected_after[0].square().mean().sqrt()), rel=1e-4)
    shown = f"{layer.score_rms_before:.3g}->{layer.score_rms_after:.3g}"
    card = grown_model_card(report, grown.config.to_dict(), name="grown", base_model=None, tokenizer=False,
                            sentence=False)
    assert f"{shown}  x{ratio:.3g}" in report.summary() and f"| {shown} | x{ratio:.3g} |" in str(card)


def test_step_zero_keeps_the_scores_size_and_reports_without_decomposing(trained_gpt2, stdlib_bytes, monkeypatch):
    """At step 0 every head's gains are 0 and its scores the old ones; the reports decompose nothing (they
    decomposed every layer at step 0 and then set what it gave to 0)."""
    from hf_grow.growth import GrowthProblem

    decomposed = []
    decomposition = GrowthProblem.decomposition
    monkeypatch.setattr(GrowthProblem, "decomposition",
                        lambda self, *args, **kwargs: decomposed.append(args) or decomposition(self, *args, **kwargs))
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=8, seq_len=32, seed=83)
    for mode in ("refactor", "append"):
        report = grow_in_training(to_grown_model(copy.deepcopy(trained_gpt2)), None, batches, p=4, mode=mode,
                                  step_size=0.0)
        assert report.step_size == 0
        for layer in report.layers:
            assert [head.score_rms_after for head in layer.heads] == [head.score_rms_before for head in layer.heads]
            assert layer.weight_norm_ratio == pytest.approx(1, rel=1e-6)
            for head in layer.heads:
                assert head.expected_gain == head.expected_gain_without_growth == head.first_order_gain == 0
                assert head.marginal_gains == [0.0] * 4 and head.compact_perturbation == 0
    assert decomposed == []
