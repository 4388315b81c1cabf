"""Spending a budget of added query/key dimensions where the expected gain is largest (pure torch).

The gains are first-order rates (`hf_grow.linalg.growth_gain_rates`): every one is proportional to the same
step lam, so the allocation does not depend on the step the line search later picks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from torch import Tensor


def check_budget_chunks(budget: int, multiple_of: int) -> None:
    """Refuse a budget that is not a positive number of whole chunks (no model needed: `GrowthConfig` checks it)."""
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of query/key dimensions per head, got {budget!r}")
    if budget % multiple_of:
        raise ValueError(
            f"budget {budget} is not a multiple of multiple_of={multiple_of}: allocation is in whole chunks"
        )


def check_budget(budget: int, multiple_of: int, max_added: Sequence[int]) -> None:
    """Refuse a budget that cannot be allocated, before any statistics are collected.

    ``max_added[l]``: the most dimensions layer l can take; it takes them in whole chunks of ``multiple_of``.
    """
    check_budget_chunks(budget, multiple_of)
    capacities = [most // multiple_of * multiple_of for most in max_added]
    if budget > sum(capacities):
        raise ValueError(
            f"budget {budget} exceeds the {sum(capacities)} dimensions the layers can take (per layer at most the "
            "width of the query/key projections' inputs, hidden_size plus 1 where they have biases, minus the current "
            f"width, in multiples of {multiple_of}): choose a smaller budget."
        )


def allocate_budget(gains: Sequence[Tensor], budget: int, multiple_of: int = 1) -> list[int]:
    """Dimensions added per layer: greedily, one chunk of ``multiple_of`` at a time, to the best next chunk.

    ``gains[l]`` (capacity_l,): the expected gain of the r-th dimension added to layer l, summed over its heads,
    non-increasing in r (a sum of descending spectra), so greedy is optimal among allocations in whole chunks.
    Ties go to the lower layer. The allocation sums to ``budget``.
    """
    check_budget(budget, multiple_of, [len(layer_gains) for layer_gains in gains])
    capacities = [len(layer_gains) // multiple_of * multiple_of for layer_gains in gains]
    allocation = [0] * len(gains)

    def next_chunk(layer: int) -> tuple[float, int]:
        start = allocation[layer]
        return -float(gains[layer][start : start + multiple_of].sum()), layer

    heap = [next_chunk(layer) for layer in range(len(gains)) if capacities[layer] > 0]
    heapq.heapify(heap)
    for _ in range(budget // multiple_of):
        _, layer = heapq.heappop(heap)
        allocation[layer] += multiple_of
        if allocation[layer] < capacities[layer]:
            heapq.heappush(heap, next_chunk(layer))
    return allocation
