"""Step sizes per layer (the original notes' lam_l = t * ||Z_l|| / ||P_l||) against one lam for all layers."""

import math

import pytest
import torch

from hf_grow import collect_statistics, get_adapter, linalg
from hf_grow.growth import GrowthProblem

from conftest import lm_batches


@pytest.fixture(scope="module")
def statistics(trained_gpt2, stdlib_bytes):
    return collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 4, seed=31), get_adapter(trained_gpt2))


def problem(model, statistics, truncation="whitened", step_mode="global") -> GrowthProblem:
    return GrowthProblem(model, get_adapter(model), statistics, [24, 24], truncation, 1e-6, "eigh", step_mode=step_mode)


def test_per_layer_steps_follow_each_layers_own_norms(trained_gpt2, statistics):
    for truncation in ("whitened", "frobenius"):
        solved = problem(trained_gpt2, statistics, truncation, "per_layer")
        for layer, part in enumerate(solved.layers):
            if truncation == "whitened":
                scores, step = (
                    float(linalg.whitened_norm_sq(matrix, part.metric).sum()) for matrix in (part.bilinear, part.direction)
                )
            else:
                scores, step = float(part.bilinear.square().sum()), float(part.direction.square().sum())
            assert solved.lam(0.3, layer) == pytest.approx(0.3 * math.sqrt(scores / step), rel=1e-12)
        # the layers' ratios differ, so one lam would under-step some of them
        assert solved.layer_lam_units[0] != pytest.approx(solved.layer_lam_units[1], rel=1e-3)


def test_global_steps_share_one_lam_from_all_heads(trained_gpt2, statistics):
    solved = problem(trained_gpt2, statistics)
    scores = sum(float(linalg.whitened_norm_sq(p.bilinear, p.metric).sum()) for p in solved.layers)
    step = sum(float(linalg.whitened_norm_sq(p.direction, p.metric).sum()) for p in solved.layers)
    assert solved.layer_lam_units == [solved.lam_unit] * 2
    assert solved.lam_unit == pytest.approx(math.sqrt(scores / step), rel=1e-12)


def test_each_layer_takes_its_own_lam(trained_gpt2, statistics):
    """The per-layer weights at step t are the global solve's weights at that layer's own lam."""
    per_layer, global_ = problem(trained_gpt2, statistics, step_mode="per_layer"), problem(trained_gpt2, statistics)
    weights = per_layer.weights(0.05)
    for layer in range(2):
        same_lam = 0.05 * per_layer.layer_lam_units[layer] / global_.lam_unit
        query, key = global_.weights(same_lam)[layer]
        torch.testing.assert_close(weights[layer][0] @ weights[layer][1].mT, query @ key.mT)


def test_step_zero_is_the_old_function_in_every_step_mode(trained_gpt2, statistics):
    at_zero = [problem(trained_gpt2, statistics, step_mode=mode).weights(0.0) for mode in ("global", "per_layer")]
    for layer in range(2):
        for a, b in zip(at_zero[0][layer], at_zero[1][layer]):
            assert torch.equal(a, b)


def test_unknown_step_mode_is_refused(trained_gpt2, statistics):
    with pytest.raises(ValueError, match="step_mode must be one of"):
        problem(trained_gpt2, statistics, step_mode="per_head")
