"""The bytes of the statistics' accumulators, and the layer groups whose M fits a budget."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

from ..option_values import parse_bytes


def statistics_bytes(
    num_layers: int, num_heads: int, hidden_size: int, layers_of_m: int | None = None, m_itemsize: int = 8
) -> int:
    """Bytes of the accumulators: C for every layer (float64), M for ``layers_of_m`` layers (default all) in
    ``m_itemsize``-byte floats.

    ``layers * (d_e + 1)^2 * 8 + layers_of_m * heads * (d_e + 1)^2 * m_itemsize``.
    """
    width = hidden_size + 1
    layers_of_m = num_layers if layers_of_m is None else layers_of_m
    return width * width * (8 * num_layers + m_itemsize * layers_of_m * num_heads)


def m_copies(cross_fit: bool) -> int:
    """Accumulators per layer of M: two with ``cross_fit`` (M and its sum over half the batches), else one."""
    return 2 if cross_fit else 1


def layer_groups(
    num_layers: int, num_heads: int, hidden_size: int, memory_budget: int | str | None, m_itemsize: int = 8,
    cross_fit: bool = False,
) -> list[list[int]]:
    """Layers whose M is collected together, one group per pass over the data, within ``memory_budget``.

    The budget covers C for all layers, M for the layers of a pass (twice with ``cross_fit``: its half sums), and
    one more layer's M for the product of the batch being added (the model's own memory comes on top).
    """
    if memory_budget is None:
        return [list(range(num_layers))]
    budget = parse_bytes(memory_budget)
    copies = m_copies(cross_fit)
    per_layer = statistics_bytes(1, num_heads, hidden_size, copies, m_itemsize) - statistics_bytes(
        1, num_heads, hidden_size, 0
    )
    fitting = (budget - statistics_bytes(num_layers, num_heads, hidden_size, 1, m_itemsize)) // per_layer
    if fitting < 1:
        needed = statistics_bytes(num_layers, num_heads, hidden_size, copies + 1, m_itemsize)
        halves = " (M and its half sum for cross_fit, and a batch's product)" if cross_fit else ""
        raise ValueError(
            f"memory_budget {budget:,} bytes is below the {needed:,} bytes the statistics need for one layer at a "
            f"time (C of {num_layers} layers and M of {copies + 1} layers of {num_heads} heads{halves}): raise the "
            "budget."
        )
    passes = math.ceil(num_layers / fitting)
    size = math.ceil(num_layers / passes)  # as even as possible: the same number of passes, less memory
    return [list(range(start, min(start + size, num_layers))) for start in range(0, num_layers, size)]


def return_free_memory() -> None:
    """Hand the C allocator's free pages back to the operating system (glibc's ``malloc_trim``; elsewhere nothing).

    Tensors under glibc's mmap threshold (up to 32 MiB) are freed into the heap, which keeps them resident: after
    the statistics pass the process would hold its peak for the rest of the run. Called where a stage ends.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None
