"""The solve of one layer: from its statistics and Q/K weights to the small tensors every step needs.

Each head's direction P = C^+ M C^+ is formed, measured and decomposed once, a few heads at a time, and only
the compact result is kept (`hf_grow.compact`): what a step needs no longer grows with d^2 per head, and the
d x d tensors of a layer live only while a chunk of its heads is solved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import compact, linalg


#: Heads solved together: bounds the solve's transient d x d tensors (a few per head) without giving up batching.
HEAD_CHUNK = 8


def head_chunk(heads: int, groups: int) -> int:
    """The heads solved at once: `HEAD_CHUNK`, in whole groups of query heads sharing a key (their keys are solved
    jointly), so the whole group where one holds more (16 query heads a key in Llama-3.1-405B)."""
    per_group = heads // groups
    return min(heads, max(per_group, HEAD_CHUNK // per_group * per_group))
#: How ``solver="auto"`` decomposes each head's direction for the compact solve: once per head, from a cold
#: start, to a rank s of about twice the grown width. There eigh was never slower than subspace iteration on a
#: 2-core CPU at GPT-2 medium's width (s + 16 = 160 of 1,025 columns): 1.04x on a trained layer, 1.4x with
#: random weights, whose flat spectra slow the iteration (bench_solver.py, BENCHMARKS.md).
COMPACT_AUTO_METHOD = "eigh"


@dataclass(frozen=True)
class AppendUpdate:
    """The "append" update at lam = 1, truncated to ``capacity`` dims, and what reports need of it.

    ``unit``: the truncation of -P (per group of heads sharing a key, `linalg.grouped_truncation`).
    ``spectrum`` (heads, capacity): each head's singular values (or group shares) of -P in the metric of C.
    ``gradient_trace`` (heads, capacity): the cumulative ``<M, L_:j R_:j^T>`` over the first j dims;
    ``metric_sq`` (heads, capacity): the cumulative ``||C^1/2 L_:j R_:j^T C^1/2||^2``.
    ``base_trace`` (heads, capacity): the cumulative ``<Z, L_:j R_:j^T>`` in the metric of C (with ``metric_sq``,
    the size of the grown Z = Z + lam L R^T in that metric: the scores' root mean square the report gives).
    """

    unit: linalg.Factorization
    spectrum: Tensor
    gradient_trace: Tensor
    metric_sq: Tensor
    base_trace: Tensor


@dataclass
class LayerProblem:
    """Everything the steps of one layer need, in float64, without any (heads, d, d) tensor.

    ``norms[name]``: each head's (||Z||^2, ||P||^2) in the ``"whitened"`` and ``"frobenius"`` norms.
    ``target``: the compact target of "refactor" growth, which truncates either way (its plain tail measured
    where the solve was asked for Frobenius truncation); ``updates[truncation]``: the unit updates of "append"
    growth (rank-p factors: both truncations' are kept while M is alive, so that either can step).
    ``rates``: first-order gains per unit lam (`linalg.growth_gain_rates`), where a budget or an inspection
    asked for them.
    """

    query: Tensor
    key: Tensor
    scaling_before: float
    scaling_after: float
    qk_dim_after: int
    metric: linalg.Metric
    norms: dict[str, tuple[Tensor, Tensor]]
    target: compact.CompactTarget | None = None
    updates: dict[str, AppendUpdate] = field(default_factory=dict)
    rates: linalg.GainRates | None = None

    @property
    def groups(self) -> int:
        """Key heads: fewer than query heads under grouped-query attention (each shared by a group)."""
        return self.key.shape[0]

    @property
    def bilinear(self) -> Tensor:
        """Z = scaling * W'_Q W'_K^T of the old weights, each query head with its group's key head. (With rotary
        position embeddings this is the form at relative position 0, a measure of the scores' size.)"""
        return linalg.bilinear_form(self.query, self.repeated_key, self.scaling_before)

    @property
    def repeated_key(self) -> Tensor:
        return self.key.repeat_interleave(self.query.shape[0] // self.groups, dim=0)


def decomposition_method(solver: str, mode: str, size: int, added: int, per_group: int) -> str:
    """How `solve_layer` decomposes the directions of a layer of input ``size`` growing by ``added`` dims, with
    ``per_group`` query heads per key: the ``solver``, resolving "auto" (`COMPACT_AUTO_METHOD` for "refactor",
    by size for "append"); "append" growth under grouped-query attention decomposes the groups with eigh."""
    if mode == "refactor":
        return solver if solver != "auto" else COMPACT_AUTO_METHOD
    return "eigh" if per_group > 1 else (solver if solver != "auto" else linalg.choose_method(size, added))


def solve_layer(
    problem: LayerProblem,
    gradient_of: Callable[[slice], Tensor],
    mode: str,
    truncations: tuple[str, ...],
    max_width: int,
    solver: str,
    with_rates: bool,
) -> set[str]:
    """Fill ``problem``'s norms, target or updates (and rates) from M, a chunk of heads at a time.

    ``gradient_of(heads)``: M of those heads (a slice) in float64, in C's eigenbasis (U^T M U). ``max_width``:
    the widest the layer may grow to (the compact rank and the append capacity follow it). Returns the
    decomposition methods used.
    """
    heads = problem.query.shape[0]
    per_group = heads // problem.groups
    chunk = head_chunk(heads, problem.groups)
    width = problem.query.shape[-1]
    size = problem.query.shape[-2]
    added = max(1, max_width - width)
    parts: list[dict] = []
    method = decomposition_method(solver, mode, size, added, per_group)
    for start in range(0, heads, chunk):
        selected = slice(start, min(start + chunk, heads))
        gradient = gradient_of(selected)
        # P in C's eigenbasis gives its whitened form and its Frobenius norm (U is orthogonal) by scaling alone;
        # P in model coordinates costs two more d^3 products per head, only where something reads it.
        direction_in_basis = linalg.solve_direction_in_basis(gradient, problem.metric)
        root = problem.metric.root_diag
        whitened_step = direction_in_basis * root[..., :, None] * root[..., None, :]
        needs_direction = with_rates or (mode == "append" and "frobenius" in truncations)
        direction = problem.metric.from_basis(direction_in_basis) if needs_direction else None
        query, key = problem.query[selected], problem.repeated_key[selected]
        root_scaling = problem.scaling_before**0.5
        plain = (query * root_scaling, key * root_scaling)
        whitened_base = tuple(_whiten_factor(factor, problem.metric) for factor in plain)
        part: dict = {
            "whitened": (_sq(whitened_base), whitened_step.square().sum(dim=(-2, -1))),
            "frobenius": (_sq(plain), direction_in_basis.square().sum(dim=(-2, -1))),
        }
        del direction_in_basis
        if mode == "refactor":
            rank = compact.compact_rank(size, max_width)
            part["target"] = compact.compact_target(
                *whitened_base, whitened_step, gradient, rank, problem.metric, method, max_width,
                plain="frobenius" in truncations,
            )
        else:  # each truncation's unit update from its own coordinates (P in model coordinates for Frobenius)
            coordinates = {"whitened": (whitened_base, whitened_step), "frobenius": (plain, direction)}
            updates: dict[str, AppendUpdate] = {}
            for truncation in sorted(truncations, key=lambda name: name != "whitened"):
                # the whitened update's spectrum is the one every truncation's update reports: decomposed once
                spectrum = updates["whitened"].spectrum if "whitened" in updates else None
                updates[truncation] = _append_update(
                    coordinates, truncation, gradient, problem, added, per_group, method, spectrum
                )
            part["updates"] = updates
            del coordinates
        if with_rates:
            part["rates"] = _rates(problem, selected, direction, whitened_step, mode, per_group)
        parts.append(part)
        del gradient, direction, whitened_step
    problem.norms = {
        name: tuple(torch.cat([p[name][i] for p in parts]) for i in range(2)) for name in linalg.TRUNCATIONS
    }
    if mode == "refactor":
        problem.target = _cat_targets([p["target"] for p in parts])
    else:
        problem.updates = {t: _cat_updates([p["updates"][t] for p in parts]) for t in truncations}
    if with_rates:
        problem.rates = linalg.GainRates(*(torch.cat([getattr(p["rates"], name) for p in parts]) for name in
                                           ("without_growth", "marginal")))
    return {method}


def _whiten_factor(factor: Tensor, metric: linalg.Metric) -> Tensor:
    """``diag(root) U^T factor``: a factor of Z in whitened coordinates (W = A B^T with A, B so whitened)."""
    return metric.root_diag[..., :, None] * (metric.eigenvectors.mT @ factor)


def _sq(factors: tuple[Tensor, Tensor]) -> Tensor:
    """||A B^T||_F^2 per head from its factors: <A^T A, B^T B>."""
    left, right = factors
    return ((left.mT @ left) * (right.mT @ right)).sum(dim=(-2, -1))


def _append_update(
    coordinates: dict, truncation: str, gradient: Tensor, problem: LayerProblem, capacity: int, per_group: int,
    method: str, spectrum: Tensor | None = None,
) -> AppendUpdate:
    """The unit update of a chunk of heads, its whitened spectrum (decomposed here unless given: that of the
    whitened update), and its cumulative gradient and metric terms."""
    _, step = coordinates[truncation]
    whitened_step = coordinates["whitened"][1]
    metric = problem.metric if truncation == "whitened" else None
    groups = step.shape[0] // per_group
    if per_group > 1:  # grouped-query attention: keys shared within a group
        unit = linalg.grouped_truncation(-step, metric, capacity, groups)
        if spectrum is None:
            spectrum = unit.singular_values if truncation == "whitened" else (
                linalg.grouped_truncation(-whitened_step, None, capacity, groups).singular_values
            )
    else:
        unit = linalg.decompose_whitened(-step, metric, method, rank=capacity).truncate(capacity)
        if spectrum is None:
            spectrum = unit.singular_values if truncation == "whitened" else (
                linalg.decompose_whitened(-whitened_step, None, method, rank=capacity).singular_values
            )
    left, right = unit.left, unit.right
    # in C's eigenbasis, where M is given: U^T L, U^T R
    left_in_basis, right_in_basis = (problem.metric.eigenvectors.mT @ factor for factor in (left, right))
    gradient_trace = torch.einsum("hdj,hde,hej->hj", left_in_basis, gradient, right_in_basis).cumsum(dim=-1)
    root = problem.metric.root_diag[..., :, None]
    left_root, right_root = root * left_in_basis, root * right_in_basis
    left_gram, right_gram = left_root.mT @ left_root, right_root.mT @ right_root
    # ||C^1/2 L_:j R_:j^T C^1/2||^2 = sum_{a, b < j} Gl_ab Gr_ab: cumulative over both indices (leading minors)
    products = left_gram * right_gram
    metric_sq = products.cumsum(dim=-1).cumsum(dim=-2).diagonal(dim1=-2, dim2=-1)
    # <A B^T, l r^T> = (l^T A)(B^T r), column by column, in whitened coordinates (A, B: Z's whitened factors)
    base_left, base_right = coordinates["whitened"][0]
    base_trace = ((left_root.mT @ base_left) * (right_root.mT @ base_right)).sum(dim=-1).cumsum(dim=-1)
    return AppendUpdate(
        linalg.Factorization(left, right, unit.singular_values[..., :capacity]), spectrum[..., :capacity],
        gradient_trace, metric_sq, base_trace,
    )


def _rates(
    problem: LayerProblem, selected: slice, direction: Tensor, whitened_step: Tensor, mode: str, per_group: int
) -> linalg.GainRates:
    """First-order gains per unit lam of a chunk of heads (`linalg.growth_gain_rates`), before any head factor."""
    if mode == "append":
        capacity = max(1, direction.shape[-1] - problem.query.shape[-1])
        groups = direction.shape[0] // per_group
        shares = linalg.grouped_truncation(-whitened_step, None, capacity, groups).singular_values
        return linalg.GainRates(torch.zeros_like(shares[:, 0]), shares.square() / 2)
    bilinear = linalg.bilinear_form(problem.query[selected], problem.repeated_key[selected], problem.scaling_before)
    return linalg.growth_gain_rates(bilinear, direction, problem.metric, problem.query.shape[-1])


def _cat_targets(targets: list[compact.CompactTarget]) -> compact.CompactTarget:
    if len(targets) == 1:
        return targets[0]
    width = max(target.width for target in targets)  # chunks may keep different ranks: pad to the largest
    targets = [target.padded(width) for target in targets]
    fields = compact.CompactTarget.__dataclass_fields__
    return compact.CompactTarget(**{
        name: None if getattr(targets[0], name) is None else torch.cat([getattr(t, name) for t in targets])
        for name in fields
    })


def _cat_updates(updates: list[AppendUpdate]) -> AppendUpdate:
    if len(updates) == 1:
        return updates[0]
    unit = linalg.Factorization(*(torch.cat([getattr(u.unit, name) for u in updates]) for name in
                                  ("left", "right", "singular_values")))
    return AppendUpdate(unit, *(torch.cat([getattr(u, name) for u in updates]) for name in
                                ("spectrum", "gradient_trace", "metric_sq", "base_trace")))
