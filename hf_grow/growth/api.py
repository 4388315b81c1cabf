"""`grow_model`: statistics, solve, line search and the grown model, with its report."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..distributed import Processes, unwrap_model
from ..statistics import GrowthStatistics, LossFn
from .prepare import DEFAULT_TRUNCATION, merged_if_peft, prepare_growth
from .search import search_and_report


if TYPE_CHECKING:
    from accelerate import Accelerator


def grow_model(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    p: int | Mapping[int, int] | None = None,
    *,
    budget: int | None = None,
    multiple_of: int = 1,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None = None,
    step_size: float | None = None,
    truncation: str = DEFAULT_TRUNCATION,
    search: str = "exact",
    loss_fn: LossFn | None = None,
    max_batches: int | None = None,
    statistics: GrowthStatistics | None = None,
    eval_fraction: float = 0.1,
    initial_step_size: float = 0.03,
    rtol: float = 1e-6,
    measure_realized_gains: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    solver: str = "auto",
    statistics_method: str = "auto",
    query_block: int | None = None,
    memory_budget: int | str | None = None,
    accelerator: Accelerator | None = None,
    progress: bool = False,
) -> PreTrainedModel:
    """Grow the query/key width of every attention head by ``p``, with weights solved from the loss.

    Args:
        model: a supported transformers model (GPT-2 or BERT classes, or a model grown by hf_grow), or a
            PeftModel around one (its adapters are merged into a copy first). Left unchanged.
        dataloader: dict batches passed as ``model(**batch)``; the loss is ``outputs.loss`` (or ``loss_fn``).
        p: dimensions added per head, in every layer, or a mapping ``{layer: p}`` (missing layers get 0;
            layers with 0 keep their width but still take the step). Default 8; not with ``budget``.
        budget: instead of ``p``, a total of dimensions added per head, summed over layers, allocated from the
            statistics before the line search: greedily, ``multiple_of`` dimensions at a time, to the layer whose
            next dimensions have the largest expected gain summed over its heads (in the metric of C, whatever
            the ``truncation``). The gains are first-order in
            the step lam (`hf_grow.linalg.growth_gain_rates`); all scale with the same lam, so the allocation
            does not depend on it. ``growth_report.budget`` records it.
        multiple_of: the chunk of a budget allocation (e.g. 8 keeps widths multiples of 8 for fused kernels).
        eval_dataloader: held-out batches for the line search and the before/after losses. Without it, the
            last ``eval_fraction`` of the dataloader's batches are held out (when a line search runs).
        step_size: skip the line search and take this step (relative units, see the module docstring);
            ``0.0`` returns a grown model that computes exactly the old function.
        truncation: ``"whitened"`` (rank truncation in the metric of C, the default) or ``"frobenius"``.
        search: ``"exact"`` searches the rank-constrained update; ``"fast"`` first brackets the step with
            the full-rank update Z - lam P (no SVD per step, also reported as an upper reference), then
            refines the rank-constrained step from there.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor`` instead of ``outputs.loss``.
        max_batches: use at most this many statistics batches.
        statistics: statistics already collected for this model (e.g. by `collect_statistics`), to grow it
            several ways without reading the data again; ``dataloader`` may then be None when
            ``eval_dataloader`` or ``step_size`` is given.
        initial_step_size: where the log-grid search starts.
        rtol: relative eigenvalue tolerance of C for pseudo-inverse and whitening.
        measure_realized_gains: evaluate the held-out loss with each layer's step alone (one pass per layer).
        compute_dtype: precision of the per-batch statistics products (float32 or float64).
        solver: how truncations are computed, at every line-search step: ``"subspace"`` (top singular
            directions by subspace iteration, warm-started from the previous step), ``"eigh"`` (eigendecomposition
            of A A^T), ``"svd"`` (full SVD, several times slower), or ``"auto"`` (the default: subspace where
            the grown width plus 16 is at most a sixth of the hidden size, eigh otherwise); see
            `hf_grow.linalg.decompose`.
        statistics_method: ``"auto"`` (the default: by device and sequence length), ``"chunked"`` (sdpa
            attention, M accumulated block by block in backward), ``"triton"`` (the same, fused kernels on CUDA)
            or ``"reference"`` (eager attention with materialized score gradients); see `collect_statistics`.
        query_block: queries per block of the chunked path (default: sized to the memory of one block).
        memory_budget: bytes (or a string such as ``"2GB"``) for the statistics' accumulators: M is collected
            for groups of layers in several passes over ``dataloader`` (see `collect_statistics`).
        accelerator: an `accelerate.Accelerator` to grow with several processes: call grow_model on every
            process with its own shard of the data (statistics and held-out batches); statistics and held-out
            losses are summed over the processes, and every process returns the same grown model. ``model``
            may be wrapped by the accelerator or by DistributedDataParallel.
        progress: show progress bars (on the main process).

    Returns:
        The grown model (a new object of the grown model type, same device and dtype) with the
        `GrowthReport` as ``grown.growth_report``; `save_pretrained` writes it as ``growth_report.json``.
    """
    started = time.perf_counter()
    model = merged_if_peft(unwrap_model(model, accelerator))
    progress = progress and Processes(accelerator).is_main
    prepared = prepare_growth(
        model,
        dataloader,
        p,
        mode="refactor",
        budget=budget,
        multiple_of=multiple_of,
        eval_dataloader=eval_dataloader,
        step_size=step_size,
        initial_step_size=initial_step_size,
        truncation=truncation,
        search=search,
        loss_fn=loss_fn,
        max_batches=max_batches,
        statistics=statistics,
        eval_fraction=eval_fraction,
        rtol=rtol,
        compute_dtype=compute_dtype,
        solver=solver,
        statistics_method=statistics_method,
        query_block=query_block,
        memory_budget=memory_budget,
        accelerator=accelerator,
        progress=progress,
    )
    tick = time.perf_counter()
    grown = prepared.adapter.build_grown_model(model, prepared.qk_after, prepared.problem.weights(0.0))
    prepared.seconds["solve"] += time.perf_counter() - tick
    grown.growth_report = search_and_report(
        prepared,
        grown,
        step_size=step_size,
        search=search,
        loss_fn=loss_fn,
        initial_step_size=initial_step_size,
        measure_realized_gains=measure_realized_gains,
        progress=progress,
        started=started,
    )
    return grown
