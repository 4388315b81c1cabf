"""The values options take, checked without importing torch or transformers: the solved growth modes, the
statistics methods' names, counts, sizes in bytes, and the statistics options' checks.

`hf_grow.config` (the options) and `hf_grow.statistics` (which runs them) both check against these, so the options
layer needs nothing of the statistics package.
"""

from __future__ import annotations

import re


#: The growth modes whose new weights are solved from the statistics (`grow_model`'s; `grow_in_training` adds
#: baselines). "refactor": the rank-(d_k + p) truncation of Z - lam P rewrites all Q/K weights. "append": the old
#: Q/K weights are kept and the p new dimensions hold the best rank-p approximation of the step -lam P.
SOLVED_MODES: tuple[str, ...] = ("refactor", "append")
#: How M is collected (`hf_grow.statistics.kernels`); "auto" picks per batch.
STATISTICS_METHODS: tuple[str, ...] = ("auto", "chunked", "reference", "triton")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def is_positive_int(value: object) -> bool:
    """A count of batches or queries: an int >= 1, not a bool (``True`` is no count, though Python takes it as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_bytes(size: int | float | str, name: str = "memory_budget") -> int:
    """A number of bytes from an int (or a whole float, 2.5e9) or a string such as ``"2GB"``, ``"1.5 GiB"`` or
    ``"500MB"`` (``name``: the option, for the error)."""
    if isinstance(size, float) and size.is_integer():  # 2.5e9, as one writes it
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{name} must be a whole number of bytes or a string like '2GB', got {size!r}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} {size!r} is not a size: write e.g. '2GB', '1.5GiB', '500MB' or bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {size}")
    return size


def check_statistics_options(
    method: str, query_block: object, max_batches: object, memory_budget: object, float32_compute: bool,
    method_option: str = "method", float32: str = "torch.float32",
) -> None:
    """A ValueError for statistics options no model is needed to refuse. `GrowthConfig` and `collect_statistics`
    both check with it, each naming its own option of the method (``method_option``) and its spelling of the
    float32 dtype (``float32``, for which ``float32_compute`` says whether the products compute in it)."""
    if max_batches is not None and not is_positive_int(max_batches):
        raise ValueError(f"max_batches must be a positive int (or None for all batches), got {max_batches!r}")
    if memory_budget is not None:
        parse_bytes(memory_budget)
    if method not in STATISTICS_METHODS:
        raise ValueError(f"{method_option} must be one of {STATISTICS_METHODS}, got {method!r}")
    if query_block is not None and not is_positive_int(query_block):
        raise ValueError(f"query_block must be a positive int (queries per block), got {query_block!r}")
    if method == "triton" and not float32_compute:
        raise ValueError(
            f"{method_option}='triton' computes in float32: use compute_dtype={float32}, or {method_option}='chunked'."
        )


def held_out_count(total: int, eval_fraction: float) -> int:
    """How many of ``total`` batches are held out for the line search: the last ``eval_fraction``, at least one.
    The command line holds out as many of its sequences of text the same way."""
    return max(1, round(eval_fraction * total))
