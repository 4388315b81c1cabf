"""`collect_statistics`: C and M over a dataloader, in one pass or in several within a memory budget.

The sums add up across processes (`hf_grow.distributed`) and across passes over the data: with a
``memory_budget``, each pass accumulates M for one group of layers only (C for all layers in the first).
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, is_peft_model
from ..distributed import Processes, unwrap_model
from ..option_values import check_statistics_options
from ..progress import known_length, progress_bar
from .batches import LossFn, batch_loss_weight, check_loss_fn, iterate_batches
from .collector import Collector, statistics_mode
from .container import GrowthStatistics, fingerprint, weight_sample
from .kernels import triton_available
from .memory import layer_groups, return_free_memory
from .offload import check_offload_dir, offload_folder


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")


def check_statistics_arguments(
    method: str,
    device: torch.device,
    compute_dtype: torch.dtype,
    query_block: int | None = None,
    max_batches: int | None = None,
    memory_budget: int | str | None = None,
    accumulate_dtype: torch.dtype = torch.float64,
    offload_dir: str | os.PathLike | None = None,
    tf32: bool | None = None,
) -> None:
    """A ValueError, before any work, for arguments `collect_statistics` cannot run with on ``device``."""
    for name, dtype in (("compute_dtype", compute_dtype), ("accumulate_dtype", accumulate_dtype)):
        if dtype not in (torch.float32, torch.float64):
            hint = f" (a torch dtype: torch.{dtype})" if isinstance(dtype, str) else ""
            raise ValueError(f"{name} must be torch.float32 or torch.float64{hint}, got {dtype!r}")
    check_method_runs(method, device)
    check_statistics_options(method, query_block, max_batches, memory_budget, compute_dtype == torch.float32)
    if method == "triton" and tf32 is False:
        raise ValueError(
            "method='triton' runs its products on TF32 tensor cores: with tf32=False (IEEE float32 products) Triton "
            "runs them without, 22x slower (an H100, BENCHMARKS.md). Leave tf32 unset, or use method='chunked' for "
            "float32 products."
        )
    if offload_dir is not None:
        check_offload_dir(offload_dir, device)


def check_method_runs(method: str, device: torch.device) -> None:
    """Refuse a statistics method that cannot run on ``device`` (Triton off CUDA), before any data is read."""
    if method == "triton" and not triton_available(device):
        missing = "" if importlib.util.find_spec("triton") else " and triton is not installed"
        raise ValueError(
            f"The statistics method 'triton' needs a CUDA device and the triton package (pip install triton); the "
            f"model is on {device}{missing}: use 'auto' or 'chunked' (method= here, statistics_method= in "
            f"grow_model and GrowthConfig, --statistics-method in the command)."
        )


def check_same_weights(processes: Processes, model: PreTrainedModel) -> None:
    """Refuse, on every process, models whose weights differ between the processes: their statistics would be summed
    over two functions and each layer solved from its owner's weights, a model that no process had."""
    if processes.world_size == 1:
        return
    processes.check_same(
        {"weights (a hash of a sample)": fingerprint(weight_sample(model))}, "the models' weights",
        "load the same checkpoint on every process (or seed them alike before building the model)",
    )


def collect_statistics(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None = None,
    *,
    max_batches: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = False,
    method: str = "auto",
    query_block: int | None = None,
    tf32: bool | None = None,
    memory_budget: int | str | None = None,
    accelerator: Accelerator | None = None,
    on_group: Callable[[GrowthStatistics, list[int]], None] | None = None,
    accumulate_dtype: torch.dtype = torch.float64,
    offload_dir: str | os.PathLike | None = None,
    cross_fit: bool = False,
    owners: Sequence[int] | None = None,
) -> GrowthStatistics:
    """Accumulate C and M over ``dataloader`` (at most ``max_batches``), leaving the model as it was. The options
    after ``loss_fn`` are keyword-only.

    ``compute_dtype`` is the precision of the per-batch products (float32 or float64, whatever the model dtype or
    autocast); ``accumulate_dtype`` that of M's sums over batches (float32 halves the largest tensors; BENCHMARKS.md
    measures what it costs in accuracy). C is summed in float64 always. Backward runs on each batch's loss times its
    loss terms (see `GrowthStatistics`), so a float16 model's score gradients do not underflow.

    ``method`` is ``"chunked"`` (sdpa attention, M block by block in backward; ``query_block`` queries per
    block, by default `default_query_block`: 8 MiB per float32 block tensor on a CPU, 256 MiB on a GPU, at
    least 32 queries), ``"triton"`` (the same with fused kernels; CUDA, TF32 products), ``"reference"``
    (eager attention, full score gradients) or ``"auto"`` (by device and sequence length, per batch:
    `choose_method`). ``tf32`` runs the float32 products on TF32 tensor cores (CUDA; M within ~2e-3 of float64
    products on a float32 GPT-2 small, ~2e-2 on a bfloat16 one; False forces full float32 precision); by default
    on for bfloat16/float16 models and for ``"triton"``, which refuses False (its IEEE products are 22x slower).

    ``memory_budget`` (bytes, or a string such as ``"2GB"``) bounds the accumulators: M is collected
    for as many layers as fit, in several passes over ``dataloader`` (which must then be re-iterable and
    yield the same batches each time), and finished layers move to the CPU. The result equals one pass.

    ``offload_dir``: a folder where M's accumulators live in memory-mapped safetensors files instead of memory
    (`offload`; CPU models only), for M that does not fit the host memory even one layer at a time. A pass's file
    needs disk for the M of its group (all layers without a ``memory_budget``, which then bounds the disk) and is
    removed once ``on_group`` returns; M that outlives it stays mapped from the removed file until it is freed.

    ``accelerator``: an `accelerate.Accelerator`; every process passes its own shard of the data (e.g. a
    DataLoader prepared by it) and gets the sums over all processes. ``model`` may be wrapped by it or by
    DistributedDataParallel. Raises ValueError on empty data, FloatingPointError on non-finite losses or
    statistics (naming the layer and batch).

    ``owners``: with an ``accelerator``, the process that owns each layer (`hf_grow.growth.sharding`): each
    layer's M (and its half) is reduced to its owner only, group by group, and the other processes drop theirs
    (``gradients[layer]`` None there), so that a process holds the M of its own layers and of the group in
    flight, not of every layer. C and the counts are summed on every process. None: M on every process.

    ``on_group(statistics, layers)`` is called after each pass, as soon as the M of its ``layers`` is complete
    (C and the counts are complete after the first): the solve turns them into its compact form there and may
    free each layer's M and its half (`GrowthStatistics.release`), so that no more than one group's M is held at a
    time.

    ``cross_fit``: also sum M over the odd-numbered batches with a loss (on each process), in the same pass, into
    ``statistics.half_gradients`` with their loss terms in ``half_loss_weight``: the two halves of the data
    `GrowthStatistics.cross_fitted_gradient` keeps M to the agreement of. Twice M's memory (or disk, in the same
    offload file); a ValueError unless each half gets a batch with a loss.
    """
    model = unwrap_model(model, accelerator)
    if is_peft_model(model):  # its wrapped Q/K are not where the adapter reads them
        raise ValueError(
            f"{type(model).__name__} wraps PEFT adapters: collect the statistics of the model that is grown: for "
            "grow_model, the copy it grows, copy.deepcopy(peft_model).merge_and_unload() (.unload() with the adapters "
            "disabled); for grow_in_training and GrowthCallback, which grow it in place, peft_model.get_base_model()"
        )
    processes = Processes(accelerator)
    config = model.config
    parameter = next(model.parameters())
    with processes.failing_together():  # a check failing on one process alone must not leave the others waiting
        check_statistics_arguments(
            method, parameter.device, compute_dtype, query_block, max_batches, memory_budget, accumulate_dtype,
            offload_dir, tf32,
        )
        check_loss_fn(loss_fn)
        num_layers = len(adapter.attention_modules(model))
        if owners is not None and (len(owners) != num_layers or not all(0 <= o < processes.world_size for o in owners)):
            raise ValueError(
                f"owners must name a process (0..{processes.world_size - 1}) for each of the {num_layers} layers, "
                f"got {list(owners)}: plan them with hf_grow.growth.sharding.plan_owners."
            )
        groups = layer_groups(
            num_layers, adapter.num_heads(config), adapter.hidden_size(config), memory_budget,
            accumulate_dtype.itemsize, cross_fit,
        )
        if len(groups) > 1 and isinstance(dataloader, Iterator):  # (iter() would draw a shuffle order, or workers)
            raise ValueError(
                f"memory_budget needs {len(groups)} passes over the data, but the dataloader is a one-shot iterator: "
                "pass a list of batches or a DataLoader, or a larger memory_budget."
            )
    processes.check_same(  # processes collecting differently would wait in each other's collectives
        {"method": method, "compute_dtype": str(compute_dtype), "accumulate_dtype": str(accumulate_dtype),
         "max_batches": max_batches, "memory_budget": memory_budget, "cross_fit": cross_fit,
         "owners": None if owners is None else list(owners), "model": type(model).__name__, "layers": num_layers},
        "the statistics options",
    )
    check_same_weights(processes, model)
    eager_model = config._attn_implementation == "eager"
    if tf32 is None:
        tf32 = parameter.dtype in (torch.bfloat16, torch.float16) or method == "triton"
    to_cpu = len(groups) > 1 and on_group is None  # a solve per group frees M where it was collected
    statistics: GrowthStatistics | None = None
    first_pass: tuple[int, int, int, int, float] | None = None
    half_weight: int | None = None
    methods_used: set[str] = set()
    weights: collections.Counter[int] = collections.Counter()  # the first pass's batches by their loss terms
    with offload_folder(offload_dir) as folder, statistics_mode(model, tf32):
        for index, group in enumerate(groups):
            offload_file = None if folder is None else folder / f"m-pass-{index + 1}.safetensors"
            with processes.failing_together():
                def make_collector() -> Collector:
                    return Collector(
                        model, adapter, compute_dtype, method, query_block, group, index == 0, eager_model,
                        accumulate_dtype, offload_file, cross_fit,
                    )

                description = f"statistics {index + 1}/{len(groups)}" if len(groups) > 1 else "statistics"
                show = progress and processes.is_main
                collector, skipped = _collect_pass(
                    make_collector, model, dataloader, adapter, loss_fn, max_batches, show, description, weights
                )
                sums = collector.sums
                counts = (sums.num_tokens, sums.batch_index, skipped, sums.loss_weight, sums.loss_sum)
                first_pass = first_pass or counts
                half_weight = half_weight if index else sums.half_loss_weight
                methods_used |= collector.products.methods_used
                if counts[:4] != first_pass[:4] or not math.isclose(counts[4], first_pass[4], rel_tol=1e-6):
                    raise ValueError(
                        "the data changed between passes over it (tokens, batches, skipped, loss terms, loss sum: "
                        f"{first_pass} in pass 1, {counts} in pass {index + 1}): memory_budget needs the same "
                        "batches on every pass (no random masking or cropping in the collator, no shuffling "
                        "DataLoader: shuffle=False), or a larger budget for a single pass."
                    )
                # each layer's half and rest would weigh other batches (batches of equal weight in another order
                # pass: each layer's halves are then another split of the same data, each consistent)
                if sums.half_loss_weight != half_weight:
                    raise ValueError(
                        f"the batches came in another order in pass {index + 1} than in pass 1 (the odd-numbered "
                        f"ones' loss terms: {half_weight} in pass 1, {sums.half_loss_weight} in pass {index + 1}): "
                        "cross_fit with a "
                        "memory_budget needs the same order on every pass: pass a list of batches or a DataLoader "
                        "without shuffle, or a larger budget for a single pass."
                    )
            if statistics is None:
                second_moments = [processes.sum_(moment) for moment in sums.second_moments]
                second_moments = [moment.cpu() for moment in second_moments] if to_cpu else second_moments
                statistics = _checked_statistics(
                    processes, first_pass, second_moments, num_layers, parameter.device, sums.half_loss_weight
                )
                statistics.model_type, statistics.weights = config.model_type, weight_sample(model)
            for layer in group:  # no name outlives the loop: the solve may free each M (on_group)
                owner = None if owners is None else owners[layer]
                statistics.gradients[layer] = _summed(processes, sums.gradients.pop(layer), to_cpu, owner)
                if sums.half_gradients is not None:
                    statistics.half_gradients[layer] = _summed(
                        processes, sums.half_gradients.pop(layer), to_cpu, owner
                    )
            del sums, collector
            return_free_memory()  # the pass's activations: otherwise resident for the rest of the run
            # the methods of every process (one without batches used none): the same report on every process
            statistics.method = "+".join(sorted(set().union(*processes.gathered(methods_used))))
            if on_group is not None:
                on_group(statistics, list(group))
            if offload_file is not None:
                offload_file.unlink()  # M solved and freed, or kept: mapped from the removed file until freed
    return statistics


def _summed(processes: Processes, sums: Tensor, to_cpu: bool, owner: int | None = None) -> Tensor | None:
    """One layer's sums (M or its half) over the processes, moved to the CPU with ``to_cpu``: on every process, or
    on process ``owner`` only (None elsewhere)."""
    total = processes.sum_(sums) if owner is None else processes.reduce_to_(sums, owner)
    return total.cpu() if to_cpu and total is not None else total


def _checked_statistics(
    processes: Processes, counts: tuple, second_moments: list[Tensor], num_layers: int, device: torch.device,
    half_loss_weight: int | None,
) -> GrowthStatistics:
    """The statistics of the first pass (C and the counts summed over the processes, no M yet), refused when
    the data held nothing to learn from, or (``half_loss_weight`` not None: cross-fitting) too little to split in
    two halves: found after one pass, before any later pass or solve."""
    half = half_loss_weight or 0
    totals = processes.sum_(torch.tensor([*counts[:4], half], dtype=torch.float64, device=device))
    num_tokens, num_batches, skipped, loss_weight, half = (int(total) for total in totals)
    if skipped:
        logger.warning(
            "skipped %d batch(es) without loss terms (every label -100, e.g. all padding, or one-token sequences "
            "for a causal LM)",
            skipped,
        )
    if num_batches == 0 and skipped:
        raise ValueError(
            f"none of the {skipped} batches has a loss term (every label is -100, or for a causal LM sequences of "
            "one token, which predict nothing): nothing to learn from. Use longer sequences or fewer masked labels."
        )
    if num_batches == 0:
        raise ValueError("the dataloader yielded no batches: statistics need at least one batch of data.")
    if num_tokens == 0:
        raise ValueError("every token of the data is padding (attention_mask is all zero): nothing to learn from.")
    if half_loss_weight is not None and not 0 < half < loss_weight:
        raise ValueError(
            f"cross_fit splits the batches with a loss into two halves (odd- and even-numbered, on each process), "
            f"and each needs one: got {num_batches} batch(es) with a loss"
            f"{f' over {processes.world_size} processes' if processes.world_size > 1 else ''}. Pass at least 2 batches "
            "(on every process), or leave cross_fit off."
        )
    return GrowthStatistics(
        second_moments, [None] * num_layers, num_tokens, num_batches, loss_weight=loss_weight,
        half_gradients=None if half_loss_weight is None else [None] * num_layers,
        half_loss_weight=None if half_loss_weight is None else half,
    )


def _collect_pass(
    make_collector: Callable[[], Collector],
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None,
    max_batches: int | None,
    progress: bool,
    description: str,
    weights: collections.Counter[int],
) -> tuple[Collector, int]:
    """One pass over the data with the collector ``make_collector`` builds; the collector and the number of batches
    skipped. The collector is built within the pass's progress: allocating its accumulators (M of a group, up to
    gigabytes) belongs to the pass's time and memory, not to whatever ran before it.

    ``weights``: how many batches of each number of loss terms the first pass saw, which the first pass counts and
    a later one takes its batches from (in any order: sums do not depend on it), so that data that changes between
    passes (a collator's random masking) is refused at the first batch the first pass had no match for, not after
    the whole pass."""
    skipped, first = 0, not weights
    left = collections.Counter(weights)
    total = known_length(dataloader)
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    with progress_bar(desc=description, unit="batch", total=total, enabled=progress) as bar:
        collector = make_collector()
        with collector.installed():
            for number, batch in enumerate(iterate_batches(dataloader, model)):
                weight = batch_loss_weight(adapter, model, batch, loss_fn)
                if first:
                    weights[weight] += 1
                elif left[weight] == 0:
                    raise ValueError(
                        f"the data changed between passes over it: batch {number} of {description} has {weight} "
                        "loss terms, more batches of that many than pass 1 had: memory_budget needs the same batches "
                        "on every pass (no random masking or cropping in the collator, no shuffling DataLoader: "
                        "shuffle=False), or a larger budget for a single pass."
                    )
                else:
                    left[weight] -= 1
                if weight == 0:
                    skipped += 1  # no loss term (every label -100): the model's loss would be 0 / 0
                else:
                    collector.step(model, batch, loss_fn, weight, number)
                bar.update()
                if max_batches is not None and collector.sums.batch_index >= max_batches:
                    break
    return collector, skipped
