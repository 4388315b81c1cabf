"""`grow_in_training`: one growth of a model being trained, in place (the solved modes and the baselines)."""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, get_adapter, scale_dims_after_growth
from ..config import GrowthConfig, resolve_config, training_options
from ..distributed import (
    Processes, ddp_wrappers, refuse_sharded_training, refuse_unsupported_ddp, synchronize_after_growth, unwrap_model,
)
from ..growth import QKWeights, prepare_growth, resolve_growth, search_and_report, write_weights
from ..growth.line_search import batches_read
from ..optimizer_state import DEFAULT_NEW_MOMENTS, check_new_moments
from ..progress import known_length
from ..option_values import SOLVED_MODES, held_out_count
from ..report import GrowthReport
from ..statistics import GrowthStatistics, LossFn
from .resize import Optimizers, check_growable, resize_qk_, torch_optimizers

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger("hf_grow")

#: The solved modes (`SOLVED_MODES`; without a config they solve from the cross-fitted M where the statistics can
#: have two halves, `_in_training_defaults`) and the baselines.
GROWTH_MODES: tuple[str, ...] = (*SOLVED_MODES, "zero", "random")
#: Measured with growth in training's other defaults (BENCHMARKS.md, issue #35, "The solved new dims' weight
#: where the inputs do not vary yet" and the two sections after it): in language-model pretraining with
#: GrowthCallback on CPU models (2 layers x 128 in three regimes, 8 seeds; 4 layers x 256, 10 seeds) append with
#: rtol 1e-5 was ahead of the original in the mean in every setting and never behind it beyond the seed spread (a
#: shallow dip 25 steps after the growth with beta2 0.999: +0.0028, within the spread), where refactor (rtol 1e-6)
#: was behind it 50-150 steps after the growth on 4-5 of 6 seeds on the 4 x 256 model; on bench_bottleneck's
#: retrieval plateau refactor leaves the plateau earlier (mean loss 0.957 against 1.054; both ahead of zero
#: widening, 1.285), on text the two tie. Architectures that cannot append take their own default
#: (`ArchitectureAdapter.check_mode`).
DEFAULT_MODE = "append"
#: `GrowthConfig` defaults of growth in a training loop, without a config, beside the options for training after
#: growth (`FOR_TRAINING`: training follows every growth here): a quarter of the (few) statistics batches held out
#: and no per-layer replays (docstring of `grow_in_training`). Of `FOR_TRAINING`, measured in training loops
#: (BENCHMARKS.md, issue #35): a tenth of the searched step was never behind training at the old width during
#: pretraining (a retrieval plateau and text, 8 seeds; the plateau left at a median step 275 against 300-337), and
#: with GrowthCallback inside transformers.Trainer ahead of the original by 0.037 at 8 layers x 512 on an H100
#: (the whole step behind for 350 steps); the kept scale put zero widening never behind there on any seed (CPU).
#: C's tolerance ``rtol=1e-5`` instead of `GrowthConfig`'s 1e-6: with 1e-6 the solved dims put large weights in
#: directions where the inputs hardly vary at the growth, and as pretraining moves the inputs their scores grew past
#: the old dims' (frozen new dims: 0.4% -> 159% of the old dims' scores in 150 steps; 1e-5: -> 14%), behind a dip
#: after the growth. 1e-5 drops the most degenerate of those directions and keeps the rest: on CPU models (2 layers
#: x 128 in three regimes, 4 x 256) it was ahead of the original in all four, of 1e-3 in three (level in the
#: fourth) and of 1e-6 or equal to it, without 1e-6's dip; on the H100 model (8 x 512) 1e-3 gave up 0.007 of 1e-6's
#: lead (BENCHMARKS.md, "The in-training defaults on the H100 model").
IN_TRAINING_DEFAULTS = dict(eval_fraction=0.25, measure_realized_gains=False, rtol=1e-5)


def _initialized_weights(
    model: PreTrainedModel,
    adapter: ArchitectureAdapter,
    added: list[int],
    mode: str,
    init_std: float,
    seed: int,
    keep_attention_scale: bool,
) -> QKWeights:
    """The baselines' weights: old Q/K kept (any change of attention scale folded into the queries), new dims
    random or zero, on the model's device (drawn on the host, so that a seed gives the same dims on every
    device)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    config = model.config
    qk_dims = adapter.qk_head_dims(config)
    scale_dims = adapter.attention_scale_dims(config)
    scale_dims_after = scale_dims_after_growth(
        qk_dims, scale_dims, [dim + extra for dim, extra in zip(qk_dims, added)], keep_attention_scale
    )
    for layer, (attention, extra) in enumerate(zip(adapter.attention_modules(model), added)):
        if extra == 0:
            continue
        query, key = adapter.read_qk(attention)
        scaling_before = adapter.scaling(config, layer, scale_dims[layer])
        fold = scaling_before / adapter.scaling(config, layer, scale_dims_after[layer])
        width = query.shape[1]
        has_bias = width == adapter.hidden_size(config) + 1  # augmented weights (Llama's have no bias row)

        def draw(heads: int) -> Tensor:  # key heads may be fewer (grouped-query attention)
            new = torch.randn(heads, width, extra, generator=generator, dtype=torch.float64).to(query.device) * init_std
            if has_bias:
                new[:, -1] = 0  # biases of new dims start at zero
            return new

        new_query = draw(query.shape[0])
        new_key = draw(key.shape[0]) if mode == "random" else key.new_zeros(key.shape[0], width, extra)
        weights[layer] = (torch.cat([query * fold, new_query], -1), torch.cat([key, new_key], -1))
    return weights


def _in_training_defaults(
    mode: str,
    overrides: Mapping[str, Any],
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None,
    statistics: GrowthStatistics | None,
    processes: Processes | None,
    device: torch.device | None,
) -> dict[str, Any]:
    """`grow_in_training`'s `GrowthConfig` defaults: `IN_TRAINING_DEFAULTS` and the options for training after
    growth (`training_options`), of which the baselines take no ``cross_fit`` and the solved modes take it where the
    statistics can have two halves: precomputed ones that hold them, or batches collected here of which the
    statistics get at least two on some process (or an unknown number: an iterable without ``len``). Every process
    of ``processes`` takes the same decision (None: this process's, without communication)."""
    defaults = {**IN_TRAINING_DEFAULTS, **training_options(overrides)}
    if mode not in SOLVED_MODES or "cross_fit" in overrides:
        return {name: value for name, value in defaults.items() if name != "cross_fit"}
    if statistics is not None:
        halves = statistics.half_gradients is not None
    else:
        count = known_length(dataloader)
        max_batches = overrides.get("max_batches")
        # without held-out batches, every search (coordinate steps too) holds out the last ones (`split_batches`)
        if count is not None and eval_dataloader is None and overrides.get("step_size") is None:
            eval_fraction = overrides.get("eval_fraction", IN_TRAINING_DEFAULTS["eval_fraction"])
            if max_batches is not None:  # only the batches that leave max_batches beside the held-out share are read
                count = min(count, batches_read(max_batches, eval_fraction))
            count -= held_out_count(count, eval_fraction)
        if max_batches is not None:
            count = max_batches if count is None else min(count, max_batches)
        halves = count is None or count >= 2
    # the odd-numbered half needs a second batch on one process at least
    if processes is not None and processes.world_size > 1:
        halves = processes.sum_(torch.tensor(float(halves), device=device)).item() > 0
    return {**defaults, "cross_fit": halves}


def model_to_grow(model: torch.nn.Module, accelerator: Accelerator | None = None) -> PreTrainedModel:
    """The model whose Q/K grow in place, inside DDP, accelerate and torch.compile wrappers (`unwrap_model`) and a
    PEFT ``PeftModel`` (its base model, which holds the adapters: those on Q/K are refused by `check_growable`)."""
    model = unwrap_model(model, accelerator)
    while not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        model = unwrap_model(model.get_base_model())
    return model


def resolved_mode(model: PreTrainedModel, mode: str | None) -> str:
    """``mode``, or for None `DEFAULT_MODE` where the architecture supports it, else its own default."""
    if mode is not None:
        return mode
    adapter = get_adapter(model)
    return DEFAULT_MODE if DEFAULT_MODE in adapter.growth_modes else adapter.check_mode(model, None)


def check_init_std(init_std: float) -> None:
    if isinstance(init_std, bool) or not isinstance(init_std, numbers.Real) or not (
        math.isfinite(init_std) and init_std >= 0
    ):
        raise ValueError(f"init_std must be a finite number >= 0, got {init_std!r}")


def grow_in_training(
    model: PreTrainedModel,
    optimizer: Optimizers,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    p: int | Mapping[int, int] | None,
    *,
    mode: str | None = None,
    new_moments: str = DEFAULT_NEW_MOMENTS,
    config: GrowthConfig | None = None,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None = None,
    statistics: GrowthStatistics | None = None,
    loss_fn: LossFn | None = None,
    init_std: float | None = None,
    seed: int = 0,
    progress: bool = False,
    accelerator: Accelerator | None = None,
    **overrides: Any,
) -> GrowthReport | None:
    """Grow ``model``'s query/key heads by ``p`` in place, mid-training, and remap ``optimizer``'s state.

    Unlike `grow_model` this modifies ``model`` (a grown model type, see `to_grown_model`; or a torch.compile or
    PEFT wrapper around one, whose adapters are not on Q/K: merge those first): its Parameters are resized in
    place, so ``optimizer`` (a torch optimizer or accelerate's wrapper around one; or a list of optimizers that share
    the model's parameters, e.g. Muon for the matrices and AdamW for the rest: each one's state is remapped), the
    LR schedule and a `transformers.Trainer` carry on. Call it between optimizer steps: the Q/K Parameters'
    ``.grad`` is cleared (in the middle of a gradient accumulation, their share so far would be lost; the others'
    kept; GPT-2's fused ``c_attn`` holds V too, whose share goes with it). Copies of the weights made before the
    growth (an EMA or SWA model, `torch.optim.swa_utils.AveragedModel`) keep the old shapes: make them again.

    With several processes (DDP: torchrun, ``accelerate launch``), call it on every process with that process's
    own shard of the batches and the ``accelerator``, passing the DDP-wrapped model (what ``accelerator.prepare``
    returned: the wrapper cannot be found from the model inside it). The statistics and held-out losses are
    summed across processes, every process gets the main process's grown weights, and the DDP wrapper's gradient
    buckets are rebuilt for the new shapes, in place: the wrapped model and the optimizer carry on as they are.
    FSDP and DeepSpeed are refused.

    Args:
        mode: ``"refactor"`` or ``"append"`` (solved from statistics over ``dataloader``, line search on
            ``eval_dataloader`` or the last ``eval_fraction`` of the batches), ``"zero"`` or ``"random"``
            (baselines: no data needed); see the module docstring. None (default): `DEFAULT_MODE`, ``"append"``
            (or the architecture's own solved mode where it cannot append).
        new_moments: how the optimizer moments of the new Q/K entries (all Q/K entries in mode "refactor")
            start: ``"zero"`` (default), as a fresh optimizer, or ``"head_mean"``: second moments at the mean of
            the old entries' of the same head and role, first moments zero (see `hf_grow.optimizer_state`).
        init_std: standard deviation of the random new dims of the baselines (default:
            ``config.initializer_range``).
        seed: seed of the baselines' random new dims (the global RNG is not touched).
        accelerator: an `accelerate.Accelerator`, to grow with several processes (required for the solved
            modes when the model is DDP-wrapped; the baselines draw the same dims on every process).
        p: dimensions added per head, in every layer, or ``{layer: p}``; None takes ``config.p`` (default 8,
            for the solved modes).
        config, overrides: the growth options as in `grow_model`. Without a config, this function's defaults
            differ from `GrowthConfig`'s: ``eval_fraction=0.25`` and ``measure_realized_gains=False`` (a quarter
            of a few statistics batches held out, no per-layer replays), ``rtol=1e-5`` (C's eigenvalues below
            1e-5 of the largest dropped: less new weight where the inputs do not vary yet, which pretraining
            would then activate; `IN_TRAINING_DEFAULTS`), and the options for training after
            growth (`GrowthConfig.for_training`, `hf_grow.config.FOR_TRAINING`): ``step_scale=0.1`` where the step
            is searched (a tenth of the searched step was never behind training at the old width; BENCHMARKS.md),
            ``step_mode="per_head"`` (a quarter of a few batches can hardly confirm a choice of step mode),
            ``keep_attention_scale=True`` (every mode), and for the solved modes ``cross_fit=True`` where the
            statistics can have two halves (precomputed statistics collected with ``cross_fit=True``, or at
            least two statistics batches; M's accumulators are then held twice; otherwise the plain M). Keyword
            overrides apply on top of them; a config passed is used as it is. A ``budget`` is `grow_model`'s.
        Other arguments as in `grow_model`.

    Returns:
        The `GrowthReport` of the solved modes (also set as ``model.growth_report``, so that checkpoints carry
        it), None for the baselines (which clear ``model.growth_report``: an earlier report no longer describes
        the model).
    """
    refuse_sharded_training(model, accelerator)  # the same on every process (a launch's mode)
    processes = Processes(accelerator)
    with processes.failing_together():  # a check failing on one process alone must not leave the others waiting
        if mode is not None and mode not in GROWTH_MODES:
            raise ValueError(f"mode must be one of {GROWTH_MODES}, got {mode!r}")
        check_new_moments(new_moments)
        overrides = overrides if p is None else {**overrides, "p": p}
        refuse_unsupported_ddp(model)
        wrappers, model = ddp_wrappers(model), model_to_grow(model, accelerator)
        adapter = get_adapter(model)
        mode = resolved_mode(model, mode)
        # the options' own checks, with this process's defaults (below again with those all the processes agree on)
        local = {} if config is not None else _in_training_defaults(
            mode, overrides, dataloader, eval_dataloader, statistics, None, None)
        resolve_config(config, overrides, **local)
    is_main = processes.is_main
    if config is None:
        device = next(model.parameters()).device
        defaults = _in_training_defaults(mode, overrides, dataloader, eval_dataloader, statistics, processes, device)
        config = resolve_config(None, overrides, **defaults)
    else:
        config = resolve_config(config, overrides)
    if config.budget is not None:
        raise ValueError("grow_in_training adds p dims per layer; a budget allocation is grow_model's (budget=None)")
    if wrappers and accelerator is None and mode in SOLVED_MODES:
        raise ValueError(
            "the model is wrapped by DistributedDataParallel: pass accelerator=accelerate.Accelerator() on every "
            "process, so that the statistics are summed across processes and every process grows the same way."
        )
    optimizers = torch_optimizers(optimizer)
    check_growable(model, adapter, optimizers)
    if mode in ("zero", "random"):
        added = resolve_growth(config.p, len(adapter.attention_modules(model)))
        std = getattr(model.config, "initializer_range", 0.02) if init_std is None else init_std
        check_init_std(std)
        weights = _initialized_weights(model, adapter, added, mode, std, seed, config.keep_attention_scale)
        resize_qk_(
            model, weights, optimizers, keep_moments=True, new_moments=new_moments,
            keep_attention_scale=config.keep_attention_scale,
        )
        synchronize_after_growth(_qk_parameters(model, adapter, weights), wrappers, accelerator)
        model.growth_report = None  # the report of an earlier growth no longer describes the model
        return None

    started = time.perf_counter()
    prepared = prepare_growth(
        model,
        dataloader,
        config,
        mode=mode,
        eval_dataloader=eval_dataloader,
        loss_fn=loss_fn,
        statistics=statistics,
        accelerator=accelerator,
        progress=progress and is_main,
    )
    at_zero = prepared.problem.weights(0.0)
    if mode == "append":  # layers that do not grow keep their weights and moments untouched
        at_zero = {layer: w for layer, w in at_zero.items() if prepared.qk_after[layer] > prepared.qk_before[layer]}
    resize_qk_(
        model, at_zero, optimizers, keep_moments=mode == "append", new_moments=new_moments,
        keep_attention_scale=config.keep_attention_scale,
    )
    try:
        report = search_and_report(
            prepared, model, measure_realized_gains=config.measure_realized_gains, progress=progress and is_main,
            started=started,
        )
    except BaseException as error:
        write_weights(adapter, model, at_zero)  # the old function, at the new width: training can go on
        if isinstance(error, Exception):  # every process is here (they fail together): DDP's buckets rebuilt
            _synchronize_after_failure(_qk_parameters(model, adapter, at_zero), wrappers, accelerator)
        raise
    synchronize_after_growth(_qk_parameters(model, adapter, at_zero), wrappers, accelerator)
    model.growth_report = report
    return report


def _synchronize_after_failure(parameters: list[Tensor], wrappers: list, accelerator: Accelerator | None) -> None:
    """`synchronize_after_growth` where the line search failed: a DDP wrapper left with the old shapes' buckets
    would let training go on without synchronizing anything. A failure of that too (the process group broken)
    is a warning: the growth's own error is the one raised."""
    try:
        synchronize_after_growth(parameters, wrappers, accelerator)
    except Exception as error:  # the collectives' errors come in many types
        logger.warning("the growth failed, and the processes could not be made consistent after it (%s): do not "
                       "train on through the DistributedDataParallel wrapper", error)


def _qk_parameters(model: PreTrainedModel, adapter: ArchitectureAdapter, layers: Iterable[int]) -> list[Tensor]:
    """The Parameters that hold the query/key weights of ``layers``."""
    attentions = adapter.attention_modules(model)
    return [
        dict(attentions[layer].named_parameters())[name]
        for layer in layers
        for name in adapter.qk_parameter_names(attentions[layer])
    ]
