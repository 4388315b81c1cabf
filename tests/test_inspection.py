"""inspect_growth: first-order gains per head from the statistics alone, consistent with grow_model's report."""

import copy
import dataclasses
import json

import pytest
import torch
from transformers import GPT2LMHeadModel

from hf_grow import (
    GrowthInspection,
    GrowthStatistics,
    collect_statistics,
    get_adapter,
    grow_model,
    inspect_growth,
    linalg,
)

from conftest import lm_batches


@pytest.fixture(scope="module")
def data(stdlib_bytes):
    return {
        "stats": lm_batches(stdlib_bytes["stats"], 8, seed=31),
        "eval": lm_batches(stdlib_bytes["eval"], 3, seed=32),
    }


@pytest.fixture(scope="module")
def statistics(trained_gpt2, data):
    return collect_statistics(trained_gpt2, data["stats"], get_adapter(trained_gpt2))


def test_gain_rates_are_the_small_step_limit_of_the_truncation():
    """linalg: sigma^2 / (2 lam) of the added ranks, and the gain without growth, divided by lam, tend to the
    rates as lam -> 0, also for a head whose Z has lower rank than its width."""
    generator = torch.Generator().manual_seed(0)
    d, width, heads = 12, 3, 4
    inputs = (
        torch.randn(500, d, dtype=torch.float64, generator=generator)
        @ torch.randn(d, d, dtype=torch.float64, generator=generator)
    )
    metric = linalg.metric_from_second_moment(inputs.T @ inputs / 500)
    query = torch.randn(heads, d, width, dtype=torch.float64, generator=generator)
    key = torch.randn(heads, d, width, dtype=torch.float64, generator=generator)
    query[0, :, -1] = 0  # rank 2 in a width of 3: one spare dimension
    bilinear = linalg.bilinear_form(query, key, 0.5)
    gradient = torch.randn(heads, d, d, dtype=torch.float64, generator=generator)
    direction = linalg.solve_direction(gradient, metric)
    rates = linalg.growth_gain_rates(bilinear, direction, metric, width)
    assert rates.marginal.shape == (heads, d - width)
    assert (rates.marginal[:, :-1] >= rates.marginal[:, 1:]).all()
    for lam, tolerance in ((1e-3, 1e-3), (1e-5, 1e-5)):
        decomposition = linalg.decompose(bilinear - lam * direction, metric, "svd")
        marginal = linalg.rank_gains(decomposition.singular_values, lam)[:, width:] / lam
        kept = decomposition.truncate(width).product - bilinear
        without_growth = linalg.predicted_decrease(gradient, kept, metric, lam) / lam
        assert (marginal - rates.marginal).abs().max() <= tolerance * rates.marginal.max()
        assert (without_growth - rates.without_growth).abs().max() <= tolerance * rates.without_growth.max()


def test_inspection_matches_grow_model_at_a_small_step(trained_gpt2, statistics):
    """The report's marginal gains at step size t, divided by t, are the inspection's gains (t -> 0)."""
    before = {name: tensor.clone() for name, tensor in trained_gpt2.state_dict().items()}
    inspection = inspect_growth(trained_gpt2, statistics=statistics, max_dims=8)
    assert all(torch.equal(tensor, before[name]) for name, tensor in trained_gpt2.state_dict().items())
    step = 1e-6
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=step, solver="svd",
                        measure_realized_gains=False).growth_report
    for grown_layer, layer in zip(report.layers, inspection.layers):
        assert layer.qk_dim == 16 and len(layer.heads) == 4
        for grown_head, head in zip(grown_layer.heads, layer.heads):
            assert torch.allclose(
                torch.tensor(grown_head.marginal_gains) / step, torch.tensor(head.marginal_gains), rtol=1e-2
            )
            assert grown_head.expected_gain_without_growth / step == pytest.approx(head.gain_without_growth, rel=1e-2)
        assert layer.marginal_gains == pytest.approx([sum(g) for g in zip(*(h.marginal_gains for h in layer.heads))])


def test_inspection_ranks_heads_as_grow_model_does_at_its_step(trained_gpt2, statistics, data):
    """At the step the line search picks, the realized marginal gains are smaller than first order, but heads
    and layers rank the same way (what a budget allocation needs)."""
    inspection = inspect_growth(trained_gpt2, statistics=statistics, max_dims=8)
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=data["eval"],
                        measure_realized_gains=False).growth_report
    assert report.step_size > 0

    def ranks(values: list[float]) -> torch.Tensor:
        return torch.tensor(values).argsort().argsort().double()

    chosen = [sum(head.marginal_gains) for layer in report.layers for head in layer.heads]
    first_order = [sum(head.marginal_gains) for layer in inspection.layers for head in layer.heads]
    correlation = torch.corrcoef(torch.stack([ranks(chosen), ranks(first_order)]))[0, 1]
    assert correlation > 0.8
    by_layer = [
        sum(layer_gains) for layer_gains in ([sum(h.marginal_gains) for h in layer.heads] for layer in report.layers)
    ]
    assert ranks(by_layer).tolist() == ranks([layer.gain(8) for layer in inspection.layers]).tolist()


def test_inspection_table_json_and_plot(trained_gpt2, statistics, tmp_path):
    inspection = inspect_growth(trained_gpt2, statistics=statistics, max_dims=6)
    assert inspection.columns() == [1, 2, 4, 6]
    table = inspection.table()
    assert len(table.splitlines()) == 2 + 2 * (1 + 4) and "+6" in table.splitlines()[1]
    inspection.to_json_file(tmp_path / "inspection.json")
    assert GrowthInspection.from_dict(json.loads((tmp_path / "inspection.json").read_text())) == inspection
    inspection.plot(tmp_path / "spectra.png")
    assert (tmp_path / "spectra.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspection_collects_once_and_refuses_other_weights(trained_gpt2, statistics, data, tmp_path):
    direct = inspect_growth(trained_gpt2, data["stats"], max_dims=4)
    assert dataclasses.asdict(direct) == dataclasses.asdict(
        inspect_growth(trained_gpt2, statistics=statistics, max_dims=4)
    )
    statistics.save(tmp_path / "stats.safetensors")
    loaded = GrowthStatistics.load(tmp_path / "stats.safetensors")
    assert torch.equal(loaded.weights, statistics.weights)
    other = GPT2LMHeadModel(trained_gpt2.config).eval()  # same architecture, other (random) weights
    with pytest.raises(ValueError, match="other weights"):
        inspect_growth(other, statistics=loaded)
    with pytest.raises(ValueError, match="other weights"):
        grow_model(other, None, p=8, step_size=0.0, statistics=loaded)
    # One matrix changed by 5% (as a few fine-tuning steps do) is another model, though the whole sample's norm,
    # mostly the LayerNorm gains', moves by less than 1%.
    tuned = copy.deepcopy(trained_gpt2)
    with torch.no_grad():
        tuned.transformer.h[0].attn.c_attn.weight.mul_(1.05)
    with pytest.raises(ValueError, match="other weights"):
        grow_model(tuned, None, p=8, step_size=0.0, statistics=loaded)
    # The same checkpoint in bfloat16 or float16 is the same model.
    for dtype in (torch.bfloat16, torch.float16):
        grow_model(copy.deepcopy(trained_gpt2).to(dtype), None, p=8, step_size=0.0, statistics=loaded)
    with pytest.raises(ValueError, match="max_dims"):
        inspect_growth(trained_gpt2, statistics=statistics, max_dims=0)


@pytest.mark.parametrize("step_mode", ["per_layer", "per_head"])
def test_inspection_ranks_at_the_truncations_units_as_a_budget_does(trained_gpt2, statistics, data, step_mode):
    """A Frobenius budget ranks at the plain-norm lam units; the inspection ranked at the whitened ones whatever the
    truncation (allocations apart on a 4-layer GPT-2, a BERT and a Llama: a review, 2026-11-30)."""
    from hf_grow.budget import allocate_budget

    allocated = {}
    for truncation in ("whitened", "frobenius"):
        inspection = inspect_growth(trained_gpt2, statistics=statistics, max_dims=32, step_mode=step_mode,
                                    truncation=truncation)
        gains = [torch.tensor([sum(head.marginal_gains[k] for head in layer.heads) for k in range(32)])
                 for layer in inspection.layers]
        allocated[truncation] = [allocate_budget(gains, budget, 1) for budget in range(1, 33)]
        for budget in (3, 17):
            report = grow_model(trained_gpt2, None, budget=budget, statistics=statistics, truncation=truncation,
                                step_mode=step_mode, step_size=0.0, measure_realized_gains=False).growth_report
            added = [layer.qk_dim_after - layer.qk_dim_before for layer in report.layers]
            assert added == allocate_budget(gains, budget, 1), (truncation, budget)
    assert allocated["whitened"] != allocated["frobenius"]  # the table ranked at the whitened units for both
