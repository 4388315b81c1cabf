"""The solve against closed forms: Eckart-Young, exactness, metric optimality, singular C."""

import pytest
import torch

from hf_grow import linalg


def random_psd(d: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    factor = torch.randn(d, rank, generator=generator, dtype=torch.float64)
    return factor @ factor.T / rank


def low_rank(d: int, rank: int, generator: torch.Generator, batch: int = 3) -> torch.Tensor:
    left = torch.randn(batch, d, rank, generator=generator, dtype=torch.float64)
    right = torch.randn(batch, d, rank, generator=generator, dtype=torch.float64)
    return left @ right.mT


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_frobenius_residual_is_eckart_young(generator):
    target = torch.randn(3, 12, 12, generator=generator, dtype=torch.float64)
    for rank in (1, 4, 11):
        factors = linalg.truncate(target, rank)
        residual = (target - factors.product).square().sum(dim=(-2, -1))
        expected = factors.singular_values[:, rank:].square().sum(dim=-1)
        torch.testing.assert_close(residual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("singular", [False, True])
def test_exact_reconstruction_when_rank_fits(generator, singular):
    d = 10
    metric = linalg.metric_from_second_moment(random_psd(d, 6 if singular else 40, generator))
    target = low_rank(d, 3, generator)
    for chosen in (None, metric):
        for rank in (3, 5, d):
            torch.testing.assert_close(linalg.truncate(target, rank, chosen).product, target, rtol=1e-8, atol=1e-8)


def test_whitened_truncation_is_optimal_in_the_metric(generator):
    d, rank = 9, 3
    second_moment = random_psd(d, 30, generator)
    metric = linalg.metric_from_second_moment(second_moment)
    root = torch.linalg.cholesky(second_moment)  # L L^T = C: ||L^T A L|| = ||C^1/2 A C^1/2||

    def metric_error(approximation):
        return (root.T @ (target - approximation) @ root).square().sum(dim=(-2, -1))

    target = torch.randn(d, d, generator=generator, dtype=torch.float64)
    best = metric_error(linalg.truncate(target, rank, metric).product)
    expected = linalg.truncate(target, rank, metric).singular_values[rank:].square().sum()
    torch.testing.assert_close(best, expected, rtol=1e-9, atol=1e-9)
    frobenius = metric_error(linalg.truncate(target, rank).product)
    assert best < frobenius
    for _ in range(200):
        competitor = low_rank(d, rank, generator, batch=1)[0]
        assert best <= metric_error(competitor)
    # Local perturbations of the optimum within rank r never do better either.
    factors = linalg.truncate(target, rank, metric)
    for _ in range(50):
        left = factors.left + 1e-3 * torch.randn(factors.left.shape, generator=generator, dtype=torch.float64)
        assert best <= metric_error(left @ factors.right.mT) + 1e-12


def test_singular_second_moment_like_layernorm(generator):
    # Centered features (rows sum to zero, as after LayerNorm without affine) plus the ones column.
    features = torch.randn(500, 8, generator=generator, dtype=torch.float64)
    features = features - features.mean(dim=1, keepdim=True)
    augmented = torch.cat([features, torch.ones(500, 1, dtype=torch.float64)], dim=1)
    second_moment = augmented.T @ augmented / 500
    metric = linalg.metric_from_second_moment(second_moment)
    assert metric.rank == 8  # one exact null direction: [1, ..., 1, 0]
    pinv = metric.from_basis(torch.diag_embed(metric.pinv_diag))
    torch.testing.assert_close(second_moment @ pinv @ second_moment, second_moment, rtol=1e-9, atol=1e-9)
    gradient = torch.randn(9, 9, generator=generator, dtype=torch.float64)
    direction = linalg.solve_direction(gradient, metric)
    null = torch.cat([torch.ones(8), torch.zeros(1)]).double()
    assert torch.isfinite(direction).all()
    assert direction @ null == pytest.approx(torch.zeros(9), abs=1e-9)  # the step stays where data lives
    torch.testing.assert_close(direction, pinv @ gradient @ pinv)


def test_zero_second_moment_is_a_clear_error():
    with pytest.raises(ValueError, match="no \\(non-padding\\) tokens"):
        linalg.metric_from_second_moment(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(FloatingPointError):
        linalg.metric_from_second_moment(torch.full((4, 4), float("nan"), dtype=torch.float64))


def test_balanced_factorization(generator):
    target = torch.randn(2, 8, 8, generator=generator, dtype=torch.float64)
    factors = linalg.truncate(target, 4)
    torch.testing.assert_close(factors.left.norm(dim=-2), factors.right.norm(dim=-2))
    torch.testing.assert_close(factors.left.norm(dim=-2).square(), factors.singular_values[:, :4])


def test_step_minimizes_the_local_model_and_gains_read_from_singular_values(generator):
    d, rank, lam = 8, 3, 0.7
    metric = linalg.metric_from_second_moment(random_psd(d, 40, generator))
    bilinear = low_rank(d, 2, generator, batch=1)[0]
    gradient = torch.randn(d, d, generator=generator, dtype=torch.float64)
    direction = linalg.solve_direction(gradient, metric)
    best = linalg.predicted_decrease(gradient, -lam * direction, metric, lam)
    for _ in range(50):
        other = -lam * direction + 0.05 * torch.randn(d, d, generator=generator, dtype=torch.float64)
        assert linalg.predicted_decrease(gradient, other, metric, lam) <= best
    # Rank-r whitened truncation: decrease = lam/2 ||P||_C^2 - sum_{i>r} sigma_i^2 / (2 lam).
    factors = linalg.truncate(bilinear - lam * direction, rank, metric)
    decrease = linalg.predicted_decrease(gradient, factors.product - bilinear, metric, lam)
    gains = linalg.rank_gains(factors.singular_values, lam)
    expected = lam / 2 * linalg.whitened_norm_sq(direction, metric) - gains[rank:].sum()
    torch.testing.assert_close(decrease, expected, rtol=1e-8, atol=1e-10)
    assert (gains[:-1] >= gains[1:]).all() and (gains >= 0).all()
    assert float(linalg.predicted_decrease(gradient, direction, metric, 0.0)) == 0.0


def test_truncate_rejects_impossible_ranks(generator):
    target = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    with pytest.raises(ValueError, match="exceeds"):
        linalg.truncate(target, 6)
    with pytest.raises(ValueError, match="positive"):
        linalg.truncate(target, 0)


@pytest.mark.parametrize("singular", [False, True])
def test_eigh_and_svd_methods_agree(generator, singular):
    """The fast eigh-of-A A^T path gives the full SVD's truncation, also for rank-deficient targets."""
    d = 24
    metric = linalg.metric_from_second_moment(random_psd(d, 10 if singular else 60, generator))
    for target in (torch.randn(4, d, d, generator=generator, dtype=torch.float64), low_rank(d, 5, generator, batch=4)):
        for chosen in (None, metric):
            fast, exact = linalg.decompose(target, chosen, "eigh"), linalg.decompose(target, chosen, "svd")
            scale = exact.singular_values[..., :1]
            torch.testing.assert_close(fast.singular_values / scale, exact.singular_values / scale, rtol=0, atol=1e-7)
            # Compared in the norm each truncation is optimal in (off the data's span the metric is floored).
            def norm(matrix):
                squares = matrix.square().sum(dim=(-2, -1)) if chosen is None else linalg.whitened_norm_sq(matrix, metric)
                return squares.sqrt()

            for rank in (1, 5, 8, d):
                fast_product, exact_product = fast.truncate(rank).product, exact.truncate(rank).product
                error = norm(fast_product - exact_product) / norm(exact_product)
                assert error.max() < 1e-6, (rank, error)
    with pytest.raises(ValueError, match="method"):
        linalg.decompose(target, None, "qr")



def test_appended_weights_keep_the_old_form_and_add_the_best_rank_p_step(generator):
    d, qk_dim, p, lam = 10, 3, 2, 0.7
    metric = linalg.metric_from_second_moment(random_psd(d, 40, generator))
    query = torch.randn(3, d, qk_dim, generator=generator, dtype=torch.float64)
    key = torch.randn(3, d, qk_dim, generator=generator, dtype=torch.float64)
    direction = torch.randn(3, d, d, generator=generator, dtype=torch.float64)
    scaling_before, scaling_after = qk_dim**-0.5, (qk_dim + p) ** -0.5
    old = linalg.bilinear_form(query, key, scaling_before)
    unit = linalg.truncate(-direction, p, metric)

    at_zero = linalg.appended_weights(query, key, scaling_before, scaling_after, linalg.rescaled_to_step(unit, 0.0))
    assert at_zero[0].shape == at_zero[1].shape == (3, d, qk_dim + p)
    torch.testing.assert_close(linalg.bilinear_form(*at_zero, scaling_after), old, rtol=1e-12, atol=1e-12)
    assert torch.equal(at_zero[1][..., :qk_dim], key)  # old keys kept bit for bit

    stepped = linalg.appended_weights(query, key, scaling_before, scaling_after, linalg.rescaled_to_step(unit, lam))
    added = linalg.bilinear_form(*stepped, scaling_after) - old
    torch.testing.assert_close(added, linalg.truncate(-lam * direction, p, metric).product, rtol=1e-9, atol=1e-9)
    # The added rank-p form is the best one in the metric of C: no other rank-p form is closer to -lam P.
    best = linalg.whitened_norm_sq(added + lam * direction, metric)
    for _ in range(5):
        other = added + 0.1 * low_rank(d, 1, generator)
        other = linalg.truncate(other, p).product
        assert (linalg.whitened_norm_sq(other + lam * direction, metric) >= best - 1e-9).all()
    # The new dimensions are balanced in the metric: C^1/2 L and C^1/2 R have equal column norms (sqrt sigma).
    root = metric.eigenvectors @ torch.diag_embed(metric.root_diag) @ metric.eigenvectors.mT
    left_norms = (root @ stepped[0][..., qk_dim:]).norm(dim=-2)
    right_norms = (root @ stepped[1][..., qk_dim:]).norm(dim=-2)
    torch.testing.assert_close(left_norms, right_norms, rtol=1e-9, atol=1e-12)
    assert (left_norms > 0).all()
    with pytest.raises(ValueError, match="lam must be >= 0"):
        linalg.rescaled_to_step(unit, -1.0)
