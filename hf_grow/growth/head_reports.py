"""What each head of a solved problem is expected to gain at a step size, for the growth report."""

from __future__ import annotations

import torch

from .. import linalg
from ..report import HeadReport
from .problem import GrowthProblem


def head_reports(solved: GrowthProblem, layer: int, step_size: float) -> list[HeadReport]:
    """Per head of ``layer`` at ``step_size``: the expected gain with and without growth, the first-order
    gain, and the expected gain of each added dimension (from the whitened spectrum, whatever the truncation)."""
    problem = solved.layers[layer]
    lam = solved.head_lams(step_size, layer)  # each head's own step, shape (heads,)
    qk_before = problem.query.shape[-1]
    with torch.no_grad():
        if solved.mode == "append":
            # The old form stays: the step is the rank-p update alone, and without growth there is none.
            delta = torch.zeros_like(problem.direction)
            if problem.qk_dim_after > qk_before:
                delta = linalg.rescaled_to_step(solved.unit_update(layer), lam).product
            delta_kept = torch.zeros_like(delta)
            _, direction = solved.whitened_pair(layer, "whitened")
            added = problem.qk_dim_after - qk_before
            if problem.groups < problem.query.shape[0]:  # each head's share of its group's singular values
                shares = linalg.grouped_truncation(-direction, None, max(added, 1), problem.groups).singular_values
                spectrum = lam[:, None] * shares
            else:
                spectrum = solved.decompose(
                    ("unit", layer, "whitened"), -lam[:, None, None] * direction, problem.metric, max(added, 1)
                ).singular_values
            marginal = linalg.rank_gains(spectrum, lam)[:, :added]
        else:
            decomposition = solved.decomposition(layer, step_size, solved.truncation)
            grown, kept = decomposition.truncate(problem.qk_dim_after), decomposition.truncate(qk_before)
            bilinear = problem.bilinear
            delta, delta_kept = grown.product - bilinear, kept.product - bilinear
            if solved.truncation != "whitened":
                decomposition = solved.decomposition(layer, step_size, "whitened")
            spectrum = decomposition.singular_values
            marginal = linalg.rank_gains(spectrum, lam)[:, qk_before : problem.qk_dim_after]
        gradient = solved.gradient(layer)
        expected = linalg.predicted_decrease(gradient, delta, problem.metric, lam)
        expected_kept = linalg.predicted_decrease(gradient, delta_kept, problem.metric, lam)
        first_order = -(gradient * delta).sum(dim=(-2, -1))
    return [
        HeadReport(
            layer=layer,
            head=head,
            expected_gain=float(expected[head]),
            expected_gain_without_growth=float(expected_kept[head]),
            first_order_gain=float(first_order[head]),
            marginal_gains=[float(g) for g in marginal[head]],
            lam=float(lam[head]),
        )
        for head in range(len(expected))
    ]
