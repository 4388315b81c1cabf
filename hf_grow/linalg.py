"""The linear algebra of attention growth, in pure torch (no transformers).

Notation, per layer and head, with X' = [X | 1] the attention input with a column of ones (d = d_e + 1):

- ``C`` (d, d): E[x' x'^T], the second moment of the attention input. For LayerNorm'd inputs X' lies in a
  hyperplane, so C is singular by construction: every inverse here uses a relative tolerance.
- ``Z`` (d, d): ``scaling * W'_Q W'_K^T``, the bilinear form of the pre-softmax scores ``S = X' Z X'^T``.
- ``M`` (d, d): dLoss/dZ = sum X'^T G X' with G = dLoss/dS.
- ``P = C^+ M C^+``: the step ``dZ = -lam P`` minimizes the local model
  ``<M, dZ> + ||C^{1/2} dZ C^{1/2}||_F^2 / (2 lam)`` (the data-metric least-squares direction).

A rank-r truncation of ``Z - lam P`` is taken either in the plain Frobenius norm or in the metric of C
(whiten with C^{1/2}, truncate, un-whiten), and factored as ``Z_r = L R^T`` with the singular values split
evenly (``sqrt(sigma)`` on each side). Tensors may have leading batch dimensions (heads); C broadcasts.
All functions expect float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .lapack import batched_eigh, per_matrix
from .subspace import SUBSPACE_OVERSAMPLING, top_singular_subspace


TRUNCATIONS: tuple[str, ...] = ("whitened", "frobenius")


@dataclass(frozen=True)
class Metric:
    """The eigendecomposition of one second moment C, with a relative tolerance applied once.

    ``pinv_diag`` inverts the eigenvalues above ``rtol * max`` and drops the rest (for C^+), while
    ``root_diag`` floors them at ``rtol * max`` before the square root, so that whitening stays invertible.
    A truncation of rank >= rank(Z) in this metric returns Z exactly on the span of the data, and everywhere
    when C has full rank. Off the span, whitening shrinks Z by sqrt(rtol) per side, so those components fall
    to about ``rtol`` of the whitened spectrum and may be dropped as noise (`SINGULAR_VALUE_RTOL`): they
    change no score of an input in the span (for LayerNorm'd inputs, every input).
    """

    eigenvectors: Tensor
    eigenvalues: Tensor
    pinv_diag: Tensor
    root_diag: Tensor
    rank: int

    def to_basis(self, matrix: Tensor) -> Tensor:
        """U^T A U: a matrix in the eigenbasis of C."""
        return self.eigenvectors.mT @ matrix @ self.eigenvectors

    def from_basis(self, matrix: Tensor) -> Tensor:
        """U A U^T: back from the eigenbasis of C."""
        return self.eigenvectors @ matrix @ self.eigenvectors.mT


#: The least ``rtol``: a few hundred float64 epsilons, below which C's eigenvalues are rounding noise of its null
#: directions (LayerNorm'd inputs), which a smaller tolerance would invert as data (a 1e-17 grew Z's norm 7e10x).
MIN_RTOL = 1e-13


def check_rtol(rtol: float) -> None:
    """A ValueError for a relative eigenvalue tolerance outside [`MIN_RTOL`, 1)."""
    if not MIN_RTOL <= rtol < 1:
        raise ValueError(
            f"rtol must be in [{MIN_RTOL:g}, 1): C's eigenvalues below rtol times its largest are dropped, and below "
            f"{MIN_RTOL:g} they are float64 rounding noise; got {rtol}"
        )


def metric_from_second_moment(second_moment: Tensor, rtol: float = 1e-6) -> Metric:
    """Decompose a PSD second moment C with a tolerance relative to its largest eigenvalue.

    ``rtol`` should sit above the relative precision of the statistics: with M accumulated from float32
    products (~1e-7 relative error) directions of C below ~1e-6 of the largest carry only noise.
    """
    check_rtol(rtol)
    if second_moment.shape[-1] != second_moment.shape[-2]:
        raise ValueError(f"second moment must be square, got shape {tuple(second_moment.shape)}")
    if not torch.isfinite(second_moment).all():
        raise FloatingPointError("second moment contains NaN or Inf")
    symmetric = (second_moment + second_moment.mT) / 2
    eigenvalues, eigenvectors = batched_eigh(symmetric)
    eigenvalues = eigenvalues.clamp_min(0)
    largest = eigenvalues.amax(dim=-1, keepdim=True)
    if (largest <= 0).any():
        raise ValueError("second moment is zero: no (non-padding) tokens reached this layer")
    floor = rtol * largest
    kept = eigenvalues > floor
    pinv_diag = torch.where(kept, 1 / eigenvalues.clamp_min(floor), torch.zeros_like(eigenvalues))
    root_diag = eigenvalues.clamp_min(floor).sqrt()
    return Metric(eigenvectors, eigenvalues, pinv_diag, root_diag, int(kept.sum(dim=-1).min()))


def bilinear_form(query_weight: Tensor, key_weight: Tensor, scaling: float) -> Tensor:
    """Z = scaling * W'_Q W'_K^T from augmented (d, d_k) weights, the bias as their last row."""
    return scaling * query_weight @ key_weight.mT


def solve_direction(gradient: Tensor, metric: Metric) -> Tensor:
    """P = C^+ M C^+ for the loss gradient M = dLoss/dZ."""
    return metric.from_basis(solve_direction_in_basis(metric.to_basis(gradient), metric))


def solve_direction_in_basis(gradient_in_basis: Tensor, metric: Metric) -> Tensor:
    """U^T P U: P = C^+ M C^+ in the eigenbasis of C, where whitening is a scaling (`whiten`), from U^T M U."""
    inverse = metric.pinv_diag
    return gradient_in_basis * inverse[..., :, None] * inverse[..., None, :]


def cross_fitted_gradient(
    first: Tensor, second: Tensor, metric: Metric, rank: int, method: str = "eigh", in_basis: bool = False
) -> Tensor:
    """M kept to what two independent halves of the data agree on, from each half's mean M (heads, d, d).

    In the metric of C, each half's top-``rank`` singular directions (u_k, v_k) are kept with the value the
    other half gives them, ``max(u_k^T M_other v_k, 0)``, not their own: their own singular values are biased
    up by the noise they were fitted to, the other half's are not (split-sample shrinkage). The two halves'
    results are averaged. Directions the halves do not confirm get zero, so that P = C^+ M C^+ holds what is
    common to the data rather than what fits the batches the statistics came from. ``in_basis``: returned in C's
    eigenbasis (U^T M U), where the solve uses it (the way back and forth costs 4 d^3 per head).
    """
    inverse_root = metric.pinv_diag.sqrt()
    scale = inverse_root[..., :, None] * inverse_root[..., None, :]
    halves = [metric.to_basis(half) * scale for half in (first, second)]
    confirmed = []
    for own, other in (halves, halves[::-1]):
        parts = decompose_whitened(own, None, method, rank=rank, columns=rank)
        left = parts.left_vectors[..., :rank]
        sigma = parts.singular_values[..., : left.shape[-1]]
        right = parts.projected[..., : left.shape[-1]] / torch.where(sigma > 0, sigma, 1.0)[..., None, :]
        honest = torch.einsum("...dk,...de,...ek->...k", left, other, right).clamp_min(0)
        confirmed.append((left * honest[..., None, :]) @ right.mT)
    root = metric.root_diag
    kept = (confirmed[0] + confirmed[1]) / 2 * root[..., :, None] * root[..., None, :]
    return kept if in_basis else metric.from_basis(kept)


def dct_rotation(size: int, dtype: torch.dtype = torch.float64, device: torch.device | None = None) -> Tensor:
    """The orthonormal DCT-II matrix (size, size): factors A, B of Z = A B^T times it give the same Z, each
    column a mix of all of them."""
    n = torch.arange(size, dtype=dtype, device=device)
    rotation = torch.cos(torch.pi * (n[:, None] + 0.5) * n[None, :] / size) * math.sqrt(2 / size)
    rotation[:, 0] /= math.sqrt(2)
    return rotation


def whitened_norm_sq(matrix: Tensor, metric: Metric) -> Tensor:
    """||C^{1/2} A C^{1/2}||_F^2 (with the floored root), over the last two dimensions."""
    root = metric.root_diag
    return (metric.to_basis(matrix) * root[..., :, None] * root[..., None, :]).square().sum(dim=(-2, -1))


@dataclass(frozen=True)
class Factorization:
    """A rank-r truncation Z_r = left @ right^T and the singular values of the matrix it was cut from."""

    left: Tensor
    right: Tensor
    singular_values: Tensor

    @property
    def product(self) -> Tensor:
        return self.left @ self.right.mT


#: Full decompositions (every singular value) and the top-r subspace method; ``"auto"`` picks per size.
SVD_METHODS: tuple[str, ...] = ("eigh", "svd")
DECOMPOSITION_METHODS: tuple[str, ...] = (*SVD_METHODS, "subspace")
SOLVERS: tuple[str, ...] = ("auto", *DECOMPOSITION_METHODS)

#: Singular directions below this fraction of the largest are dropped from truncations (set to zero): the
#: eigh method resolves sigma only to about sqrt(d * eps) * sigma_max, and they change Z_r by less than that.
SINGULAR_VALUE_RTOL = 1e-6


@dataclass(frozen=True)
class Decomposition:
    """The singular value decomposition of a (whitened) target, ready to be truncated to any rank.

    ``left_vectors`` U and ``projected`` A^T U = V Sigma of the whitened target A, singular values largest
    first; ``metric`` un-whitens the factors (None for the Frobenius norm, where A is the target itself).
    U and V Sigma may hold only the top columns (truncations up to that rank), the singular values are all there.
    """

    left_vectors: Tensor
    projected: Tensor
    singular_values: Tensor
    metric: Metric | None
    #: The subspace method's orthonormal basis of the top left singular directions (None for full methods):
    #: the start for a nearby target, e.g. the next step of a line search.
    basis: Tensor | None = None

    def __post_init__(self) -> None:
        # Singular vectors are defined up to sign, and which sign a solver returns depends on the BLAS, the
        # thread count and the process count. Fix it (largest entry of each left vector positive), so that the
        # same statistics give the same weights everywhere, not only the same function.
        largest = self.left_vectors.abs().argmax(dim=-2, keepdim=True)
        signs = torch.where(self.left_vectors.gather(-2, largest) < 0, -1.0, 1.0).to(self.left_vectors.dtype)
        object.__setattr__(self, "left_vectors", self.left_vectors * signs)
        object.__setattr__(self, "projected", self.projected * signs)

    def truncate(self, rank: int) -> Factorization:
        """Best rank-``rank`` approximation, factored with a balanced sqrt(sigma) split."""
        if rank <= 0:
            raise ValueError(f"rank must be positive, got {rank}")
        if rank > self.left_vectors.shape[-1]:
            raise ValueError(f"rank {rank} exceeds the {self.left_vectors.shape[-1]} singular vectors kept")
        sigma = self.singular_values[..., :rank]
        kept = sigma > SINGULAR_VALUE_RTOL * self.singular_values[..., :1]
        root_sigma = torch.where(kept, sigma, torch.ones_like(sigma)).sqrt()
        left = torch.where(kept[..., None, :], self.left_vectors[..., :rank] * root_sigma[..., None, :], 0.0)
        right = torch.where(kept[..., None, :], self.projected[..., :rank] / root_sigma[..., None, :], 0.0)
        if self.metric is not None:
            root = self.metric.root_diag[..., :, None]
            left, right = self.metric.eigenvectors @ (left / root), self.metric.eigenvectors @ (right / root)
        return Factorization(left, right, self.singular_values)


def whiten(target: Tensor, metric: Metric) -> Tensor:
    """``C^1/2 target C^1/2`` in the eigenbasis of C (with the floored root): where truncations are optimal."""
    root = metric.root_diag
    return metric.to_basis(target) * root[..., :, None] * root[..., None, :]


def decompose(
    target: Tensor,
    metric: Metric | None = None,
    method: str = "eigh",
    *,
    rank: int | None = None,
    start: Tensor | None = None,
) -> Decomposition:
    """The SVD that truncations of ``target`` need: of the target itself, or whitened ``C^1/2 target C^1/2``.

    ``method="svd"`` runs a full `torch.linalg.svd`; ``"eigh"`` (several times faster, above all on GPUs)
    takes the eigendecomposition of A A^T and V Sigma = A^T U, exact for every singular value above
    ``SINGULAR_VALUE_RTOL`` of the largest in float64 (bench_stats.py: 7.7x faster on an H100 for GPT-2
    small). ``"subspace"`` finds only the top ``rank`` singular triplets (see `top_singular_subspace`),
    optionally from the ``basis`` of a nearby target's decomposition as ``start``.
    """
    whitened = target if metric is None else whiten(target, metric)
    return decompose_whitened(whitened, metric, method, rank=rank, start=start)


def decompose_whitened(
    whitened: Tensor,
    metric: Metric | None = None,
    method: str = "eigh",
    *,
    rank: int | None = None,
    start: Tensor | None = None,
    columns: int | None = None,
) -> Decomposition:
    """`decompose` of an already whitened target A (``metric`` only un-whitens the truncations).

    ``columns``: keep only the top this many singular vectors (of "eigh" and "svd"; every singular value is
    kept): truncations are then at most that rank, and "eigh" forms A^T U for those columns only.
    """
    if not bool(torch.isfinite(whitened).all()):
        raise FloatingPointError("the target to decompose holds NaN or Inf: check the step size and the statistics.")
    kept = slice(None, columns)
    if method == "svd":
        left_vectors, singular_values, right_vectors_h = per_matrix(torch.linalg.svd, whitened)
        projected = right_vectors_h[..., kept, :].mT * singular_values[..., None, kept]
        return Decomposition(left_vectors[..., kept], projected, singular_values, metric)
    if method == "eigh":
        eigenvalues, eigenvectors = batched_eigh(whitened @ whitened.mT)
        left_vectors = eigenvectors.flip(-1)[..., kept]
        singular_values = eigenvalues.flip(-1).clamp_min(0).sqrt()
        return Decomposition(left_vectors, whitened.mT @ left_vectors, singular_values, metric)
    if method == "subspace":
        if rank is None:
            raise ValueError("the subspace method needs the rank of the truncations it is for")
        return _rayleigh_ritz(*top_singular_subspace(whitened, rank, start), metric)
    raise ValueError(f"method must be one of {DECOMPOSITION_METHODS}, got {method!r}")


def choose_method(width: int, rank: int) -> str:
    """The decomposition method for rank-``rank`` truncations of ``width``-square targets.

    The subspace method costs a few products of A with ``rank + SUBSPACE_OVERSAMPLING`` columns per target
    against a full eigendecomposition: it wins where that block is a small part of the width (GPT-2 small:
    88 of 769 columns, 3x faster per step on CPU); at 88 of 385 it was already no faster (bench_solver.py),
    and for narrow models ``eigh`` is as fast and exact.
    """
    return "subspace" if 6 * (rank + SUBSPACE_OVERSAMPLING) <= width else "eigh"


def _rayleigh_ritz(basis: Tensor, projected: Tensor, metric: Metric | None) -> Decomposition:
    """The best decomposition of A inside span(basis), from ``projected = basis^T A``: SVD of that small block."""
    eigenvalues, eigenvectors = batched_eigh(projected @ projected.mT)
    rotation = eigenvectors.flip(-1)
    singular_values = eigenvalues.flip(-1).clamp_min(0).sqrt()
    return Decomposition(basis @ rotation, projected.mT @ rotation, singular_values, metric, basis)


def truncate(target: Tensor, rank: int, metric: Metric | None = None, method: str = "eigh") -> Factorization:
    """Best rank-``rank`` approximation of ``target``, factored with a balanced sqrt(sigma) split.

    With ``metric=None`` the approximation is best in the Frobenius norm (Eckart-Young). With a metric it is
    best in ``||C^{1/2} (target - Z_r) C^{1/2}||_F``: SVD of the whitened target, un-whitened factors.
    ``singular_values`` are those of the (whitened) target, all of them, largest first.
    """
    return decompose(target, metric, method).truncate(rank)


def predicted_decrease(gradient: Tensor, delta: Tensor, metric: Metric, lam: float | Tensor) -> Tensor:
    """Loss decrease predicted for Z -> Z + delta by the local model of step size lam (one, or one per head).

    ``-(<M, delta> + ||C^{1/2} delta C^{1/2}||^2 / (2 lam))``: the first-order change, penalized by the
    curvature 1/lam under which ``-lam P`` is the optimal step. Zero where ``lam == 0``.
    """
    lam = torch.as_tensor(lam, dtype=gradient.dtype, device=gradient.device)
    first_order = (gradient * delta).sum(dim=(-2, -1))
    decrease = -(first_order + whitened_norm_sq(delta, metric) / (2 * lam.clamp_min(torch.finfo(lam.dtype).tiny)))
    return torch.where(lam == 0, torch.zeros_like(decrease), decrease)


def rank_gains(singular_values: Tensor, lam: float | Tensor) -> Tensor:
    """Predicted loss decrease of each rank of a whitened truncation, sigma_i^2 / (2 lam).

    With A the whitened target, keeping rank r instead of r-1 lowers the local model by sigma_r^2 / (2 lam):
    the gain of growing a head from d_k to d_k + p is the sum over ranks d_k+1 .. d_k+p. ``lam``: one step, or
    one per head (shape (heads,), for ``singular_values`` of shape (heads, r)).
    """
    lam = torch.as_tensor(lam, dtype=singular_values.dtype, device=singular_values.device)
    lam = lam[..., None] if lam.dim() else lam
    gains = singular_values.square() / (2 * lam.clamp_min(torch.finfo(lam.dtype).tiny))
    return torch.where(lam == 0, torch.zeros_like(gains), gains)


def rescaled_to_step(factors: Factorization, lam: float | Tensor) -> Factorization:
    """The truncation of ``-lam * P`` from the truncation of ``-P``: each factor times sqrt(lam), lam >= 0 (one
    step, or one per head: shape (heads,)).

    Rank truncation commutes with a non-negative scale, so the "append" update is decomposed once and the line
    search only rescales it.
    """
    lam = torch.as_tensor(lam, dtype=factors.left.dtype, device=factors.left.device)
    if bool((lam < 0).any()):
        raise ValueError(f"lam must be >= 0, got {lam.tolist()}")
    per_head = lam[..., None] if lam.dim() else lam
    root = per_head.sqrt()[..., None]  # (heads, 1, 1) against factors of shape (heads, d, r)
    return Factorization(factors.left * root, factors.right * root, factors.singular_values * per_head)


def grouped_truncation(whitened: Tensor, metric: Metric | None, rank: int, groups: int) -> Factorization:
    """Best rank-``rank`` targets ``T_i ~ L_i R_g^T`` whose right factor is shared by the heads of a group.

    ``whitened`` (heads, d, d): the (whitened) targets of the heads, ``groups`` groups of consecutive heads
    (grouped-query attention: the query heads of a group share their key head). The error summed over a group,
    ``sum_i ||T_i - L_i R^T||^2``, is that of the stacked target ``[T_1; ...; T_m] ~ [L_1; ...; L_m] R^T``:
    its truncated SVD is optimal (Eckart-Young), computed from the eigendecomposition of ``sum_i T_i^T T_i``
    (d x d per group) with ``V Sigma`` split as ``L = T V / sqrt(sigma)``, ``R = V sqrt(sigma)``. With one head
    per group this is the usual per-head truncation. ``metric`` un-whitens both factors.

    Returns ``left`` (heads, d, rank) and ``right`` repeated for each head of its group (heads, d, rank), so that
    ``product`` is every head's form; ``singular_values`` (heads, rank) holds each head's share
    ``||T_i v_r||`` of the group's singular value (their squares sum to sigma_r^2 over the group), largest first.
    """
    heads, size = whitened.shape[0], whitened.shape[-1]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} groups")
    if not 0 < rank <= size:
        raise ValueError(f"rank must be in 1..{size}, got {rank}")
    if not bool(torch.isfinite(whitened).all()):
        raise FloatingPointError("the target to decompose holds NaN or Inf: check the step size and the statistics.")
    per_group = heads // groups
    stacked = whitened.reshape(groups, per_group * size, size)
    eigenvalues, eigenvectors = batched_eigh(stacked.mT @ stacked)
    right_vectors = eigenvectors.flip(-1)[..., :rank]
    sigma = eigenvalues.flip(-1).clamp_min(0).sqrt()
    # Fix each singular pair's sign (largest entry of the right vector positive), as `Decomposition` does.
    largest = right_vectors.abs().argmax(dim=-2, keepdim=True)
    right_vectors = right_vectors * torch.where(right_vectors.gather(-2, largest) < 0, -1.0, 1.0)
    projected = stacked @ right_vectors  # U Sigma: (groups, heads per group * d, rank)
    kept = sigma[..., :rank] > SINGULAR_VALUE_RTOL * sigma[..., :1]
    root_sigma = torch.where(kept, sigma[..., :rank], torch.ones_like(sigma[..., :rank])).sqrt()
    left = torch.where(kept[..., None, :], projected / root_sigma[..., None, :], 0.0).reshape(heads, size, rank)
    right = torch.where(kept[..., None, :], right_vectors * root_sigma[..., None, :], 0.0)
    right = right.repeat_interleave(per_group, dim=0)
    shares = projected.reshape(heads, size, rank).norm(dim=-2)
    if metric is not None:
        root = metric.root_diag[..., :, None]
        left, right = metric.eigenvectors @ (left / root), metric.eigenvectors @ (right / root)
    return Factorization(left, right, shares)


def appended_weights(
    query: Tensor, key: Tensor, scaling_before: float, scaling_after: float, update: Factorization
) -> tuple[Tensor, Tensor]:
    """Old augmented Q/K weights kept, ``update``'s factors appended as new dimensions: the "append" growth.

    Returns ``(heads, d, d_k + p)`` weights whose bilinear form at ``scaling_after`` is
    ``scaling_before * query @ key^T + update.left @ update.right^T``: the change of scale is folded into the
    old queries, the update is split as ``left / sqrt(scaling_after)``, ``right / sqrt(scaling_after)``.
    With ``update`` the truncation of ``-lam P`` (`rescaled_to_step`), the new dimensions hold the best
    rank-p approximation of the step in the metric of C, and lam = 0 computes exactly the old function.
    """
    root = scaling_after**0.5
    fold = scaling_before / scaling_after
    return (
        torch.cat([query * fold, update.left / root], dim=-1),
        torch.cat([key, update.right / root], dim=-1),
    )

@dataclass(frozen=True)
class GainRates:
    """First-order expected loss decreases per unit step lam, of one or more heads (see `growth_gain_rates`).

    ``without_growth`` (heads,): of the solve truncated to the current width. ``marginal`` (heads, d - width):
    of each added dimension, largest first; adding k dimensions gains ``lam * marginal[..., :k].sum(-1)``.
    """

    without_growth: Tensor
    marginal: Tensor


def growth_gain_rates(bilinear: Tensor, direction: Tensor, metric: Metric, width: int) -> GainRates:
    """What growth gains per unit lam, to first order in lam, independent of the step the line search picks.

    In the metric of C (whitened, ``W = C^1/2 Z C^1/2``, ``Q = C^1/2 P C^1/2``), the rank-(width + k)
    truncation of ``W - lam Q`` keeps singular values whose squares gain ``sigma^2 / (2 lam)`` each
    (`rank_gains`). W has rank rho <= width, so for small lam the singular values beyond rho are
    ``lam * s_j`` with ``s_j`` those of ``Q_perp``, Q with W's row and column spaces projected out; each gains
    ``lam * s_j^2 / 2``. The first ``width - rho`` of them fit in the current width; dimension ``width + r``
    gains ``lam * s_{width - rho + r}^2 / 2``. Without growth the truncation keeps ``Q - Q_perp`` plus those
    spare dimensions: ``lam * (||Q||^2 - ||Q_perp||^2) / 2`` plus theirs. All gains scale with the same lam,
    so the ranking of heads and layers holds at any step small enough for first order (errors
    ``O(lam^2 ||Q||^3 / sigma_rho(W))``).
    """
    scores, step = whiten(bilinear, metric), whiten(direction, metric)
    size = scores.shape[-1]
    decomposition = decompose(scores)
    sigma = decomposition.singular_values[..., :width]
    kept = sigma > SINGULAR_VALUE_RTOL * decomposition.singular_values[..., :1].clamp_min(torch.finfo(sigma.dtype).tiny)
    left = decomposition.left_vectors[..., :width] * kept[..., None, :]
    right = decomposition.projected[..., :width] / torch.where(kept, sigma, torch.ones_like(sigma))[..., None, :]
    right = right * kept[..., None, :]
    left_removed = step - left @ (left.mT @ step)
    perpendicular = left_removed - (left_removed @ right) @ right.mT
    # s_j^2, largest first
    spectrum = per_matrix(torch.linalg.eigvalsh, perpendicular @ perpendicular.mT).flip(-1).clamp_min(0)
    spare = (width - kept.sum(dim=-1, keepdim=True)).clamp_min(0)  # current dimensions W leaves unused
    positions = torch.arange(size, device=spectrum.device)
    used = positions < spare
    without_growth = (step.square().sum(dim=(-2, -1)) - perpendicular.square().sum(dim=(-2, -1))) / 2
    without_growth = without_growth + (spectrum * used).sum(dim=-1) / 2
    added = spare + positions[: size - width]
    marginal = torch.gather(spectrum, -1, added.expand(*spectrum.shape[:-1], size - width)) / 2
    return GainRates(without_growth=without_growth, marginal=marginal)
