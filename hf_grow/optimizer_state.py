"""The optimizer state a growth gives the query/key entries it adds (or, in mode "refactor", rewrites).

Adam's update of an entry is m_hat / sqrt(v_hat) with bias corrections that assume moments as old as the step
count. An entry whose moments restart at zero at a large step count gets v_hat ~ (1 - beta2) g^2 after its
first gradient and m_hat ~ (1 - beta1) g, an update of about (1 - beta1) / sqrt(1 - beta2) ~ 3 times the usual
size, for its first ~1 / (1 - beta2) steps. ``new_moments="head_mean"`` instead starts the second moments of the
new entries at the mean second moment of the old entries of the same head and role (query or key): their
first updates are then about (1 - beta1) times the usual size and grow to it within ~1 / (1 - beta1) steps, a
short warm-up of the new entries only. First moments (momentum) of new entries start at zero either way.
"""

from __future__ import annotations

from torch import Tensor


#: How the optimizer moments of new Q/K entries start: "zero" (as a fresh optimizer would), or "head_mean"
#: (second moments from the old entries of the same head and role, first moments zero).
NEW_MOMENTS: tuple[str, ...] = ("zero", "head_mean")
#: On bench_bottleneck's plateau preset (3 seeds) head_mean made no difference to refactor or append (mean loss
#: over training within the seed spread, slightly higher); in one pilot seed of a wider-MLP variant it saved
#: append from stalling at 88% accuracy. Inside transformers.Trainer (bench_growth_callback, 8 seeds) it left
#: refactor behind the original on every seed, beyond twice the spread (BENCHMARKS.md). Zero, what a fresh
#: optimizer does, stays the default.
DEFAULT_NEW_MOMENTS = "zero"


def check_new_moments(new_moments: str) -> None:
    if new_moments not in NEW_MOMENTS:
        raise ValueError(f"new_moments must be one of {NEW_MOMENTS}, got {new_moments!r}")


def fill_new_moments(state: Tensor, old: Tensor, start: int, degree: int, new_moments: str) -> Tensor:
    """``state`` (heads, d_e + 1, new_dim) of one role with its entries from column ``start`` on set by the rule.

    ``old`` (heads, d_e + 1, old_dim) is the state of the old entries of the same role, in the units of the new
    weights (the queries' rescaled by the fold of the attention scale). Only second moments (``degree`` 2:
    Adam's ``exp_avg_sq``, ``max_exp_avg_sq``, Adagrad's ``sum``, RMSprop's ``square_avg``) are filled; other
    state and ``new_moments="zero"`` leave ``state`` as it is (zeros in the new entries).
    """
    check_new_moments(new_moments)
    if new_moments == "zero" or degree != 2 or old.shape[-1] == 0 or start >= state.shape[-1]:
        return state
    state = state.clone()
    state[..., start:] = old.mean(dim=(1, 2), keepdim=True).to(state.dtype)
    return state
