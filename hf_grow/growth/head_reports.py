"""What each head of a solved problem is expected to gain at a step size, for the growth report.

Everything comes from the solve's small tensors (`hf_grow.compact`, `layer_solve.AppendUpdate`) and the line
search's decomposition of the chosen step's core (decomposed here only where the search made none, e.g. at a given
step size); no (heads, d, d) tensor is formed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .. import linalg
from ..adapters import ArchitectureAdapter
from ..report import HeadReport
from .problem import GrowthProblem


def weight_norms(adapter: ArchitectureAdapter, model: PreTrainedModel, layer: int) -> Tensor:
    """Each head's ||Z||_F, Z = scaling W'_Q W'_K^T in model coordinates, from the factors' Gram matrices."""
    query, key = adapter.read_qk(adapter.attention_modules(model)[layer])
    key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
    scaling = adapter.scaling(model.config, layer, adapter.attention_scale_dims(model.config)[layer])
    return scaling * ((query.mT @ query) * (key.mT @ key)).sum(dim=(-2, -1)).clamp_min(0).sqrt()


def head_reports(
    solved: GrowthProblem, layer: int, step_size: float, decomposition: linalg.Decomposition | None = None
) -> list[HeadReport]:
    """Per head of ``layer`` at ``step_size``: the expected gain with and without growth, the first-order
    gain, the expected gain of each added dimension (from the whitened spectrum, whatever the truncation), the
    compact solve's certificate at that step, the scores' root mean square before and after it, and ||Z|| before
    it (after it: `weight_norms` of the weights written).
    ``decomposition``: the layer's `GrowthProblem.decomposition` at that step for its grown width, where already
    made ("refactor" growth). Computed by the layer's owner (`GrowthProblem.owner_computes`)."""
    return solved.owner_computes(layer, lambda: _head_reports(solved, layer, step_size, decomposition))


def _head_reports(
    solved: GrowthProblem, layer: int, step_size: float, decomposition: linalg.Decomposition | None
) -> list[HeadReport]:
    problem = solved.layers[layer]
    lam = solved.head_lams(step_size, layer)  # each head's own step, shape (heads,)
    qk_before, qk_after = problem.query.shape[-1], problem.qk_dim_after
    added = qk_after - qk_before
    size_before = problem.norms["whitened"][0]  # ||Z||^2 in the metric of C: the scores' mean square
    weight_before = problem.norms["frobenius"][0]  # ||Z||^2 in model coordinates
    with torch.no_grad():
        if solved.mode == "append":
            # The old form stays: the step is the rank-p update alone, and without growth there is none.
            update = problem.updates[solved.truncation]
            zeros = torch.zeros_like(lam)
            inner = lam * update.gradient_trace[:, added - 1] if added else zeros
            metric_sq = lam.square() * update.metric_sq[:, added - 1] if added else zeros
            expected, expected_kept, first_order = _decrease(inner, metric_sq, lam), zeros, -inner
            marginal = linalg.rank_gains(lam[:, None] * update.spectrum, lam)[:, :added]
            perturbation = zeros
            cross = 2 * lam * update.base_trace[:, added - 1] if added else zeros
            size_after = size_before + cross + metric_sq
        elif not bool(lam.any()):  # no step: every gain is 0 and the scores are the old ones, nothing to decompose
            zeros = torch.zeros_like(lam)
            expected = expected_kept = first_order = perturbation = zeros
            marginal = torch.zeros(len(lam), added, dtype=lam.dtype)
            size_after = size_before
        else:
            target = problem.target
            if decomposition is None:
                decomposition = solved.decomposition(layer, step_size, solved.truncation, qk_after)
            base = target.base_core
            grown = decomposition.truncate(qk_after).product
            size_after = torch.where(lam == 0, size_before, target.metric_norm_sq(grown))
            delta = grown - base
            delta_kept = decomposition.truncate(qk_before).product - base
            inner, inner_kept = target.gradient_inner(delta), target.gradient_inner(delta_kept)
            expected = _decrease(inner, target.metric_norm_sq(delta), lam)
            expected_kept = _decrease(inner_kept, target.metric_norm_sq(delta_kept), lam)
            first_order = -inner
            perturbation = target.relative_perturbation(
                lam, decomposition.singular_values, qk_after, solved.truncation
            )
            if solved.truncation != "whitened":
                decomposition = solved.decomposition(layer, step_size, "whitened")
            marginal = linalg.rank_gains(decomposition.singular_values, lam)[:, qk_before:qk_after]
    return [
        HeadReport(
            layer=layer,
            head=head,
            expected_gain=float(expected[head]),
            expected_gain_without_growth=float(expected_kept[head]),
            first_order_gain=float(first_order[head]),
            marginal_gains=[float(g) for g in marginal[head]],
            lam=float(lam[head]),
            compact_perturbation=float(perturbation[head]),
            score_rms_before=math.sqrt(float(size_before[head])),
            score_rms_after=math.sqrt(max(float(size_after[head]), 0.0)),
            weight_norm_before=math.sqrt(float(weight_before[head])),
        )
        for head in range(len(expected))
    ]


def _decrease(inner: torch.Tensor, metric_sq: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """`linalg.predicted_decrease` from its two terms: ``-(<M, Delta> + ||Delta||_C^2 / (2 lam))``, 0 at lam 0."""
    decrease = -(inner + metric_sq / (2 * lam.clamp_min(torch.finfo(lam.dtype).tiny)))
    return torch.where(lam == 0, torch.zeros_like(decrease), decrease)
