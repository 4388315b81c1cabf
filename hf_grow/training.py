"""Growth during training: widen the query/key heads of a model in place, so that its optimizer carries on.

`grow_model` returns a new model; inside a training loop the model object, its Parameters and the optimizer
must survive. Here the model is already of a grown type (built from a grown config, or converted once with
`to_grown_model` before the optimizer is created), and growth resizes its Q/K Parameters in place
(``param.data = ...``: the optimizer's param_groups, the LR scheduler and the Trainer keep working) and remaps
the optimizer state: moments of entries that keep their meaning are kept, new entries start at zero (or, with
``new_moments="head_mean"``, their second moments at their head's; see `hf_grow.optimizer_state`), the step
count is kept.

Growth modes (the first two solved from the loss statistics, the last two baselines without statistics):

- ``"refactor"``: every Q/K weight becomes the rank-(d_k + p) truncation of Z - lam P (`grow_model`'s solve);
  their optimizer moments are reset to zero, since no old entry keeps its meaning.
- ``"append"``: the old Q/K weights are kept (the change of attention scale folded into the queries) and the
  p new dimensions hold the best rank-p approximation of the step -lam P in the metric of C; the moments of
  the old entries are kept (the queries' rescaled by the same fold, the keys' bit for bit).
- ``"zero"``: plain function-preserving widening: new query dims random (``init_std``), new key dims zero.
- ``"random"``: new query and key dims both random (``init_std``): not function-preserving.

With Adam, entries whose moments start at zero while the step count is large take up to a few times the
usual update size for their first ~1/(1 - beta2) steps (the bias correction assumes moments of age ``step``);
``new_moments="head_mean"`` avoids that; it measured no better on the plateau task, so it is not the default.

The default ``mode="refactor"`` is what measured best on a retrieval task whose training stalls on a plateau
(`recipes/benchmarks/bench_bottleneck.py`, BENCHMARKS.md).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from transformers import PreTrainedModel, TrainerCallback

from .adapters import ArchitectureAdapter, get_adapter
from .config import GrowthConfig, resolve_config
from .distributed import (
    Processes,
    ddp_wrappers,
    refuse_sharded_training,
    sharded_training_message,
    synchronize_after_growth,
    unwrap_model,
)
from .growth import QKWeights, prepare_growth, resolve_growth, search_and_report, write_weights
from .optimizer_state import DEFAULT_NEW_MOMENTS, check_new_moments, fill_new_moments
from .report import GrowthReport
from .statistics import GrowthStatistics, LossFn


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")

GROWTH_MODES: tuple[str, ...] = ("refactor", "append", "zero", "random")
#: On bench_bottleneck's plateau preset (3 seeds) refactor left the plateau first (step 208 against 233 for
#: append and 275 for zero/random) with the lowest mean loss over training, 0.81x the better baseline's (append
#: 0.88x); on the easy retrieval task and on text the two tie (BENCHMARKS.md). Architectures that cannot
#: refactor (rotary models) take their own default (`ArchitectureAdapter.check_mode`) when mode is None.
DEFAULT_MODE = "refactor"

#: Optimizer state entries that can be remapped, and their degree in the gradient: when a weight is rescaled by
#: ``fold`` its gradient scales by ``1 / fold``, so a moment of degree k scales by ``fold ** -k``.
OPTIMIZER_STATE_DEGREES: dict[str, int] = {
    "exp_avg": 1,  # Adam, AdamW
    "exp_avg_sq": 2,
    "max_exp_avg_sq": 2,
    "momentum_buffer": 1,  # SGD, RMSprop
    "sum": 2,  # Adagrad
    "square_avg": 2,  # RMSprop
    "grad_avg": 1,
}


def to_grown_model(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` as its grown type, computing exactly the same function, ready to grow during training.

    A plain model (e.g. `GPT2LMHeadModel`) becomes a new grown model (e.g. `GrownGPT2LMHeadModel`) with the
    same weights; a model already of a grown type is returned as is. Convert before creating the optimizer.
    """
    adapter = get_adapter(model)
    if isinstance(model, adapter.grown_base_class):
        return model
    return adapter.build_grown_model(model, adapter.qk_head_dims(model.config), {})


def _torch_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer inside an accelerate ``AcceleratedOptimizer`` (or the optimizer itself)."""
    while (
        optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer")
    ):
        optimizer = optimizer.optimizer
    return optimizer


def _check_growable(model: PreTrainedModel, adapter: ArchitectureAdapter, optimizer: torch.optim.Optimizer | None):
    """Refuse, before any work, a model that is not of a grown type or optimizer state that cannot be remapped."""
    if not isinstance(model, adapter.grown_base_class):
        raise ValueError(
            f"{type(model).__name__} is not of a grown model type, so its Q/K cannot be resized in place: build it "
            "from a grown config (e.g. hf_grow.GrownGPT2Config(qk_head_dims=...)) or convert it once with "
            "hf_grow.to_grown_model(model) before creating the optimizer."
        )
    if optimizer is None:
        return
    for attention in adapter.attention_modules(model):
        parameters = dict(attention.named_parameters())
        for name in adapter.qk_parameter_names(attention):
            state = optimizer.state.get(parameters[name], {})
            unknown = sorted(
                key
                for key, value in state.items()
                if isinstance(value, Tensor) and value.dim() > 0 and key not in OPTIMIZER_STATE_DEGREES
            )
            if unknown:
                raise ValueError(
                    f"cannot remap the {type(optimizer).__name__} state {unknown} of {name}: supported state entries "
                    f"are {sorted(OPTIMIZER_STATE_DEGREES)} (Adam/AdamW, SGD, Adagrad, RMSprop) and scalars."
                )


def _pad(tensor: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


def resize_qk_(
    model: PreTrainedModel,
    weights: QKWeights,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    keep_moments: bool,
    new_moments: str = "zero",
) -> None:
    """Give the layers in ``weights`` these augmented Q/K weights, of any width, in place; remap the optimizer.

    ``weights[layer]`` is ``(query, key)`` of shape ``(heads, d_e + 1, qk_dim)``. The Parameter objects stay,
    their ``.grad`` is cleared, ``model.config.qk_head_dims`` and the attention modules follow the new width.
    With ``keep_moments`` the optimizer state of the old Q/K dimensions is kept, the queries' rescaled by the
    change of attention scale (the weights must then hold the old queries times ``scaling_before /
    scaling_after``, as every mode but "refactor" does); otherwise the Q/K state is reset to zero. New
    dimensions start at zero, or with ``new_moments="head_mean"`` their second moments at the mean of the old
    entries' of the same head and role (`hf_grow.optimizer_state`); entries that are not Q/K (GPT-2's fused
    values) and scalars (``step``) are kept.
    """
    adapter = get_adapter(model)
    optimizer = _torch_optimizer(optimizer)
    _check_growable(model, adapter, optimizer)
    config = model.config
    dims = adapter.qk_head_dims(config)
    attentions = adapter.attention_modules(model)
    with torch.no_grad():
        for layer, (query, key) in weights.items():
            attention = attentions[layer]
            new_dim = query.shape[-1]
            if new_dim < dims[layer]:
                raise ValueError(
                    f"layer {layer} has {dims[layer]} query/key dims: growth cannot shrink it to {new_dim}"
                )
            parameters = dict(attention.named_parameters())
            names = adapter.qk_parameter_names(attention)
            fold = adapter.scaling(config, layer, dims[layer]) / adapter.scaling(config, layer, new_dim)
            states = [optimizer.state.get(parameters[name], {}) for name in names] if optimizer is not None else []
            for state_key in {key for state in states for key in state}:
                present = [state.get(state_key) for state in states]
                if not all(isinstance(value, Tensor) and value.dim() > 0 for value in present):
                    continue  # scalars such as the step count are kept
                source = dict(zip(names, present))
                old_query, old_key = adapter.read_qk(attention, source)
                degree = OPTIMIZER_STATE_DEGREES[state_key]
                if keep_moments:
                    old_query = old_query * fold**-degree
                    new_query, new_key = _pad(old_query, new_dim), _pad(old_key, new_dim)
                else:
                    new_query = old_query.new_zeros(*old_query.shape[:-1], new_dim)
                    new_key = old_key.new_zeros(*old_key.shape[:-1], new_dim)
                start = dims[layer] if keep_moments else 0
                new_query = fill_new_moments(new_query, old_query, start, degree, new_moments)
                new_key = fill_new_moments(new_key, old_key, start, degree, new_moments)
                for name, value in adapter.qk_parameters(attention, new_query, new_key, source).items():
                    optimizer.state[parameters[name]][state_key] = value
            for name, value in adapter.qk_parameters(attention, query, key).items():
                _resize_parameter(parameters[name], value)
            adapter.set_qk_head_dim(attention, config, layer, new_dim)
            dims[layer] = new_dim
    config.qk_head_dims = dims


def _resize_parameter(parameter: torch.nn.Parameter, value: Tensor) -> None:
    """``parameter.data = value`` for a new shape, keeping the Parameter object, its gradient cleared.

    Autograd caches a parameter's gradient accumulator (with its shape) while any graph that used it is alive,
    e.g. through a ``loss`` variable of the last step, and ``.data =`` drops that cache only on a change of
    dtype or device: passing through another dtype first makes the next backward accumulate at the new shape.
    """
    parameter.data = value.to(torch.float64 if value.dtype != torch.float64 else torch.float32)
    parameter.data = value
    parameter.grad = None


def _initialized_weights(
    model: PreTrainedModel, adapter: ArchitectureAdapter, added: list[int], mode: str, init_std: float, seed: int
) -> QKWeights:
    """The baselines' weights: old Q/K kept (scale folded into the queries), new dims random or zero."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    config = model.config
    for layer, (attention, extra) in enumerate(zip(adapter.attention_modules(model), added)):
        if extra == 0:
            continue
        query, key = adapter.read_qk(attention)
        old_dim = query.shape[-1]
        fold = adapter.scaling(config, layer, old_dim) / adapter.scaling(config, layer, old_dim + extra)
        width = query.shape[1]
        has_bias = width == adapter.hidden_size(config) + 1  # augmented weights (Llama's have no bias row)

        def draw(heads: int) -> Tensor:  # key heads may be fewer (grouped-query attention)
            new = torch.randn(heads, width, extra, generator=generator, dtype=torch.float64) * init_std
            if has_bias:
                new[:, -1] = 0  # biases of new dims start at zero
            return new

        new_query = draw(query.shape[0])
        new_key = draw(key.shape[0]) if mode == "random" else key.new_zeros(key.shape[0], width, extra)
        weights[layer] = (torch.cat([query * fold, new_query], -1), torch.cat([key, new_key], -1))
    return weights


def _resolved_mode(model: PreTrainedModel, mode: str | None) -> str:
    """``mode``, or for None `DEFAULT_MODE` where the architecture supports it, else its own default."""
    if mode is not None:
        return mode
    adapter = get_adapter(model)
    return DEFAULT_MODE if DEFAULT_MODE in adapter.growth_modes else adapter.check_mode(model, None)


def grow_in_training(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer | None,
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

    Unlike `grow_model` this modifies ``model`` (a grown model type; see `to_grown_model`): its Parameters are
    resized in place, so ``optimizer`` (a torch optimizer or accelerate's wrapper around one), the LR schedule
    and a `transformers.Trainer` carry on. Call it between optimizer steps (after ``zero_grad``).

    With several processes (DDP: torchrun, ``accelerate launch``), call it on every process with that process's
    own shard of the batches and the ``accelerator``, passing the DDP-wrapped model (what ``accelerator.prepare``
    returned: the wrapper cannot be found from the model inside it). The statistics and held-out losses are
    summed across processes, every process gets the main process's grown weights, and the DDP wrapper's gradient
    buckets are rebuilt for the new shapes, in place: the wrapped model and the optimizer carry on as they are.
    FSDP and DeepSpeed are refused.

    Args:
        mode: ``"refactor"`` or ``"append"`` (solved from statistics over ``dataloader``, line search on
            ``eval_dataloader`` or the last ``eval_fraction`` of the batches), ``"zero"`` or ``"random"``
            (baselines: no data needed); see the module docstring. None (default): ``"refactor"``, or the
            architecture's own solved mode where it cannot refactor (``"append"`` for rotary models).
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
            differ from `GrowthConfig`'s: ``eval_fraction=0.25`` and ``measure_realized_gains=False`` (keyword
            overrides apply on top of them); a config passed is used as it is. A ``budget`` is `grow_model`'s.
        Other arguments as in `grow_model`.

    Returns:
        The `GrowthReport` of the solved modes (also set as ``model.growth_report``, so that checkpoints carry
        it), None for the baselines.
    """
    if mode is not None and mode not in GROWTH_MODES:
        raise ValueError(f"mode must be one of {GROWTH_MODES}, got {mode!r}")
    check_new_moments(new_moments)
    overrides = overrides if p is None else {**overrides, "p": p}
    config = resolve_config(config, overrides, eval_fraction=0.25, measure_realized_gains=False)
    if config.budget is not None:
        raise ValueError("grow_in_training adds p dims per layer; a budget allocation is grow_model's (budget=None)")
    refuse_sharded_training(model, accelerator)
    wrappers, model, is_main = ddp_wrappers(model), unwrap_model(model, accelerator), Processes(accelerator).is_main
    adapter = get_adapter(model)
    mode = _resolved_mode(model, mode)
    if wrappers and accelerator is None and mode in ("refactor", "append"):
        raise ValueError(
            "the model is wrapped by DistributedDataParallel: pass accelerator=accelerate.Accelerator() on every "
            "process, so that the statistics are summed across processes and every process grows the same way."
        )
    torch_optimizer = _torch_optimizer(optimizer)
    _check_growable(model, adapter, torch_optimizer)
    if mode in ("zero", "random"):
        added = resolve_growth(config.p, len(adapter.attention_modules(model)))
        std = getattr(model.config, "initializer_range", 0.02) if init_std is None else init_std
        if not math.isfinite(std) or std < 0:
            raise ValueError(f"init_std must be a finite number >= 0, got {init_std}")
        weights = _initialized_weights(model, adapter, added, mode, std, seed)
        resize_qk_(model, weights, torch_optimizer, keep_moments=True, new_moments=new_moments)
        synchronize_after_growth(_qk_parameters(model, adapter, weights), wrappers, accelerator)
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
    resize_qk_(model, at_zero, torch_optimizer, keep_moments=mode == "append", new_moments=new_moments)
    try:
        report = search_and_report(
            prepared, model, measure_realized_gains=config.measure_realized_gains, progress=progress and is_main,
            started=started,
        )
    except BaseException:
        write_weights(adapter, model, at_zero)  # the old function, at the new width: a single process can go on
        raise
    synchronize_after_growth(_qk_parameters(model, adapter, at_zero), wrappers, accelerator)
    model.growth_report = report
    return report


def _qk_parameters(model: PreTrainedModel, adapter: ArchitectureAdapter, layers: Iterable[int]) -> list[Tensor]:
    """The Parameters that hold the query/key weights of ``layers``."""
    attentions = adapter.attention_modules(model)
    return [
        dict(attentions[layer].named_parameters())[name]
        for layer in layers
        for name in adapter.qk_parameter_names(attentions[layer])
    ]


class GrowthCallback(TrainerCallback):
    """Grow a model's query/key heads during `transformers.Trainer` training, keeping the optimizer.

    At the end of each scheduled optimizer step, draws ``statistics_batches + eval_batches`` batches from the
    training set (with the Trainer's collator and batch size, from a generator of its own: the training
    order and the global RNG are untouched), collects statistics on the first ones, line-searches the step on
    the held-out rest, and resizes the model in place (`grow_in_training`). Training then continues with the
    same optimizer, step count and LR schedule; checkpoints saved afterwards carry the new ``qk_head_dims``.

    To resume from such a checkpoint, build the model from it (``AutoModelForCausalLM.from_pretrained(
    checkpoint)``) so that its shapes match, then ``trainer.train(resume_from_checkpoint=checkpoint)``;
    growths scheduled at steps already done are not repeated.

    Args:
        grow_at: ``{global_step: p}``, the dims to add per head at each step (an int, or ``{layer: p}``).
        qk_dims_at: alternatively ``{global_step: width}``, the total query/key width to reach (an int for
            every layer, or one per layer); layers already that wide get no new dims.
        mode: ``"refactor"``, ``"append"``, ``"zero"`` or ``"random"`` (see `hf_grow.training`); None (default)
            as in `grow_in_training`.
        new_moments: how the optimizer moments of new Q/K entries start (see `grow_in_training`).
        statistics_batches, eval_batches: batches drawn for the statistics and for the line search.
        dataloader, eval_dataloader: fixed batches to use instead of drawing from the training set.
        seed: seed of the batch draw (plus the global step) and of the baselines' random dims.
        config: the growth options (`GrowthConfig`) of every growth, passed to `grow_in_training` (used as it
            is: `grow_in_training`'s own defaults apply without one); ``p`` comes from the schedule.
        trainer: the `transformers.Trainer`, required with several processes (DDP under ``torchrun`` or
            ``accelerate launch``): the callback then grows the Trainer's DDP-wrapped model with its accelerator
            (``trainer.add_callback(GrowthCallback(..., trainer=trainer))``). Each process draws the same
            ``(statistics_batches + eval_batches) * world_size`` batches and uses every world_size-th, so the
            processes together read the samples that one process whose batch is the global batch would;
            fixed ``dataloader``/``eval_dataloader`` are each process's own shard, as in `grow_model`.
        growth_kwargs: passed to `grow_in_training` (``step_size``, ``truncation``, ``loss_fn``, ...).

    ``reports`` maps each step at which the model grew to its `GrowthReport` (None for the baselines); a
    summary also goes to ``state.log_history`` (and so to ``trainer_state.json``).
    One process or DDP; FSDP and DeepSpeed are refused (they shard parameters and optimizer state by shape).
    """

    def __init__(
        self,
        grow_at: Mapping[int, int | Mapping[int, int]] | None = None,
        *,
        qk_dims_at: Mapping[int, int | Sequence[int]] | None = None,
        mode: str | None = None,
        new_moments: str = DEFAULT_NEW_MOMENTS,
        statistics_batches: int = 8,
        eval_batches: int = 4,
        dataloader: Iterable[Mapping[str, Tensor]] | None = None,
        eval_dataloader: Iterable[Mapping[str, Tensor]] | None = None,
        seed: int = 0,
        config: GrowthConfig | None = None,
        trainer: Any | None = None,
        **growth_kwargs,
    ):
        if (grow_at is None) == (qk_dims_at is None):
            raise ValueError("pass exactly one of grow_at={step: p} and qk_dims_at={step: width}")
        schedule = grow_at if grow_at is not None else qk_dims_at
        bad_steps = [step for step in schedule if isinstance(step, bool) or not isinstance(step, int) or step <= 0]
        if bad_steps:
            raise ValueError(f"growth steps must be positive global steps (optimizer steps), got {bad_steps}")
        if mode is not None and mode not in GROWTH_MODES:
            raise ValueError(f"mode must be one of {GROWTH_MODES}, got {mode!r}")
        check_new_moments(new_moments)
        if statistics_batches < 1 or eval_batches < 1:
            raise ValueError("statistics_batches and eval_batches must be at least 1")
        if qk_dims_at is not None:
            widths = sorted(schedule.items())
            flat = [min(w) if isinstance(w, Sequence) else w for _, w in widths]
            if any(not isinstance(w, int) or w <= 0 for w in flat) or flat != sorted(flat):
                raise ValueError(f"qk_dims_at must map steps to positive, non-decreasing widths, got {dict(widths)}")
        self.grow_at = dict(grow_at) if grow_at is not None else None
        self.qk_dims_at = dict(qk_dims_at) if qk_dims_at is not None else None
        self.mode = mode
        self.new_moments = new_moments
        self.statistics_batches = statistics_batches
        self.eval_batches = eval_batches
        self.dataloader = dataloader
        self.eval_dataloader = eval_dataloader
        self.seed = seed
        self.config = config
        self.trainer = trainer
        self.growth_kwargs = growth_kwargs
        self.reports: dict[int, GrowthReport | None] = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.deepspeed or args.fsdp:
            raise ValueError(sharded_training_message("DeepSpeed" if args.deepspeed else "FSDP"))
        if args.world_size > 1 and self.trainer is None:
            raise ValueError(
                f"GrowthCallback with {args.world_size} processes needs the Trainer, to grow its DDP-wrapped model "
                "with its accelerator: trainer.add_callback(GrowthCallback(..., trainer=trainer))."
            )
        if self.trainer is not None:
            refuse_sharded_training(self.trainer.model_wrapped, self.trainer.accelerator)
        _check_growable(_unwrapped(model), get_adapter(_unwrapped(model)), _torch_optimizer(optimizer))

    def _added_dims(self, step: int, model: PreTrainedModel) -> int | dict[int, int]:
        if self.grow_at is not None:
            return self.grow_at[step]
        current = get_adapter(model).qk_head_dims(model.config)
        target = self.qk_dims_at[step]
        targets = [target] * len(current) if isinstance(target, int) else list(target)
        if len(targets) != len(current):
            raise ValueError(f"qk_dims_at[{step}] has {len(targets)} widths but the model has {len(current)} layers")
        return {layer: max(0, want - have) for layer, (want, have) in enumerate(zip(targets, current))}

    def _draw_batches(self, train_dataloader, args, step: int) -> tuple[list, list]:
        """This process's statistics and held-out batches, from the training set through the Trainer's collator,
        in an order of their own: every process draws the same batches and takes every world_size-th."""
        eval_batches = 0 if self.eval_dataloader is not None else self.eval_batches
        count = (self.statistics_batches + eval_batches) * args.world_size
        dataset, collate_fn = train_dataloader.dataset, train_dataloader.collate_fn
        batch_size = args.per_device_train_batch_size
        if isinstance(dataset, IterableDataset):
            loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn)
        else:
            generator = torch.Generator().manual_seed(self.seed + step)
            sampler = RandomSampler(dataset, generator=generator)
            loader = DataLoader(
                dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, generator=generator
            )
        drawn = list(itertools.islice(loader, count))[args.process_index :: args.world_size]
        return drawn[: self.statistics_batches], drawn[self.statistics_batches :]

    def on_step_end(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        schedule = self.grow_at if self.grow_at is not None else self.qk_dims_at
        step = state.global_step
        if step not in schedule or step in self.reports:
            return
        model = _unwrapped(model)
        added = self._added_dims(step, model)
        if isinstance(added, dict):
            added = {layer: extra for layer, extra in added.items() if extra}
            if not added:
                return
        eval_dataloader = self.eval_dataloader
        batches = self.dataloader
        mode = _resolved_mode(model, self.mode)
        if batches is None and mode in ("refactor", "append"):  # the baselines need no data
            batches, drawn_eval = self._draw_batches(train_dataloader, args, step)
            eval_dataloader = drawn_eval if eval_dataloader is None else eval_dataloader
        report = grow_in_training(
            model if self.trainer is None else self.trainer.model_wrapped,
            optimizer,
            batches,
            added,
            mode=mode,
            new_moments=self.new_moments,
            eval_dataloader=eval_dataloader,
            seed=self.seed + step,
            config=self.config,
            accelerator=None if self.trainer is None else self.trainer.accelerator,
            **self.growth_kwargs,
        )
        self.reports[step] = report
        entry = {"step": step, "growth_mode": mode, "qk_head_dims": list(model.config.qk_head_dims)}
        if report is not None:
            entry.update(growth_eval_loss_before=report.eval_loss_before, growth_eval_loss_after=report.eval_loss_after)
        state.log_history.append(entry)
        logger.info("step %d: grew query/key heads to %s (%s)", step, model.config.qk_head_dims, mode)


def _unwrapped(model: torch.nn.Module) -> PreTrainedModel:
    """The model inside a torch wrapper such as DataParallel (``.module``)."""
    while not isinstance(model, PreTrainedModel) and hasattr(model, "module"):
        model = model.module
    return model
