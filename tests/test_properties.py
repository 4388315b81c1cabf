"""Property-based tests of the solve (hypothesis): random and singular PSD C, random M and Z.

Hypothesis draws the sizes, ranks, eigenvalue spreads and a seed; torch builds the matrices from the seed, so a
failing example is reproducible from what hypothesis prints. Singular C are built with eigenvalues that are
either exactly zero or well above the relative tolerance, as the LayerNorm'd statistics are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_grow import linalg


settings.register_profile("hf_grow", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("hf_grow")


@dataclass
class Problem:
    second_moment: torch.Tensor
    metric: linalg.Metric
    gradient: torch.Tensor
    bilinear: torch.Tensor
    qk_dim: int


@st.composite
def problems(draw) -> Problem:
    """C (possibly singular, possibly ill-conditioned), M, and Z of rank d_k, for 2 heads."""
    d = draw(st.integers(3, 12))
    rank_c = draw(st.integers(1, d))
    qk_dim = draw(st.integers(1, d - 1))
    log_spread = draw(st.floats(0.0, 4.0))  # eigenvalues of C spread over up to 4 decades
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    options = dict(generator=generator, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(d, d, **options))
    eigenvalues = torch.zeros(d, dtype=torch.float64)
    eigenvalues[:rank_c] = torch.logspace(0, -log_spread, rank_c, dtype=torch.float64)
    second_moment = basis @ torch.diag(eigenvalues) @ basis.T
    bilinear = torch.randn(2, d, qk_dim, **options) @ torch.randn(2, d, qk_dim, **options).mT
    projector = basis[:, :rank_c] @ basis[:, :rank_c].T
    gradient = projector @ torch.randn(2, d, d, **options) @ projector  # M = X'^T G X' lies in the data span
    return Problem(second_moment, linalg.metric_from_second_moment(second_moment), gradient, bilinear, qk_dim)


@given(problems(), st.sampled_from(linalg.TRUNCATIONS), st.sampled_from(linalg.SVD_METHODS))
def test_step_zero_is_exact(problem, truncation, method):
    """Truncating Z itself to its own rank (or more) gives Z back on the data: lam = 0 keeps the function.

    Everywhere for the Frobenius truncation and for a full-rank C; for a singular C the whitened truncation may
    drop what whitening shrinks off the data's span (the Metric docstring), which no input in the span sees.
    """
    metric = problem.metric if truncation == "whitened" else None
    decomposition = linalg.decompose(problem.bilinear, metric, method)
    on_data_scale = linalg.whitened_norm_sq(problem.bilinear, problem.metric)
    for rank in {problem.qk_dim, problem.bilinear.shape[-1]}:
        product = decomposition.truncate(rank).product
        assert (linalg.whitened_norm_sq(product - problem.bilinear, problem.metric) <= 1e-10 * on_data_scale).all()
        if truncation == "frobenius" or problem.metric.rank == problem.bilinear.shape[-1]:
            torch.testing.assert_close(product, problem.bilinear, rtol=1e-7, atol=1e-7 * problem.bilinear.abs().max())


@given(problems(), st.floats(1e-3, 1e3), st.integers(1, 11))
def test_whitened_truncation_attains_the_eckart_young_bound(problem, lam, rank):
    """The metric error of the whitened truncation equals the tail of the whitened spectrum: no rank-r matrix
    does better (Eckart-Young in the metric); the Frobenius truncation never beats it in that metric."""
    rank = min(rank, problem.bilinear.shape[-1])
    target = problem.bilinear - lam * linalg.solve_direction(problem.gradient, problem.metric)
    whitened = linalg.decompose(target, problem.metric).truncate(rank)
    error = linalg.whitened_norm_sq(target - whitened.product, problem.metric)
    tail = whitened.singular_values[..., rank:].square().sum(dim=-1)
    scale = whitened.singular_values.square().sum(dim=-1)
    torch.testing.assert_close(error, tail, rtol=1e-6, atol=1e-9 * float(scale.max()))
    frobenius = linalg.truncate(target, rank)
    frobenius_error = linalg.whitened_norm_sq(target - frobenius.product, problem.metric)
    assert (error <= frobenius_error + 1e-9 * scale).all()


@given(problems())
def test_direction_is_the_pseudo_inverse_solve(problem):
    """P = C^+ M C^+ (against torch's pseudo-inverse), and C P C = M for M in the span of the data."""
    direction = linalg.solve_direction(problem.gradient, problem.metric)
    assert torch.isfinite(direction).all()
    pinv = torch.linalg.pinv(problem.second_moment, rtol=1e-6, hermitian=True)
    scale = float(problem.gradient.abs().max() * pinv.abs().max() ** 2)
    torch.testing.assert_close(direction, pinv @ problem.gradient @ pinv, rtol=1e-6, atol=1e-9 * scale)
    torch.testing.assert_close(
        problem.second_moment @ direction @ problem.second_moment,
        problem.gradient,
        rtol=1e-6,
        atol=1e-8 * float(problem.gradient.abs().max()),
    )


@given(problems(), st.floats(1e-3, 1e3), st.integers(1, 11), st.sampled_from(linalg.TRUNCATIONS))
def test_roles_of_query_and_key_are_symmetric(problem, lam, rank, truncation):
    """Transposing the target swaps the factors (query <-> key) and transposes the product; the split is
    balanced: L^T C~ L = R^T C~ R = diag(sigma) in the (floored) metric, L^T L = R^T R for Frobenius."""
    rank = min(rank, problem.bilinear.shape[-1])
    metric = problem.metric if truncation == "whitened" else None
    target = problem.bilinear - lam * linalg.solve_direction(problem.gradient, problem.metric)
    factors = linalg.truncate(target, rank, metric, method="svd")
    transposed = linalg.truncate(target.mT, rank, metric, method="svd")
    scale = float(factors.singular_values.max())
    torch.testing.assert_close(transposed.product, factors.product.mT, rtol=1e-7, atol=1e-9 * scale)
    gram = torch.eye(target.shape[-1], dtype=target.dtype)
    if metric is not None:
        gram = metric.from_basis(torch.diag_embed(metric.root_diag.square()))
    left_gram, right_gram = factors.left.mT @ gram @ factors.left, factors.right.mT @ gram @ factors.right
    sigma = factors.singular_values[..., :rank]
    kept = sigma > linalg.SINGULAR_VALUE_RTOL * factors.singular_values[..., :1]
    expected = torch.diag_embed(torch.where(kept, sigma, torch.zeros_like(sigma)))
    torch.testing.assert_close(left_gram, expected, rtol=1e-6, atol=1e-8 * scale)
    torch.testing.assert_close(right_gram, expected, rtol=1e-6, atol=1e-8 * scale)


@given(problems(), st.floats(0.0, 1e6), st.integers(1, 11), st.sampled_from(linalg.SVD_METHODS))
def test_no_nan_anywhere(problem, lam, rank, method):
    """Singular and ill-conditioned C, zero or huge steps: every output of the solve is finite."""
    rank = min(rank, problem.bilinear.shape[-1])
    direction = linalg.solve_direction(problem.gradient, problem.metric)
    target = problem.bilinear - lam * direction
    decomposition = linalg.decompose(target, problem.metric, method)
    factors = decomposition.truncate(rank)
    delta = factors.product - problem.bilinear
    outputs = [
        direction,
        factors.left,
        factors.right,
        decomposition.singular_values,
        linalg.predicted_decrease(problem.gradient, delta, problem.metric, lam),
        linalg.rank_gains(decomposition.singular_values, lam),
    ]
    assert all(torch.isfinite(output).all() for output in outputs)


@given(problems(), st.floats(1e-3, 1e3))
def test_expected_gain_of_the_full_step_is_half_the_first_order_gain(problem, lam):
    """At full rank the update is -lam P exactly and the local model predicts lam <M, P> / 2 >= 0; every
    truncation to lower rank predicts no more than that."""
    direction = linalg.solve_direction(problem.gradient, problem.metric)
    full = linalg.predicted_decrease(problem.gradient, -lam * direction, problem.metric, lam)
    half_first_order = lam * (problem.gradient * direction).sum(dim=(-2, -1)) / 2
    torch.testing.assert_close(full, half_first_order, rtol=1e-6, atol=1e-9 * float(half_first_order.abs().max() + 1))
    assert (full >= -1e-9).all()
    target = problem.bilinear - lam * direction
    truncated = linalg.truncate(target, problem.qk_dim, problem.metric).product
    assert (
        linalg.predicted_decrease(problem.gradient, truncated - problem.bilinear, problem.metric, lam)
        <= full + 1e-9 * full.abs().max() + 1e-12
    ).all()


@given(problems(), st.floats(0.0, 1e3), st.integers(1, 11))
def test_subspace_truncation_is_near_optimal(problem, lam, rank):
    """The top-r subspace method on singular, ill-conditioned C: finite, and within its tolerance of the
    Eckart-Young optimum in the metric, also at lam = 0 (where growth itself keeps the old weights)."""
    rank = min(rank, problem.bilinear.shape[-1])
    target = problem.bilinear - lam * linalg.solve_direction(problem.gradient, problem.metric)
    exact = linalg.decompose(target, problem.metric, "svd").truncate(rank)
    fast = linalg.decompose(target, problem.metric, "subspace", rank=rank).truncate(rank)
    assert torch.isfinite(fast.left).all() and torch.isfinite(fast.right).all()
    optimum = linalg.whitened_norm_sq(target - exact.product, problem.metric)
    error = linalg.whitened_norm_sq(target - fast.product, problem.metric)
    scale = exact.singular_values.square().sum(dim=-1)
    assert (error <= optimum * (1 + 1e-5) + 1e-10 * scale).all()
