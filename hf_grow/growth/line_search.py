"""The held-out loss, the held-out batches, and the search over step sizes that minimizes the loss."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, get_adapter, is_peft_model
from ..distributed import Processes, unwrap_model
from ..option_values import held_out_count
from ..statistics import (
    LossFn,
    batch_loss_weight,
    compute_loss,
    iterate_batches,
    module_modes,
    restore_modes,
    without_kv_cache,
)


if TYPE_CHECKING:
    from accelerate import Accelerator


NO_LOSS_TERMS = ("{data} holds no loss terms (no batches, every label is -100, or for a causal LM sequences of one "
                 "token): pass batches with labels.")


def evaluate_loss(
    model: PreTrainedModel,
    batches: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter | None = None,
    loss_fn: LossFn | None = None,
    accelerator: Accelerator | None = None,
) -> tuple[float, int]:
    """Mean loss over ``batches``, each batch weighted by the number of loss terms it averages over (with a
    ``loss_fn``, whose normalization is unknown, by its number of sequences).

    Returns ``(loss, total_weight)``; the model runs in eval mode without gradients and without a key/value cache
    (`without_kv_cache`), and keeps its mode and config. With an ``accelerator``, every process passes its own
    batches and gets the loss over all of them.
    """
    model = unwrap_model(model, accelerator)
    adapter = adapter or get_adapter(model.get_base_model() if is_peft_model(model) else model)
    processes = Processes(accelerator)
    device = next(model.parameters()).device
    modes = module_modes(model)
    model.eval()
    total, weight = 0.0, 0
    try:
        with processes.failing_together(), torch.no_grad(), without_kv_cache(model):
            for batch in iterate_batches(batches, model):
                batch_weight = batch_loss_weight(adapter, model, batch, loss_fn)
                if batch_weight == 0:
                    continue  # no loss term: the model's loss is 0 / 0
                total += float(compute_loss(model, batch, loss_fn)) * batch_weight
                weight += batch_weight
    finally:
        restore_modes(modes)
    if processes.world_size > 1:
        total, weight = processes.sum_(torch.tensor([total, weight], dtype=torch.float64, device=device)).tolist()
        weight = int(weight)
    if weight == 0:
        raise ValueError(NO_LOSS_TERMS.format(data="the evaluation data"))
    return total / weight, weight


def split_batches(
    dataloader: Iterable,
    eval_dataloader: Iterable | None,
    eval_fraction: float,
    needs_eval: bool,
    allow_empty: bool = False,
    max_batches: int | None = None,
) -> tuple[Iterable, list[dict[str, Tensor]] | None]:
    """Statistics batches and held-out batches (materialized: the line search reads them many times).
    ``allow_empty``: an eval_dataloader without batches is this process's empty share of several processes'
    (their held-out losses are summed; the caller refuses where all are empty). ``max_batches``: the statistics'
    cap; held out from the dataloader, only the fewest batches that leave that many beside the held-out share are
    read (a long or endless dataloader is not read to its end)."""
    if eval_dataloader is not None:
        eval_batches = list(eval_dataloader)
        if not eval_batches and not allow_empty:
            raise ValueError("eval_dataloader yielded no batches.")
        return dataloader, eval_batches
    if not needs_eval:
        return dataloader, None
    if max_batches is not None:
        dataloader = itertools.islice(dataloader, batches_read(max_batches, eval_fraction))
    batches = list(dataloader)
    if len(batches) < 2:
        raise ValueError(
            f"the dataloader yielded {len(batches)} batch(es): the line search holds out the last "
            f"{eval_fraction:.0%} of at least 2 batches. Pass more data, an eval_dataloader, or a step_size."
        )
    num_eval = held_out_count(len(batches), eval_fraction)
    if num_eval >= len(batches):
        raise ValueError(
            f"eval_fraction={eval_fraction} holds out all {len(batches)} batches, leaving none for the statistics: "
            "lower eval_fraction, pass more data or an eval_dataloader."
        )
    return batches[:-num_eval], batches[-num_eval:]


def batches_read(max_batches: int, eval_fraction: float) -> int:
    """The fewest batches whose held-out share (`held_out_count`) leaves ``max_batches`` for the statistics."""
    total = max_batches + 1
    while total - held_out_count(total, eval_fraction) < max_batches:
        total += 1
    return total


def can_confirm_a_choice(held_out_batches: int, searched: bool) -> bool:
    """Whether a choice among candidates can be made and confirmed: the step is searched (no step size given)
    and at least 2 held-out batches split into search and confirmation batches."""
    return searched and held_out_batches >= 2


def confirmation_split(
    batches: list[dict[str, Tensor]] | None, fraction: float, searched: bool
) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]] | None:
    """The held-out batches for the search and the last ``fraction`` of them (at least one) for confirmation;
    None when no choice can be made (`can_confirm_a_choice`)."""
    if batches is None or not can_confirm_a_choice(len(batches), searched):
        return None
    count = min(held_out_count(len(batches), fraction), len(batches) - 1)
    return batches[:-count], batches[-count:]


#: A loss this many float32 units of step 0's loss from it ties with it: a held-out loss is a mean of float32
#: losses, which a change of the weights below their rounding moves by an ulp or two either way (a step that
#: "gained" one ulp rewrote every query/key weight of a model with nothing to gain).
TIE_ULPS = 2


def ties_step_zero(loss: float, loss_at_zero: float) -> bool:
    """Whether ``loss`` lies within `TIE_ULPS` float32 units (at step 0's loss) of step 0's loss."""
    float32_ulp = math.ulp(loss_at_zero) * 2.0 ** 29  # float64's unit in the last place has 29 more bits
    return math.isfinite(loss_at_zero) and abs(loss - loss_at_zero) <= TIE_ULPS * float32_ulp


def within_precision(loss: float, loss_at_zero: float, dtype: torch.dtype) -> bool:
    """Whether ``loss`` lies within the rounding of a model computing in ``dtype`` of step 0's loss: `ties_step_zero`,
    or within that dtype's epsilon relative to the loss (a bfloat16 MiniLM's held-out loss moved by up to 0.02 at
    4.7 at tiny steps, a float16 one's by 7e-4)."""
    epsilon = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return ties_step_zero(loss, loss_at_zero) or (
        math.isfinite(loss_at_zero) and abs(loss - loss_at_zero) <= epsilon * abs(loss_at_zero))


def search_step_size(
    evaluate: Callable[[float], float],
    start: float,
    factor: float = 4.0,
    max_expansions: int = 12,
    refinements: int = 4,
    known: Mapping[float, float] | None = None,
) -> dict[float, float]:
    """Losses at the step sizes tried: 0, a log grid from ``start`` followed downhill, then a refined bracket.

    The grid steps down until a step beats step 0, then moves by ``factor`` while the loss falls; the
    bracket around the best grid point is then halved ``refinements`` times in log space (geometric means).
    A step gains where its loss is below step 0's by more than the loss's rounding (`ties_step_zero`). The walk
    down stops at the second step in a row whose loss ties with step 0's: a smaller step changes the loss by less
    than its rounding, so it could only "gain" by rounding (9 of 12 steps walked there on a model without gains);
    one tie alone can be a loss curve crossing step 0's level beyond its minimum. A ``start`` that ties may also be
    the flat beginning of a curve that falls further out (a byte GPT-2 gained at step 1.92 where 0.03 tied): the
    grid first looks up from it, while the losses tie (`_gain_further_out`).
    A non-finite loss (a step that overflows in low precision) counts as +inf, so it is never the best.
    ``known`` losses (e.g. of the step already taken) are not evaluated again.
    """
    losses = {step: value if math.isfinite(value) else math.inf for step, value in (known or {}).items()}

    def loss(step: float) -> float:
        if step not in losses:
            value = evaluate(step)
            losses[step] = value if math.isfinite(value) else math.inf
        return losses[step]

    step, tied = start, False
    if ties_step_zero(loss(start), loss(0.0)):
        step = _gain_further_out(loss, start, factor, max_expansions) or start
    for _ in range(max_expansions):
        tie = ties_step_zero(loss(step), loss(0.0))
        if loss(step) < loss(0.0) and not tie:
            break
        if tie and tied:
            return losses
        tied = tie
        step /= factor
    else:
        return losses
    for _ in range(max_expansions):
        if loss(step * factor) < loss(step):
            step *= factor
        elif loss(step / factor) < loss(step):
            step /= factor
        else:
            break
    low, best, high = step / factor, step, step * factor
    for _ in range(refinements):
        probe = math.sqrt(best * high) if high / best >= best / low else math.sqrt(low * best)
        if loss(probe) < loss(best):
            low, high = (best, high) if probe > best else (low, best)
            best = probe
        else:
            low, high = (low, probe) if probe > best else (probe, high)
    return losses


def _gain_further_out(loss: Callable[[float], float], start: float, factor: float, max_expansions: int) -> float | None:
    """The first step above ``start`` (by ``factor``) that gains beyond rounding, looking up while the losses tie
    with step 0's; None where a step loses first (a model with nothing to gain loses clearly a step or two up)."""
    step = start
    for _ in range(max_expansions):
        step *= factor
        if not ties_step_zero(loss(step), loss(0.0)):
            return step if loss(step) < loss(0.0) else None
    return None


def best_step(losses: Mapping[float, float], confirmed: bool = False) -> float:
    """The step of least loss; of equal losses the smallest step, and step 0 where the least loss ties with its
    (`ties_step_zero`: nothing is gained beyond rounding). A non-finite loss (NaN too, which compares false with
    everything) is never the least.

    ``confirmed`` (a half-precision model, whose arithmetic moves the loss by more than a float32 tie): only a
    step whose searched neighbour (the next smaller or larger step tried) also gains counts, since a loss curve is
    smooth over a step of ``factor`` and rounding is not. A bfloat16 MiniLM took t = 9.2e-7 for a "gain" of 0.005
    whose neighbours were worse than step 0; the gains of bfloat16 GPT-2s and BERTs, 0.001-0.19 nats, were all
    confirmed (a review, 2026-11-30)."""
    def finite(step: float) -> float:
        return losses[step] if math.isfinite(losses[step]) else math.inf

    best = min(losses, key=lambda step: (finite(step), step))
    if 0.0 not in losses:
        return best
    if ties_step_zero(losses[best], losses[0.0]):
        return 0.0
    if not confirmed:
        return best
    steps = sorted(step for step in losses if step > 0)

    def gains(index: int) -> bool:
        return 0 <= index < len(steps) and finite(steps[index]) < losses[0.0] and not ties_step_zero(
            losses[steps[index]], losses[0.0])

    kept = [step for index, step in enumerate(steps) if gains(index) and (gains(index - 1) or gains(index + 1))]
    return min(kept, key=lambda step: (finite(step), step)) if kept else 0.0
