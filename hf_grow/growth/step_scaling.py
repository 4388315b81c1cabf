"""How a relative step size becomes each head's lam: the step normalization of `hf_grow.config.STEP_MODES`.

Only the lam units, the head factors and the layer scales depend on the step mode, so changing it needs no new
solve (`StepScaling.set_step_mode`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import STEP_MODES
from .layer_solve import LayerProblem


class StepScaling:
    """The step normalization of a solved problem: needs ``layers`` (each a `LayerProblem` with its norms) and
    ``truncation``; sets ``step_mode``, ``lam_unit``, ``layer_lam_units``, ``head_factors`` and ``layer_scales``."""

    layers: list[LayerProblem]
    truncation: str

    def set_step_mode(self, step_mode: str) -> None:
        """Take steps the ``step_mode`` way (`hf_grow.config.STEP_MODES`) from now on, without solving again: only
        the lam units, the head factors and the layer scales depend on it."""
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {step_mode!r}")
        self.step_mode = step_mode
        self.layer_scales = [1.0] * len(self.layers)
        #: The model-wide lam per unit step size (with steps per layer, the root mean square of the layers'),
        #: each layer's own, and each head's relative to its layer's (ones but with ``step_mode="per_head"``).
        norm = "whitened" if self.step_mode == "global" else self.truncation
        norms = [part.norms[norm] for part in self.layers]
        self.lam_unit, self.layer_lam_units = _lam_units(norms, self.step_mode)
        self.head_factors = [
            _head_factors(scores, step, part.groups, unit, self.step_mode)
            for (scores, step), part, unit in zip(norms, self.layers, self.layer_lam_units)
        ]

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


def _lam_units(norms: list[tuple[Tensor, Tensor]], step_mode: str) -> tuple[float, list[float]]:
    """lam per unit step size, of the model and of each layer (see `hf_grow.config.STEP_MODES`), from each
    layer's per-head norms (`LayerProblem.norms`: whitened for "global", else in the truncation's norm)."""
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
