"""The compact solve: every step's truncation of ``Z - lam P`` from small matrices (pure torch, no transformers).

Per head, in whitened coordinates (by C^1/2): the scores' form ``W = A B^T`` has rank a = d_k, and the direction
Q is decomposed once, to its top s singular triplets ``U_s S_s V_s^T`` (s well above the grown width r). Every
target ``T(lam) = W - lam Q`` is then taken on the fixed subspaces ``L = span[A, U_s]`` and ``R = span[B, V_s]``
(k = a + s columns each):

    T^(lam) = L (L^T W R - lam L^T Q R) R^T,

whose singular value decomposition is that of a k x k core. W lies in both subspaces, so
``T - T^ = -lam (Q - L L^T Q R R^T)`` and ``||T - T^||_2 <= sqrt(2) lam sigma_{s+1}(Q)`` (Q_s lies in both).
By Weyl's inequality each singular value of T^ is within eps (that bound) of T's, and the rank-r truncation of
T^ within ``2 eps sum_{i<=r} sigma_i(T^) + r eps^2`` of the optimal squared error: the certificate
(`CompactTarget.perturbation`). Where a + s covers
the whole width the subspaces are everything and the compact solve is the exact one.

Frobenius truncation (in the plain norm of Z, the original notes') is taken on the same subspaces: with the bases
in model coordinates ``L_m = L_m' G_l`` (``L_m'`` orthonormal, ``G_l`` the Cholesky root of ``L_m^T L_m``),
``||L_m X R_m^T||_F = ||G_l X G_r^T||_F``, so the best plain-norm truncation of ``T^`` is the SVD of
``G_l X G_r^T``, mapped back by the inverse roots (`CompactTarget.decompose`). One solve serves both
truncations: no second set of bases, no P in model coordinates. What it drops is ``lam`` times the direction
outside the subspaces, in model coordinates ``C^-1/2 (Q - L L^T Q R R^T) C^-1/2``: its spectral norm
(``plain_tail``) is the certificate; the whitened subspaces hold the directions that the whitened truncation
keeps, not necessarily all that the plain one would (BENCHMARKS "Frobenius truncation on the whitened solve's
subspaces": how far the two are apart).

The bases are kept in model coordinates (un-whitened), so a truncation's factors are ``basis @ core factors``;
the loss gradient M and the metric of C are kept as k x k projections for the expected gains. The bases are the
largest part of the solve (d x k per head, against k x k cores), so they are stored in float32 (`BASIS_DTYPE`)
once everything built from them is computed, and cast back to float64 where they are used: every product stays
in float64, and the grown weights differ only by the bases' rounding (about 1e-7 relative, as in float32 weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import lapack, linalg


def compact_rank(size: int, width: int) -> int:
    """The least s, the singular triplets of the direction kept: twice the grown ``width`` and at least 64 beyond
    it, at most the matrix ``size``. A full decomposition keeps more where the certificate asks (`certified_rank`).

    The certificate scales with sigma_{s+1}; at twice the width the kept directions hold what a truncation to
    ``width`` picks up, with margin for the directions the step rotates in. Narrow models (size <= a + s) are
    solved exactly, whatever the width: the same widths then give the same weights however they were chosen.
    """
    return min(size, max(2 * width, width + 64))


#: The certificate's step-free part, ``sqrt(2) sigma_{s+1}(Q) / sigma_width(Q)``, that the kept rank goes below
#: where a full decomposition gives the whole spectrum. On all-MiniLM-L6-v2 (bench_compact_rank.py) the held-out
#: loss was 4.4e-4 above the exact solve's at a certificate of 0.40, within 1e-4 from 0.24.
CERTIFICATE_TOLERANCE = 0.2
#: The kept rank's ceiling, in grown widths: where spectra are flat (random weights) s stops there, and the solve
#: stays compact (fewer columns than the width) rather than growing to the exact one.
MAX_RANK_PER_WIDTH = 5
#: The dtype the compact bases are stored in: half of float64's memory (1.3 GB at GPT-2 medium's rank ceiling);
#: they are cast to float64 before every product (`CompactTarget.to_model`).
BASIS_DTYPE = torch.float32


def rank_ceiling(size: int, width: int, base: int) -> int:
    """The most s `certified_rank` keeps: ``MAX_RANK_PER_WIDTH * width``, and fewer than ``size - base`` columns
    (``base``: the columns of W's factors), so that the subspaces stay a part of the width."""
    return min(MAX_RANK_PER_WIDTH * width, size - base - 1)


def certified_rank(singular_values: Tensor, width: int, rank: int, base: int) -> int:
    """s for a chunk of heads from their whole spectra (heads, size), largest first: from ``rank`` on, the
    smallest s at which ``sqrt(2) sigma_{s+1} <= CERTIFICATE_TOLERANCE sigma_width`` in every head, at most
    `rank_ceiling`."""
    ceiling = rank_ceiling(singular_values.shape[-1], width, base)
    if ceiling <= rank:
        return rank
    reference = singular_values[..., width - 1 : width]
    certified = (2**0.5 * singular_values[..., rank:ceiling] <= CERTIFICATE_TOLERANCE * reference).all(dim=0)
    hits = certified.nonzero()
    return rank + int(hits[0]) if len(hits) else ceiling


def stored_bytes(heads: int, size: int, columns: int, plain: bool) -> int:
    """The bytes a `CompactTarget` of ``heads`` compact heads holds: two (size, columns) bases in `BASIS_DTYPE`,
    and in float64 three (columns, columns) cores and two numbers per head, three where it serves Frobenius
    truncation too (``plain``: the plain tail). Where the columns cover the whole ``size`` (the exact solve) the
    bases stay in float64."""
    itemsize = 8 if columns >= size else BASIS_DTYPE.itemsize
    return heads * (2 * size * columns * itemsize + (3 * columns * columns + 2 + plain) * 8)


@dataclass(frozen=True)
class CompactTarget:
    """``Z - lam P`` of a layer's heads on fixed subspaces, for any per-head step lam (see the module doc).

    ``left_basis``/``right_basis`` (heads, d, k): the subspaces in model coordinates (orthonormal in the metric of
    C), in `BASIS_DTYPE` (in float64 where the subspaces are everything: the exact solve).
    ``base_core``/``step_core`` (heads, k, k): W and Q there. ``gradient_core``: M there, so that
    ``<M, basis_l X basis_r^T> = <gradient_core, X>``. ``step_sq``: ||Q||^2 (whitened); ``tail``: sigma_{s+1}(Q),
    zero where the subspaces are everything; ``plain_tail``: the spectral norm of P outside the subspaces (the
    certificate of Frobenius truncation; None where the solve was not asked for it).
    """

    left_basis: Tensor
    right_basis: Tensor
    base_core: Tensor
    step_core: Tensor
    gradient_core: Tensor
    step_sq: Tensor
    tail: Tensor
    plain_tail: Tensor | None = None

    @property
    def width(self) -> int:
        """k, the columns of each basis."""
        return self.left_basis.shape[-1]

    def padded(self, width: int) -> CompactTarget:
        """The same target on bases with zero columns up to ``width`` k, to stack chunks of heads solved to
        different ranks: zero columns add zero singular values and change no truncation, gain or norm."""
        extra = width - self.width
        if extra == 0:
            return self
        columns, square = (0, extra), (0, extra, 0, extra)
        pad = torch.nn.functional.pad
        return replace(
            self,
            left_basis=pad(self.left_basis, columns),
            right_basis=pad(self.right_basis, columns),
            **{name: pad(getattr(self, name), square) for name in ("base_core", "step_core", "gradient_core")},
        )

    def core(self, lam: Tensor) -> Tensor:
        """``L^T (W - lam Q) R`` for each head's lam, shape (heads, k, k)."""
        return self.base_core - lam[:, None, None] * self.step_core

    def decompose(
        self, lam: Tensor, method: str = "eigh", columns: int | None = None, truncation: str = "whitened"
    ) -> linalg.Decomposition:
        """The SVD of T^(lam) in the ``truncation``'s norm, in core coordinates: its truncations (up to rank
        ``columns``, None: any) are the best of T^(lam) in that norm. Whitened: the SVD of the core itself.
        Frobenius: that of ``G_l core G_r^T`` (G: the Cholesky factors of the bases' plain Gram matrices), its
        vectors mapped back by their inverses (the module doc)."""
        method = "svd" if method == "svd" else "eigh"
        if truncation == "whitened":
            return linalg.decompose_whitened(self.core(lam), None, method, columns=columns)
        left_root, right_root = map(_gram_root, self.bases(torch.float64))
        plain = linalg.decompose_whitened(left_root @ self.core(lam) @ right_root.mT, None, method, columns=columns)
        return linalg.Decomposition(
            torch.linalg.solve_triangular(left_root, plain.left_vectors, upper=True),
            torch.linalg.solve_triangular(right_root, plain.projected, upper=True),
            plain.singular_values,
            None,
        )

    def to_model(self, factors: linalg.Factorization) -> linalg.Factorization:
        """Core-coordinate factors mapped to model coordinates (the un-whitened Q/K form)."""
        left, right = self.bases(factors.left.dtype)
        return linalg.Factorization(left @ factors.left, right @ factors.right, factors.singular_values)

    def bases(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The left and right bases in ``dtype`` (float64 for products: they are stored in `BASIS_DTYPE`)."""
        return self.left_basis.to(dtype), self.right_basis.to(dtype)

    def gradient_inner(self, core_delta: Tensor) -> Tensor:
        """``<M, Delta>`` per head for the change ``Delta = L core_delta R^T``."""
        return (self.gradient_core * core_delta).sum(dim=(-2, -1))

    def metric_norm_sq(self, core_delta: Tensor) -> Tensor:
        """``||C^1/2 Delta C^1/2||^2`` per head for ``Delta = L core_delta R^T`` (the floored root of C; the bases
        are orthonormal in that metric)."""
        return core_delta.square().sum(dim=(-2, -1))

    def perturbation(self, lam: Tensor, truncation: str = "whitened") -> Tensor:
        """eps per head, in the ``truncation``'s norm: ``||T(lam) - T^(lam)||_2``, at most ``sqrt(2) |lam|
        sigma_{s+1}(Q)`` whitened and ``|lam| plain_tail`` in the plain norm, so each singular value of the compact
        target is within eps of the exact one's (Weyl), and its rank-r truncation's squared error within
        ``2 eps sum_{i<=r} sigma_i + r eps^2`` of the optimum. Zero where the compact solve is exact."""
        if truncation == "whitened":
            return 2**0.5 * lam.abs() * self.tail
        if self.plain_tail is None:
            raise ValueError("this target was solved without its plain tail: solve it for Frobenius truncation")
        return lam.abs() * self.plain_tail

    def relative_perturbation(
        self, lam: Tensor, singular_values: Tensor, rank: int, truncation: str = "whitened"
    ) -> Tensor:
        """The certificate reported per head: eps over the smallest singular value a rank-``rank`` truncation
        keeps (both in the ``truncation``'s norm). Far below 1, the truncation keeps the exact target's directions
        up to rotations of order eps / (sigma_r - sigma_{r+1})."""
        smallest = singular_values[..., rank - 1].clamp_min(torch.finfo(singular_values.dtype).tiny)
        return self.perturbation(lam, truncation) / smallest


def _gram_root(basis: Tensor) -> Tensor:
    """The upper-triangular G with ``G^T G = basis^T basis`` per head (Cholesky): G maps core coordinates to
    plain-orthonormal ones. Zero columns (`CompactTarget.padded`) get an identity block, which maps the zero rows and
    columns of the cores to themselves. (The bases are C-orthonormal, so their Gram matrices' condition number is at
    most C's floored one, 1 / rtol.)"""
    gram = basis.mT @ basis
    empty = gram.diagonal(dim1=-2, dim2=-1) == 0
    gram = gram + torch.diag_embed(empty.to(gram.dtype))
    return torch.linalg.cholesky(gram, upper=True)


def compact_target(
    base_left: Tensor,
    base_right: Tensor,
    step: Tensor,
    gradient_in_basis: Tensor,
    rank: int,
    metric: linalg.Metric,
    method: str = "eigh",
    width: int | None = None,
    plain: bool = False,
) -> CompactTarget:
    """Decompose each head's direction once and build its `CompactTarget`.

    ``base_left``/``base_right`` (heads, d, a): factors of W; ``step`` (heads, d, d): Q; both whitened by C^1/2 in
    C's eigenbasis (`linalg.whiten`). ``gradient_in_basis`` (heads, d, d): M in C's eigenbasis (U^T M U), not M.
    ``metric``: C's, to un-whiten the bases. ``rank``: s (`compact_rank`); ``method``: how Q is decomposed
    (`linalg.decompose_whitened`: "eigh", "svd" or "subspace"). ``width``: the grown width; with it, a full
    decomposition ("eigh", "svd") keeps more than ``rank`` where the certificate asks for it (`certified_rank`).
    ``plain``: also measure the plain tail, the certificate of Frobenius truncation (products of Q with the bases
    and the singular values of what they leave: about one more decomposition per head).
    """
    size = step.shape[-1]
    exact = base_left.shape[-1] + rank >= size
    if exact:  # the subspaces are everything
        identity = torch.eye(size, dtype=step.dtype, device=step.device).expand_as(step)
        left, right, tail = identity, identity, step.new_zeros(step.shape[0])
    else:
        ceiling = rank if width is None else max(rank, rank_ceiling(size, width, base_left.shape[-1]))
        decomposition = linalg.decompose_whitened(step, None, method, rank=rank, columns=ceiling)
        if width is not None and method != "subspace":
            rank = certified_rank(decomposition.singular_values, width, rank, base_left.shape[-1])
        directions = decomposition.projected[..., :rank]  # V_s S_s: spans V_s where sigma > 0
        left = lapack.orthonormal_columns(torch.cat([base_left, decomposition.left_vectors[..., :rank]], dim=-1))
        right = lapack.orthonormal_columns(torch.cat([base_right, directions], dim=-1))
        tail = decomposition.singular_values[..., rank]
    base_core = (left.mT @ base_left) @ (right.mT @ base_right).mT
    step_core = left.mT @ step @ right
    step_sq = step.square().sum(dim=(-2, -1))
    plain_tail = None
    if plain and exact:
        plain_tail = torch.zeros_like(tail)
    elif plain:  # ||C^-1/2 (Q - L L^T Q R R^T) C^-1/2||_2, in C's eigenbasis a scaling by 1 / root on each side
        inverse_root = 1 / metric.root_diag
        outside = (step - left @ step_core @ right.mT) * inverse_root[..., :, None] * inverse_root[..., None, :]
        plain_tail = torch.linalg.matrix_norm(outside, ord=2)
        del outside
    # whitened coordinates -> C's eigenbasis (diag(1 / root) basis, where M is) -> model coordinates (U times it)
    scale = 1 / metric.root_diag[..., :, None]
    left, right = left * scale, right * scale
    gradient_core = left.mT @ gradient_in_basis @ right
    left, right = metric.eigenvectors @ left, metric.eigenvectors @ right
    if not exact:  # stored narrower; exact solves (narrow models, square bases) keep theirs as they are
        left, right = left.to(BASIS_DTYPE), right.to(BASIS_DTYPE)
    return CompactTarget(left, right, base_core, step_core, gradient_core, step_sq, tail, plain_tail)
