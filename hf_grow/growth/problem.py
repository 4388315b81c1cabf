"""The solve problem: statistics and Q/K weights in, the weights of the grown widths at any step size out.

Per layer, Z = scaling * W'_Q W'_K^T, the direction P = C^+ M C^+ and the metric of C (see `hf_grow.linalg`),
all in float64; per step, the rank-(d_k + p) truncation of Z - lam P factored into wider W_Q, W_K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .. import linalg
from ..adapters import ArchitectureAdapter
from ..config import DEFAULT_STEP_MODE, STEP_MODES
from ..statistics import GrowthStatistics


#: "refactor": the rank-(d_k + p) truncation of Z - lam P rewrites all Q/K weights. "append": the old Q/K
#: weights are kept and the p new dimensions hold the best rank-p approximation of the step -lam P.
MODES = ("refactor", "append")
QKWeights = dict[int, tuple[Tensor, Tensor]]


@dataclass
class LayerProblem:
    """Everything the step of one layer needs, in float64.

    Z is formed from the weights when needed and M is read from the statistics (`head_reports`): held for
    every layer, each would be another (heads, d, d) float64 tensor, 3.2 GB for GPT-2 medium's 24 layers.
    """

    query: Tensor
    key: Tensor
    scaling_before: float
    scaling_after: float
    qk_dim_after: int
    direction: Tensor
    metric: linalg.Metric

    @property
    def groups(self) -> int:
        """Key heads: fewer than query heads under grouped-query attention (each shared by a group)."""
        return self.key.shape[0]

    @property
    def bilinear(self) -> Tensor:
        """Z = scaling * W'_Q W'_K^T of the old weights, each query head with its group's key head. (With rotary
        position embeddings this is the form at relative position 0, a measure of the scores' size.)"""
        key = self.key.repeat_interleave(self.query.shape[0] // self.groups, dim=0)
        return linalg.bilinear_form(self.query, key, self.scaling_before)


class GrowthProblem:
    """The solved statistics of a model: Q/K weights for any step size, and what they are expected to gain."""

    def __init__(
        self,
        model: PreTrainedModel,
        adapter: ArchitectureAdapter,
        statistics: GrowthStatistics,
        qk_dims_after: list[int],
        truncation: str,
        rtol: float,
        solver: str,
        mode: str = "refactor",
        step_mode: str = DEFAULT_STEP_MODE,
    ):
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {step_mode!r}")
        self.statistics = statistics
        self.truncation = truncation
        self.solver = solver
        self.mode = mode
        self._unit_updates: dict[int, linalg.Factorization] = {}
        self._whitened_pairs: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self._starts: dict[tuple, Tensor] = {}
        #: The decomposition methods the solver ran (``"auto"`` resolves per size).
        self.methods_used: set[str] = set()
        self.layers: list[LayerProblem] = []
        config = model.config
        with torch.no_grad():
            for layer, attention in enumerate(adapter.attention_modules(model)):
                query, key = adapter.read_qk(attention)
                qk_before = query.shape[-1]
                scaling_before = adapter.scaling(config, layer, qk_before)
                device = statistics.gradients[layer].device
                query, key = query.to(device), key.to(device)
                inputs = query.shape[-2]
                second_moment = statistics.mean_second_moment(layer)[:inputs, :inputs]
                metric = linalg.metric_from_second_moment(second_moment, rtol=rtol)
                self.layers.append(
                    LayerProblem(
                        query=query,
                        key=key,
                        scaling_before=scaling_before,
                        scaling_after=adapter.scaling(config, layer, qk_dims_after[layer]),
                        qk_dim_after=qk_dims_after[layer],
                        direction=linalg.solve_direction(self.gradient(layer, inputs), metric),
                        metric=metric,
                    )
                )
        self.set_step_mode(step_mode)

    def set_step_mode(self, step_mode: str) -> None:
        """Take steps the ``step_mode`` way (`hf_grow.config.STEP_MODES`) from now on, without solving again: only
        the lam units, the head factors and the layer scales depend on it."""
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {step_mode!r}")
        self.step_mode = step_mode
        #: The model-wide lam per unit step size (with steps per layer, the root mean square of the layers'),
        #: each layer's own, and each head's relative to its layer's (ones but with ``step_mode="per_head"``).
        norms = [_head_norms_sq(part, "whitened" if step_mode == "global" else self.truncation) for part in self.layers]
        self.lam_unit, self.layer_lam_units = _lam_units(norms, step_mode)
        self.head_factors = [
            _head_factors(scores, step, part.groups, unit, step_mode)
            for (scores, step), part, unit in zip(norms, self.layers, self.layer_lam_units)
        ]
        #: Each layer's step relative to the others: lam_l = step_size * layer_lam_units[l] * layer_scales[l].
        #: 1 everywhere unless a search per layer (step modes "layer_search", "coordinate") set them.
        self.layer_scales: list[float] = [1.0] * len(self.layers)

    def gradient(self, layer: int, inputs: int | None = None) -> Tensor:
        """M of ``layer`` over the inputs its Q/K weights read: X' = [X | 1], or X alone where Q/K have no bias
        (the statistics always hold the ones column)."""
        inputs = self.layers[layer].query.shape[-2] if inputs is None else inputs
        return self.statistics.mean_gradient(layer)[:, :inputs, :inputs]

    def lam(self, step_size: float, layer: int | None = None) -> float:
        """The absolute step of ``layer`` at a relative ``step_size`` (None: the model-wide `lam_unit` scale)."""
        if layer is None:
            return step_size * self.lam_unit
        return step_size * self.layer_lam_units[layer] * self.layer_scales[layer]

    def head_lams(self, step_size: float, layer: int) -> Tensor:
        """Each head's absolute step in ``layer`` at a relative ``step_size``, shape (heads,): the layer's `lam`
        times the head's factor (one per head but with ``step_mode="per_head"``)."""
        return self.lam(step_size, layer) * self.head_factors[layer]

    @property
    def has_gradient(self) -> bool:
        """False when the loss has zero gradient with respect to every head's scores: no step can gain."""
        return any(self.layer_lam_units)

    def widen(self, qk_dims_after: list[int], adapter: ArchitectureAdapter, config) -> None:
        """Set the grown widths (decided after the statistics, e.g. by a budget)."""
        for layer, problem in enumerate(self.layers):
            problem.qk_dim_after = qk_dims_after[layer]
            problem.scaling_after = adapter.scaling(config, layer, qk_dims_after[layer])

    def gain_rates(self, layer: int) -> linalg.GainRates:
        """First-order expected gains of ``layer`` per unit step size (see `linalg.growth_gain_rates`)."""
        problem = self.layers[layer]
        unit = self.layer_lam_units[layer] * self.head_factors[layer]  # each head's, before any search per layer
        if self.mode == "append":
            return self._append_gain_rates(layer, unit)
        with torch.no_grad():
            width = problem.query.shape[-1]
            rates = linalg.growth_gain_rates(problem.bilinear, problem.direction, problem.metric, width)
        return linalg.GainRates(rates.without_growth * unit, rates.marginal * unit[:, None])

    def _append_gain_rates(self, layer: int, unit: Tensor) -> linalg.GainRates:
        """In "append" mode the old form stays, so nothing is gained without growth; the r-th added dim of a head gains
        lam * s_r^2 / 2, s_r its share of the r-th singular value of its group's whitened -P (`rank_gains`)."""
        problem = self.layers[layer]
        with torch.no_grad():
            _, direction = self.whitened_pair(layer, "whitened")
            capacity = max(1, direction.shape[-1] - problem.query.shape[-1])  # as the widths are capped
            shares = linalg.grouped_truncation(-direction, None, capacity, problem.groups).singular_values
        return linalg.GainRates(torch.zeros_like(shares[:, 0]), shares.square() / 2 * unit[:, None])

    def decomposition(self, layer: int, step_size: float, truncation: str) -> linalg.Decomposition:
        """The decomposition of layer's ``Z - lam P`` (whitened or not) for truncations up to the grown width."""
        problem = self.layers[layer]
        base, direction = self.whitened_pair(layer, truncation)
        metric = problem.metric if truncation == "whitened" else None
        target = base - self.head_lams(step_size, layer)[:, None, None] * direction
        return self.decompose(("step", layer, truncation), target, metric, problem.qk_dim_after)

    def unit_update(self, layer: int) -> linalg.Factorization:
        """The "append" update at lam = 1: the truncation of -P to the p added dimensions (computed once); under
        grouped-query attention, the joint truncation of each group's heads with one key
        (`linalg.grouped_truncation`)."""
        if layer not in self._unit_updates:
            problem = self.layers[layer]
            metric = problem.metric if self.truncation == "whitened" else None
            added = problem.qk_dim_after - problem.query.shape[-1]
            _, direction = self.whitened_pair(layer, self.truncation)
            if problem.groups < problem.query.shape[0]:  # grouped-query attention: keys shared within a group
                self._unit_updates[layer] = linalg.grouped_truncation(-direction, metric, added, problem.groups)
            else:
                decomposition = self.decompose(("unit", layer, self.truncation), -direction, metric, added)
                self._unit_updates[layer] = decomposition.truncate(added)
        return self._unit_updates[layer]

    def whitened_pair(self, layer: int, truncation: str) -> tuple[Tensor, Tensor]:
        """Z and P where ``truncation`` truncates them (whitened by C^1/2, or as they are), computed once:
        each line-search step then only forms ``Z - lam P`` there."""
        key = (layer, truncation)
        if key not in self._whitened_pairs:
            problem = self.layers[layer]
            pair = (problem.bilinear, problem.direction)
            if truncation == "whitened":
                pair = tuple(linalg.whiten(matrix, problem.metric) for matrix in pair)
            self._whitened_pairs[key] = pair
        return self._whitened_pairs[key]

    def decompose(
        self, key: tuple, whitened: Tensor, metric: linalg.Metric | None, rank: int
    ) -> linalg.Decomposition:
        """Decompose with the solver (``"auto"``: by size), the subspace method warm-started from the last
        decomposition under the same ``key`` (the previous line-search step)."""
        method = self.solver if self.solver != "auto" else linalg.choose_method(whitened.shape[-1], rank)
        self.methods_used.add(method)
        decomposition = linalg.decompose_whitened(whitened, metric, method, rank=rank, start=self._starts.get(key))
        if decomposition.basis is not None:
            self._starts[key] = decomposition.basis
        return decomposition

    def weights(self, step_size: float) -> QKWeights:
        """Augmented Q/K weights of the grown width for every layer (see `layer_weights`)."""
        return {layer: self.layer_weights(layer, step_size) for layer in range(len(self.layers))}

    def layer_weights(self, layer: int, step_size: float) -> tuple[Tensor, Tensor]:
        """Augmented Q/K weights of ``layer`` at its own lam for ``step_size``. Step size 0 is exactly the old
        function: the old weights, zero-padded, with the change of scale folded into the queries (so in a
        bfloat16 or float16 model, up to the rounding of those queries). In "append" mode the old weights are
        kept at every step (layers without added dimensions do not change)."""
        problem = self.layers[layer]
        lam = self.lam(step_size, layer)
        with torch.no_grad():
            if self.mode == "append" and problem.qk_dim_after > problem.query.shape[-1]:
                update = linalg.rescaled_to_step(self.unit_update(layer), self.head_lams(step_size, layer))
                if problem.groups < problem.query.shape[0]:  # one key per group (repeated in the update)
                    per_group = problem.query.shape[0] // problem.groups
                    update = linalg.Factorization(update.left, update.right[::per_group], update.singular_values)
                return linalg.appended_weights(
                    problem.query, problem.key, problem.scaling_before, problem.scaling_after, update
                )
            if lam == 0 or self.mode == "append":
                padding = problem.qk_dim_after - problem.query.shape[-1]
                fold = problem.scaling_before / problem.scaling_after
                return (
                    torch.nn.functional.pad(problem.query * fold, (0, padding)),
                    torch.nn.functional.pad(problem.key, (0, padding)),
                )
            factors = self.decomposition(layer, step_size, self.truncation).truncate(problem.qk_dim_after)
            root_scaling = math.sqrt(problem.scaling_after)
            return factors.left / root_scaling, factors.right / root_scaling

    def unconstrained_weights(self, step_size: float, scalings: list[float]) -> QKWeights:
        """Full-rank weights computing Z - lam P exactly: queries (Z - lam P) / scaling, keys the identity."""
        weights = {}
        with torch.no_grad():
            for layer, problem in enumerate(self.layers):
                target = problem.bilinear - self.head_lams(step_size, layer)[:, None, None] * problem.direction
                identity = torch.eye(target.shape[-1], dtype=target.dtype, device=target.device).expand_as(target)
                weights[layer] = (target / scalings[layer], identity.clone())
        return weights


def _head_norms_sq(problem: LayerProblem, norm: str) -> tuple[Tensor, Tensor]:
    """||Z_h||^2 and ||P_h||^2 of each head, shape (heads,): in the metric of C (``"whitened"``) or plain
    Frobenius."""
    with torch.no_grad():
        pair = (problem.bilinear, problem.direction)
        if norm == "whitened":
            return tuple(linalg.whitened_norm_sq(matrix, problem.metric) for matrix in pair)
        return tuple(matrix.square().sum(dim=(-2, -1)) for matrix in pair)


def _lam_units(norms: list[tuple[Tensor, Tensor]], step_mode: str) -> tuple[float, list[float]]:
    """lam per unit step size, of the model and of each layer (see `hf_grow.config.STEP_MODES`), from each
    layer's per-head norms (`_head_norms_sq`: whitened for "global", else in the truncation's norm)."""
    sums = [(float(scores.sum()), float(step.sum())) for scores, step in norms]
    if step_mode == "global":
        unit = _lam_unit(sum(scores for scores, _ in sums), sum(step for _, step in sums))
        return unit, [unit] * len(norms)
    units = [_lam_unit(scores, step) for scores, step in sums]
    return math.sqrt(sum(unit**2 for unit in units) / len(norms)), units


def _head_factors(scores: Tensor, step: Tensor, groups: int, layer_unit: float, step_mode: str) -> Tensor:
    """Each head's step relative to its layer's, shape (heads,): with ``step_mode="per_head"`` the notes' ratio
    ||Z_h|| / ||P_h|| of the head over the layer's, else ones. Under grouped-query attention the heads that
    share a key share one factor, from their group's norms, so that the group's joint truncation stays a
    truncation of the group's step."""
    ones = torch.ones_like(scores)
    if step_mode != "per_head" or layer_unit == 0:
        return ones
    per_group = len(scores) // groups
    grouped = zip(*(value.reshape(groups, per_group).sum(dim=1).tolist() for value in (scores, step)))
    return ones.new_tensor([_lam_unit(a, b) for a, b in grouped]).repeat_interleave(per_group) / layer_unit


def _lam_unit(scores_sq: float, step_sq: float) -> float:
    """lam per unit step size, sqrt(||Z||^2 / ||P||^2): zero when the gradients vanish (nothing to gain); with
    all-zero Q/K the unit step has norm 1 instead of the scores' own size."""
    return math.sqrt((scores_sq or 1.0) / step_sq) if step_sq > 0 else 0.0


def write_weights(adapter: ArchitectureAdapter, model: PreTrainedModel, weights: QKWeights) -> None:
    attentions = adapter.attention_modules(model)
    for layer, (query, key) in weights.items():
        adapter.write_qk(attentions[layer], query, key)
