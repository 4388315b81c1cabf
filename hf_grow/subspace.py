"""Subspace iteration: the top singular subspace of a batch of matrices from matrix products alone (pure torch).

The solve's "subspace" method (`hf_grow.linalg.decompose_whitened`) takes the singular triplets of a target from
its projection on this subspace. It costs a few products with ``rank + SUBSPACE_OVERSAMPLING`` columns instead of a
full eigendecomposition, and can be warm-started from a nearby target's basis.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor


#: Columns the subspace method keeps beyond the rank it is asked for: they speed up convergence where the
#: singular values around the rank are close together.
SUBSPACE_OVERSAMPLING = 16


def top_singular_subspace(
    target: Tensor,
    rank: int,
    start: Tensor | None = None,
    tol: float = 1e-7,
    max_iterations: int = 100,
) -> tuple[Tensor, Tensor]:
    """Orthonormal basis Q (..., d, k) of the top-k left singular subspace of ``target`` by subspace
    iteration, and ``Q^T A`` (..., k, d), from which `decompose` takes the singular triplets.

    ``k = rank + SUBSPACE_OVERSAMPLING`` (at most d). Iterates ``Q <- orth(A A^T Q)`` from ``start`` (or a
    fixed-seed random block) until the energy the best rank-``rank`` truncation inside span(Q) captures,
    ``||Q_r^T A||^2``, grows by less than ``tol`` times the error it leaves, ``||A||^2`` minus that energy:
    the truncation error is then within about a factor ``1 + tol`` of the Eckart-Young optimum (up to
    roundoff, ~1e-13 of ``||A||^2``). Singular values close around the rank converge slowly, but then any
    of their directions truncates about as well: the criterion is on the error, not the vectors. A line
    search warm-starts each step from the previous one (bench_stats.py). The criterion measures progress,
    so it assumes a start not (nearly) orthogonal to a top direction: true of random starts, and of starts
    from a nearby target's basis. A RuntimeWarning says when ``max_iterations`` ran out first.
    """
    size = target.shape[-1]
    columns = min(size, rank + SUBSPACE_OVERSAMPLING)
    if start is None or start.shape != (*target.shape[:-1], columns):
        generator = torch.Generator(device=target.device).manual_seed(0)
        start = torch.randn(
            *target.shape[:-1], columns, generator=generator, dtype=target.dtype, device=target.device
        )
    basis = _orthonormal(start)
    projected = basis.mT @ target
    total = target.square().sum(dim=(-2, -1))
    floor = 1e-13 * total
    captured = None
    for _ in range(max_iterations):
        ritz = torch.linalg.eigvalsh(projected @ projected.mT)  # squared Ritz values, ascending
        energy = ritz[..., -rank:].clamp_min(0).sum(dim=-1)
        if captured is not None and bool(((energy - captured) <= tol * (total - energy) + floor).all()):
            return basis, projected
        captured = energy
        # A A^T Q with an orthonormalization after each product: each block is only as ill-conditioned as A.
        basis = _orthonormal(target @ _orthonormal(projected.mT))
        projected = basis.mT @ target
    warnings.warn(
        f"subspace iteration stopped after max_iterations={max_iterations} before converging to tol={tol}: "
        "the truncations may be less than optimal (solver='eigh' is exact).",
        RuntimeWarning,
        stacklevel=2,
    )
    return basis, projected


def _orthonormal(block: Tensor) -> Tensor:
    """An orthonormal basis of the columns of ``block``: Cholesky QR twice (matrix products and a small
    Cholesky, fast in batches on GPUs), Householder QR where the block is too ill-conditioned for it."""
    columns = block.shape[-1]
    identity = torch.eye(columns, dtype=block.dtype, device=block.device)
    basis = block
    for _ in range(2):
        factor, info = torch.linalg.cholesky_ex(basis.mT @ basis)
        if bool((info != 0).any()):
            return torch.linalg.qr(block).Q
        basis = torch.linalg.solve_triangular(factor, basis.mT, upper=False).mT
    if not bool(((basis.mT @ basis - identity).abs().amax(dim=(-2, -1)) < 1e-10).all()):
        return torch.linalg.qr(block).Q
    return basis
