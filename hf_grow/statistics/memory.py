"""Memory planning: the bytes of the float64 accumulators, and the layer groups that fit a budget."""

from __future__ import annotations

import math
import re


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(size: int | str) -> int:
    """A number of bytes from an int or a string such as ``"2GB"``, ``"1.5 GiB"`` or ``"500MB"``."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"memory_budget must be a number of bytes or a string like '2GB', got {type(size).__name__}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget {size!r} is not a size: write e.g. '2GB', '1.5GiB', '500MB' or bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory_budget must be positive, got {size}")
    return size


def statistics_bytes(num_layers: int, num_heads: int, hidden_size: int, layers_of_m: int | None = None) -> int:
    """Bytes of the float64 accumulators: C for every layer, M for ``layers_of_m`` layers (default all).

    ``layers * (d_e + 1)^2 * 8 + layers_of_m * heads * (d_e + 1)^2 * 8``.
    """
    width = hidden_size + 1
    layers_of_m = num_layers if layers_of_m is None else layers_of_m
    return 8 * width * width * (num_layers + layers_of_m * num_heads)


def layer_groups(num_layers: int, num_heads: int, hidden_size: int, memory_budget: int | str | None) -> list[list[int]]:
    """Layers whose M is collected together, one group per pass over the data, within ``memory_budget``.

    The budget covers C for all layers, M for the layers of a pass, and one more layer's M for the product
    of the batch being added (the model's own memory comes on top).
    """
    if memory_budget is None:
        return [list(range(num_layers))]
    budget = parse_bytes(memory_budget)
    per_layer = statistics_bytes(1, num_heads, hidden_size, 1) - statistics_bytes(1, num_heads, hidden_size, 0)
    fitting = (budget - statistics_bytes(num_layers, num_heads, hidden_size, 1)) // per_layer
    if fitting < 1:
        needed = statistics_bytes(num_layers, num_heads, hidden_size, 2)
        raise ValueError(
            f"memory_budget {budget:,} bytes is below the {needed:,} bytes the statistics need for one layer at a "
            f"time (C of {num_layers} layers and M of 2 layers of {num_heads} heads, in float64): raise the budget."
        )
    passes = math.ceil(num_layers / fitting)
    size = math.ceil(num_layers / passes)  # as even as possible: the same number of passes, less memory
    return [list(range(start, min(start + size, num_layers))) for start in range(0, num_layers, size)]
