"""A growth validated before any work, its statistics collected or checked, and its problem solved."""

from __future__ import annotations

import copy
import os
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, get_adapter, is_peft_model
from ..budget import allocate_budget, check_budget
from ..config import GrowthConfig, check_p
from ..distributed import Processes
from ..progress import stage
from ..option_values import SOLVED_MODES
from ..statistics import (
    GrowthStatistics, LossFn, batch_loss_weight, check_batch, check_labels, check_loss_fn, check_statistics_arguments,
    collect_statistics, layer_groups, return_free_memory,
)
from ..statistics.collect import check_same_weights
from ..statistics.container import statistics_fingerprint
from .line_search import NO_LOSS_TERMS, confirmation_split, split_batches
from .problem import GrowthProblem
from .sharding import Sharding, solve_cost
from .statistics_checks import check_statistics


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")


def merged_if_peft(model: PreTrainedModel) -> PreTrainedModel:
    """A PEFT-wrapped model's base model with its adapters merged in (on a copy: the input is left unchanged).

    Growth rewrites the full Q/K weights, so LoRA deltas must be part of them; the grown model is a plain
    grown model. (peft's own target-module tables list Q and V only; where Q/K live is the adapter's business.)
    """
    if "peft" not in sys.modules:  # a PeftModel or adapter layers imply peft is imported; no import cost otherwise
        return model
    if not is_peft_model(model):
        check_no_injected_adapters(model)
        return model
    prompt_learning = sorted(name for name, config in model.peft_config.items() if config.is_prompt_learning)
    if prompt_learning:
        raise ValueError(
            f"{type(model).__name__} holds prompt-learning adapters {prompt_learning} (virtual tokens, not weights), "
            "which cannot be merged into the model: grow its base model (peft_model.get_base_model()) and add a "
            "prompt-tuning adapter again (prefix tuning's key prefixes have the old query/key width: it cannot run "
            "on a grown model)"
        )
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper  # modules_to_save, trainable tokens

    adapted = (BaseTunerLayer, AuxiliaryTrainingWrapper)
    disabled = {layer.disable_adapters for layer in model.modules() if isinstance(layer, adapted)}
    if disabled == {True, False}:
        raise ValueError(
            f"{type(model).__name__}'s adapters are disabled in some layers and not in others: enable or disable "
            "them all (peft's enable_adapter_layers / disable_adapter_layers) before growing"
        )
    if disabled == {True}:  # `with peft_model.disable_adapter():`: the model computes its base model's function
        logger.warning(
            "%s's adapters %s are disabled: growing a copy of its base model without them (unload); the input model "
            "is left unchanged.", type(model).__name__, sorted(model.peft_config),
        )
        base = copy.deepcopy(model)
        for name, module in list(base.named_modules()):  # unload() would keep their trained copies
            if isinstance(module, AuxiliaryTrainingWrapper):
                parent, _, child = name.rpartition(".")
                setattr(base.get_submodule(parent), child, module.original_module)
        return base.unload().requires_grad_(True)
    logger.warning(
        "%s wraps PEFT adapters %s: growing a copy of its base model with the adapters merged in "
        "(merge_and_unload); the input model is left unchanged.",
        type(model).__name__,
        sorted(model.peft_config),
    )
    merged = copy.deepcopy(model).merge_and_unload()
    # PEFT froze the base weights for its adapters; merged, they are the model's own weights again (the grown model
    # keeps its source's requires_grad)
    return merged.requires_grad_(True)


#: What to do with a model holding PEFT adapter layers, for `grow_model` and `inspect_growth`.
GROW_THE_PEFT_MODEL = ("pass a PeftModel (grown with its adapters merged into a copy), e.g. "
                       "PeftModel.from_pretrained(base_model, adapter), or the model with the adapters merged (peft's "
                       "merge_and_unload)")


def check_no_injected_adapters(model: torch.nn.Module, advice: str = GROW_THE_PEFT_MODEL) -> None:
    """Refuse PEFT adapter layers in a model without a PeftModel around it (transformers' ``add_adapter``,
    ``load_adapter``, ``from_pretrained`` of an adapter repository, or a PeftModel's base model): their wrapped
    weights are not where the growth reads them, which failed after the statistics pass. ``advice``: what to do."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    injected = next((name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)), None)
    if injected is not None:
        raise ValueError(
            f"{type(model).__name__} holds PEFT adapter layers ({injected}) without a PeftModel around it (added by "
            f"add_adapter, load_adapter, loaded from an adapter repository, or a PeftModel's base model): {advice}"
        )


def resolve_growth(p: int | Mapping[int, int], num_layers: int) -> list[int]:
    """Dimensions added per layer, validated before any work (`check_p`, then the model's layers)."""
    check_p(p)
    if isinstance(p, int):
        return [p] * num_layers
    unknown = [layer for layer in p if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if unknown:
        raise ValueError(f"p names layers {unknown} but the model has layers 0..{num_layers - 1}")
    return [p.get(layer, 0) for layer in range(num_layers)]


def warn_unaligned(qk_after: list[int], growth: list[int]) -> None:
    unaligned = sorted({dim for dim, extra in zip(qk_after, growth) if extra and dim % 8})
    if unaligned:
        warnings.warn(
            f"query/key widths {unaligned} are not multiples of 8; fused attention kernels are fastest with "
            "multiples of 8.",
            stacklevel=_user_stacklevel(),
        )


def _user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in the caller that names the first frame outside hf_grow (the
    user's line), however deep in the library the warning is raised."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def collect_configured_statistics(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None,
    config: GrowthConfig,
    *,
    progress: bool,
    accelerator: Accelerator | None = None,
    on_group: Callable[[GrowthStatistics, list[int]], None] | None = None,
    sharding: Sharding | None = None,
) -> GrowthStatistics:
    """`collect_statistics` with the statistics options of ``config`` (``max_batches``, ``compute_dtype``,
    ``accumulate_dtype``, ``statistics_method``, ``query_block``, ``memory_budget``, ``offload_dir``,
    ``cross_fit``): one place for `prepare_growth` and `inspect_growth`. With ``sharding``, each layer's M is
    reduced to its owner only."""
    return collect_statistics(
        model,
        dataloader,
        adapter,
        loss_fn,
        max_batches=config.max_batches,
        compute_dtype=config.torch_compute_dtype,
        accumulate_dtype=config.torch_accumulate_dtype,
        progress=progress,
        method=config.statistics_method,
        query_block=config.query_block,
        memory_budget=config.memory_budget,
        offload_dir=config.offload_dir,
        cross_fit=config.cross_fit,
        accelerator=accelerator,
        on_group=on_group,
        owners=None if sharding is None else sharding.owners,
    )


@dataclass
class PreparedGrowth:
    """A validated growth with its statistics solved: what remains is the target model and the line search."""

    model: PreTrainedModel
    adapter: ArchitectureAdapter
    config: GrowthConfig
    loss_fn: LossFn | None
    qk_before: list[int]
    qk_after: list[int]
    max_rank: int
    statistics: GrowthStatistics
    eval_batches: list[dict[str, Tensor]] | None
    problem: GrowthProblem
    parameters_before: int
    seconds: dict[str, float]
    accelerator: Accelerator | None
    #: With several candidates (`GrowthConfig.candidates`), the held-out batches with loss terms to search them
    #: on and to confirm the choice on (`confirmation_split`); None where no choice can be made, and the
    #: simplest candidate is taken (and solved for alone).
    confirmation: tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]] | None = None


def check_fast_search(search: str, mode: str, grown: str, modes: tuple[str, ...] = SOLVED_MODES) -> None:
    """``search="fast"`` brackets the step with the full-rank refactored form, which only growth in mode "refactor"
    takes; ``grown`` names what would grow, ``modes`` the modes it may grow by, for the message."""
    if search == "fast" and mode != "refactor":
        fix = "pass mode='refactor' with it, or" if "refactor" in modes else f"{grown} grows by {mode!r} only:"
        raise ValueError(
            f"search='fast' brackets the step with the full-rank refactored form, which {grown} cannot take in "
            f"{mode!r} growth: {fix} use search='exact' (the default)."
        )


def check_growth(
    model: PreTrainedModel, adapter: ArchitectureAdapter, config: GrowthConfig, mode: str | None
) -> tuple[str, list[int] | None]:
    """What ``config`` could not check alone, from the model's config and modules (a model on the meta device will
    do: the command checks before it reads any data): the growth mode to run (``mode``, or the architecture's
    default), and the dims each layer gains (None with a budget, which the statistics allocate)."""
    qk_before = adapter.qk_head_dims(model.config)
    max_rank = qk_input_width(model, adapter)
    if mode is not None and mode not in SOLVED_MODES:
        raise ValueError(f"mode must be one of {SOLVED_MODES}, got {mode!r}")
    mode = adapter.check_mode(model, mode)
    check_fast_search(config.search, mode, type(model).__name__, adapter.growth_modes)
    if config.rotate_factors and mode != "refactor":
        fix = ", or pass mode='refactor'" if "refactor" in adapter.growth_modes else f" ({mode!r} is its only mode)"
        raise ValueError(
            f"rotate_factors rewrites refactored Q/K factors; {type(model).__name__} grows by {mode!r}, which keeps "
            f"the old weights: leave rotate_factors off{fix}."
        )
    if config.budget is not None:
        check_budget(config.budget, config.multiple_of, [max_rank - dim for dim in qk_before])
        return mode, None
    growth = resolve_growth(config.with_default_p().p, len(qk_before))
    qk_after = [dim + extra for dim, extra in zip(qk_before, growth)]
    too_wide = {layer: dim for layer, dim in enumerate(qk_after) if dim > max_rank}
    if too_wide:
        raise ValueError(
            f"query/key widths {too_wide} exceed {max_rank}, the width of the query/key projections' inputs "
            f"({QK_INPUT_WIDTH}) and the largest rank a head's scores can have: choose a smaller p."
        )
    return mode, growth


#: What `qk_input_width` is, as the errors say it.
QK_INPUT_WIDTH = "hidden_size, plus 1 where they have biases"


def qk_input_width(model: PreTrainedModel, adapter: ArchitectureAdapter) -> int:
    """The width of the query/key projections' inputs: hidden_size + 1 where they have biases (X' = [X | 1], GPT-2,
    BERT, Qwen2), hidden_size where not (Llama, Mistral). The largest rank a head's scores can have."""
    return adapter.read_qk(adapter.attention_modules(model)[0])[0].shape[-2]


def check_weights_in_memory(model: PreTrainedModel) -> None:
    """Refuse a model whose weights are on the meta device (offloaded to disk or the CPU by ``device_map`` or
    accelerate's ``cpu_offload``, which load them per forward): the grown model is built from the weights
    themselves, so growth would fail after the statistics pass."""
    offloaded = [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"{len(offloaded)} of the model's parameters are on the meta device (first: {offloaded[0]}): weights "
            "offloaded by device_map or accelerate's cpu_offload cannot be grown. Load the model with every "
            "module on a device (no 'disk' or offloaded 'cpu' entries in device_map)."
        )


def check_memory_budget(model: PreTrainedModel, adapter: ArchitectureAdapter, config: GrowthConfig) -> None:
    """Refuse a ``memory_budget`` below one layer's statistics (with cross_fit's half sums), as the statistics pass
    would (`statistics.layer_groups`), before any work."""
    layer_groups(len(adapter.qk_head_dims(model.config)), adapter.num_heads(model.config),
                 adapter.hidden_size(model.config), config.memory_budget, config.torch_accumulate_dtype.itemsize,
                 config.cross_fit)


def prepare_growth(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    config: GrowthConfig,
    *,
    mode: str | None,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None,
    loss_fn: LossFn | None,
    statistics: GrowthStatistics | None,
    accelerator: Accelerator | None,
    progress: bool,
) -> PreparedGrowth:
    """Check what the config could not check alone (before any work), collect or check the statistics and
    solve the problem. ``mode`` None: the architecture's default (`ArchitectureAdapter.growth_modes`)."""
    processes = Processes(accelerator)
    with processes.failing_together():  # a check failing on one process alone must not leave the others waiting
        adapter = get_adapter(model)
        qk_before = adapter.qk_head_dims(model.config)
        max_rank = qk_input_width(model, adapter)
        mode, growth = check_growth(model, adapter, config, mode)
        check_weights_in_memory(model)
        check_loss_fn(loss_fn)
    # Every process must grow alike: each solves its own layers and takes the same collectives. (The offload
    # folder may be each process's own.)
    processes.check_same(
        {**config.to_dict(), "offload_dir": None, "mode": mode, "dims added": growth, "model": type(model).__name__,
         "Q/K dims": qk_before, "held-out batches given": eval_dataloader is not None,
         "statistics given": statistics is not None},
        "the growth options",
    )
    check_same_weights(processes, model)
    if statistics is not None and processes.world_size > 1:  # collected by each process on its own shard alone
        processes.check_same(
            {"statistics (a hash of their counts and C)": statistics_fingerprint(statistics)}, "the statistics given",
            "pass the statistics collected with the accelerator (summed over the processes) to every process",
        )
    if growth is not None:
        qk_after = [dim + extra for dim, extra in zip(qk_before, growth)]
        warn_unaligned(qk_after, growth)

    seconds: dict[str, float] = {}
    tick = time.perf_counter()
    with processes.failing_together():  # an offload folder, a device: each process's own
        if statistics is None:
            if dataloader is None:
                raise ValueError("growth needs a dataloader, or statistics collected before.")
            check_statistics_arguments(
                config.statistics_method, next(model.parameters()).device, config.torch_compute_dtype,
                config.query_block, config.max_batches, config.memory_budget, config.torch_accumulate_dtype,
                config.offload_dir,
            )
            check_memory_budget(model, adapter, config)  # before the batches are read (the held-out ones split off)
        elif eval_dataloader is None and config.step_size is None:
            raise ValueError("with precomputed statistics, pass an eval_dataloader to search on (or a step_size).")
    # With several processes each layer's M goes to one owner, which alone solves it (`sharding`).
    costs = [solve_cost(adapter.num_heads(model.config), max_rank)] * len(qk_before)
    sharding = Sharding.planned(processes, costs) if processes.world_size > 1 else None
    with processes.failing_together():  # a process without data must not leave the others waiting
        if statistics is not None:  # statistics of owners= may lack a layer on one process only
            check_statistics(statistics, model, adapter, config.cross_fit, sharding)
        statistics_batches, eval_batches = split_batches(
            dataloader, eval_dataloader, config.eval_fraction, config.step_size is None,
            allow_empty=processes.world_size > 1, max_batches=config.max_batches,
        )
        for index, batch in enumerate(eval_batches or ()):  # before the statistics pass, not in the line search
            check_batch(batch, f"held-out batch {index}", model)
            check_labels(batch, f"held-out batch {index}", model, loss_fn)
        weights = [batch_loss_weight(adapter, model, batch, loss_fn) for batch in eval_batches or ()]
    if 0 in weights:
        logger.warning("skipped %d held-out batch(es) without loss terms (every label -100)", weights.count(0))
    device = next(model.parameters()).device
    if eval_batches is not None:  # found now, not after the statistics pass
        if processes.sum_(torch.tensor(sum(weights), dtype=torch.float64, device=device)).item() == 0:
            raise ValueError(NO_LOSS_TERMS.format(data="the held-out data"))
    confirmation = None
    if len(config.candidates) > 1:  # batches without loss terms are skipped by every pass: not counted as parts
        scored = [batch for batch, weight in zip(eval_batches or (), weights) if weight > 0]
        confirmation = confirmation_split(scored, config.confirm_fraction, config.step_size is None)
        if processes.world_size > 1:  # every process must take the same branch: none chooses if one cannot
            cannot = processes.sum_(torch.tensor(float(confirmation is None), device=device)).item() > 0
            confirmation = None if cannot else confirmation
    # With a budget, each layer is solved for the widest it may get (the budget is allocated from the rates).
    widest = qk_after if growth is not None else [min(max_rank, dim + config.budget) for dim in qk_before]

    truncation, step_mode = config.candidates[0]  # of "auto" options the simplest (`growth.candidates`)
    # One solve serves every truncation among the candidates, so M is freed group by group: one solved for
    # Frobenius truncation serves the whitened one too (`GrowthProblem.holds`). Where no choice
    # can be made (one held-out batch, a given step size), the simplest candidate's alone.
    truncations = config.candidate_truncations if confirmation is not None else (truncation,)
    solved_for = "frobenius" if "frobenius" in truncations else truncation

    def solve(statistics: GrowthStatistics, layers: Iterable[int], release: bool) -> GrowthProblem:
        return GrowthProblem(
            model, adapter, statistics, qk_before if growth is None else qk_after, solved_for, config.rtol,
            config.solver, mode, step_mode, max_dims_after=widest, with_rates=growth is None,
            layers=layers, release=release, cross_fit=config.cross_fit, sharding=sharding,
            keep_attention_scale=config.keep_attention_scale, rotate_factors=config.rotate_factors,
        )

    problem: GrowthProblem | None = None
    seconds["solve"] = 0.0
    if statistics is None:

        def solve_group(collected: GrowthStatistics, layers: list[int]) -> None:
            # Each group's M is solved as soon as it is complete and then freed (`collect_statistics`).
            nonlocal problem
            started = time.perf_counter()
            with stage("solve", enabled=progress):
                if problem is None:
                    problem = solve(collected, layers, release=True)
                else:
                    problem.solve_layers(layers)
            seconds["solve"] += time.perf_counter() - started

        statistics = collect_configured_statistics(
            model, statistics_batches, adapter, loss_fn, config, progress=progress, accelerator=accelerator,
            on_group=solve_group, sharding=sharding,
        )
    seconds["statistics"] = time.perf_counter() - tick - seconds["solve"]

    tick = time.perf_counter()
    with stage("solve", enabled=progress and problem is None):
        if problem is None:
            problem = solve(statistics, range(len(qk_before)), release=False)
    if problem.truncation != truncation:  # solved for Frobenius truncation, the simplest candidate's held too
        problem.set_truncation(truncation)
    with stage("budget", enabled=progress and growth is None):
        if growth is None:
            gains = [problem.gain_rates(layer).marginal.sum(dim=0) for layer in range(len(qk_before))]
            growth = allocate_budget(gains, config.budget, config.multiple_of)
            qk_after = [dim + extra for dim, extra in zip(qk_before, growth)]
            problem.widen(qk_after, adapter, model.config)
            warn_unaligned(qk_after, growth)
    return_free_memory()
    seconds["solve"] += time.perf_counter() - tick
    if config.step_size is None and not problem.has_gradient:  # every search of it takes step 0
        logger.warning("the loss has zero gradient with respect to every head's scores: nothing to gain, step 0.")
    return PreparedGrowth(
        model, adapter, config, loss_fn, qk_before, qk_after, max_rank, statistics, eval_batches, problem,
        model.num_parameters(), seconds, accelerator, confirmation,
    )
