"""The held-out loss, the held-out batches, and the search over step sizes that minimizes the loss."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, get_adapter
from ..distributed import Processes, unwrap_model
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


_NO_LOSS_TERMS = "{data} holds no loss terms (no batches, or every label is -100): pass batches with labels."


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
    adapter = adapter or get_adapter(model)
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
        raise ValueError(_NO_LOSS_TERMS.format(data="the evaluation data"))
    return total / weight, weight


def held_out_count(total: int, eval_fraction: float) -> int:
    """How many of ``total`` batches are held out for the line search: the last ``eval_fraction``, at least one.
    The command line holds out as many of its sequences of text the same way."""
    return max(1, round(eval_fraction * total))


def split_batches(
    dataloader: Iterable,
    eval_dataloader: Iterable | None,
    eval_fraction: float,
    needs_eval: bool,
) -> tuple[Iterable, list[dict[str, Tensor]] | None]:
    """Statistics batches and held-out batches (materialized: the line search reads them many times)."""
    if eval_dataloader is not None:
        eval_batches = list(eval_dataloader)
        if not eval_batches:
            raise ValueError("eval_dataloader yielded no batches.")
        return dataloader, eval_batches
    if not needs_eval:
        return dataloader, None
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
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


def search_step_size(
    evaluate: Callable[[float], float],
    start: float,
    factor: float = 4.0,
    max_expansions: int = 12,
    refinements: int = 2,
    known: Mapping[float, float] | None = None,
) -> dict[float, float]:
    """Losses at the step sizes tried: 0, steps from ``start`` followed downhill until the least loss is bracketed,
    then the bracket refined.

    Near its minimum the loss is quadratic in the step (the expansion the growth is solved from), so the search
    moves by parabolas through the best step and its neighbours among those tried, step 0 included:

    - until a step beats step 0, the step shrinks by ``factor``;
    - while the best step is the largest tried, the next is the vertex of the parabola through the three largest,
      kept between ``factor**0.5`` and ``factor**3`` times the best (``factor`` times where there is no vertex:
      two points, or a concave fit): from a small start the first parabola lands near the minimum, where a grid
      walks up to it one ``factor`` at a time;
    - then, while the best step's neighbours are more than ``factor`` away, a step ``factor`` from it on that side
      (at most ``max_expansions`` moves in all, so that the parabolas below fit a bracket of the grid's width;
      step 0 is always that far);
    - then up to ``refinements`` times, the vertex of the parabola through the best step and its two neighbours,
      or, where that says nothing new, the geometric mean of the best step and its wider side. A vertex within
      1% of the best step ends the search: near a quadratic minimum the loss there is within about 1e-4 of the
      gain of the minimum.

    A non-finite loss (a step that overflows in low precision) counts as +inf, so it is never the best.
    ``known`` losses (e.g. of the step already taken) are not evaluated again.
    """
    losses: dict[float, float] = dict(known or {})

    def loss(step: float) -> float:
        if step not in losses:
            value = evaluate(step)
            losses[step] = value if math.isfinite(value) else math.inf
        return losses[step]

    step = start
    for _ in range(max_expansions):
        if loss(step) < loss(0.0):
            break
        step /= factor
    else:
        return losses
    for _ in range(max_expansions):
        steps, best = sorted(losses), best_step(losses)
        index = steps.index(best)
        if index + 1 == len(steps):
            vertex = _parabola_vertex(*steps[-3:], *(losses[s] for s in steps[-3:])) if index >= 2 else None
            loss(best * factor if vertex is None else min(max(vertex, best * factor**0.5), best * factor**3))
        elif steps[index - 1] < best / factor:
            loss(best / factor)
        elif steps[index + 1] > best * factor:
            loss(best * factor)
        else:
            break
    for _ in range(refinements):
        steps, best = sorted(losses), best_step(losses)
        index = steps.index(best)
        if index + 1 == len(steps):
            break  # the expansions ran out before the loss rose
        low, high = steps[index - 1], steps[index + 1]
        vertex = _parabola_vertex(low, best, high, losses[low], losses[best], losses[high])
        if vertex is not None and low < vertex < high and abs(vertex - best) < 0.01 * best:
            break
        if vertex is None or not low < vertex < high:
            low = low or best / factor  # halve toward step 0 in log step too
            vertex = math.sqrt(best * high) if high / best >= best / low else math.sqrt(low * best)
        loss(vertex)
    return losses


def _parabola_vertex(
    first: float, second: float, third: float, first_loss: float, second_loss: float, third_loss: float
) -> float | None:
    """The step at the vertex of the parabola through three (step, loss) points, steps increasing; None where it
    has no minimum: an infinite loss, or a flat or concave fit."""
    if not all(math.isfinite(value) for value in (first_loss, second_loss, third_loss)):
        return None
    left, right = (second - first) * (second_loss - third_loss), (second - third) * (second_loss - first_loss)
    denominator = left - right  # < 0 where the parabola is convex
    if denominator >= 0:
        return None
    return second - 0.5 * ((second - first) * left - (second - third) * right) / denominator


def best_step(losses: Mapping[float, float]) -> float:
    """The step of least loss; of equal losses the smallest step (step 0 wins a tie: nothing is gained)."""
    return min(losses, key=lambda step: (losses[step], step))
