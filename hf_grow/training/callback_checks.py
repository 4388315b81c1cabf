"""What `GrowthCallback` checks before training: the schedule against the model, the growth options as
`grow_in_training` would take them at the growth step, the training set's size and the Trainer's settings (each
found wrong at the growth step, mid-training, otherwise)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedModel

from ..adapters import get_adapter
from ..config import GrowthConfig, check_p, resolve_config
from ..distributed import refuse_sharded_training, refuse_unsupported_ddp, sharded_training_message
from ..growth import check_fast_search, check_memory_budget, resolve_growth
from ..growth.prepare import QK_INPUT_WIDTH, qk_input_width
from ..progress import known_length
from ..statistics import check_loss_fn, check_statistics_arguments
from ..statistics.batches import check_batch, check_labels
from .grow import DEFAULT_MODE, SOLVED_MODES, _in_training_defaults, check_init_std, grow_in_training

logger = logging.getLogger("hf_grow")


def check_training_setup(args, trainer: Any | None) -> None:
    """Sharded training (DeepSpeed, FSDP), several processes without the Trainer (whose DDP-wrapped model and
    accelerator the growth needs) and DDP options growth cannot follow: refused before the first step."""
    if args.deepspeed or args.fsdp:
        raise ValueError(sharded_training_message("DeepSpeed" if args.deepspeed else "FSDP"))
    if args.world_size > 1 and trainer is None:
        raise ValueError(
            f"GrowthCallback with {args.world_size} processes needs the Trainer, to grow its DDP-wrapped model "
            "with its accelerator: trainer.add_callback(GrowthCallback(..., trainer=trainer))."
        )
    if trainer is not None:
        refuse_sharded_training(trainer.model_wrapped, trainer.accelerator)
        refuse_unsupported_ddp(trainer.model_wrapped)


def check_resumed_widths(model: PreTrainedModel, state) -> None:
    """A run resumed past a growth needs the model of its checkpoint: the growths already done (in the resumed
    ``log_history``) are not repeated, so a model at the old widths would train on at them without a word (a PEFT
    model's checkpoints hold its adapter alone, not the grown base)."""
    grown = [entry["qk_head_dims"] for entry in state.log_history if "qk_head_dims" in entry]
    widths = get_adapter(model).qk_head_dims(model.config)
    if grown and list(grown[-1]) != list(widths):
        raise ValueError(
            f"resuming at step {state.global_step}, after growths to query/key widths {grown[-1]}, but the model has "
            f"{widths}: build the model from the checkpoint (AutoModelForCausalLM.from_pretrained(checkpoint)); a "
            "PEFT model's checkpoints hold its adapter alone, so save its grown base model after the growth "
            "(hf_grow.save_grown_base(peft_model, folder)) and resume with "
            "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), checkpoint, is_trainable=True)"
        )


def check_schedule(
    grow_at: Mapping[int, int | Mapping[int, int]] | None, qk_dims_at: Mapping[int, int | Sequence[int]] | None
) -> None:
    """Exactly one schedule, at positive global steps; widths positive and non-decreasing."""
    if (grow_at is None) == (qk_dims_at is None):
        raise ValueError("pass exactly one of grow_at={step: p} and qk_dims_at={step: width}")
    schedule = grow_at if grow_at is not None else qk_dims_at
    bad_steps = [step for step in schedule if isinstance(step, bool) or not isinstance(step, int) or step <= 0]
    if bad_steps:
        raise ValueError(f"growth steps must be positive global steps (optimizer steps), got {bad_steps}")
    for step, added in (grow_at or {}).items():
        with _naming(f"grow_at[{step}]"):
            check_p(added)
    if qk_dims_at is not None:
        widths = sorted(schedule.items())
        flat = [min(w) if isinstance(w, Sequence) else w for _, w in widths]
        if any(not isinstance(w, int) or w <= 0 for w in flat) or flat != sorted(flat):
            raise ValueError(f"qk_dims_at must map steps to positive, non-decreasing widths, got {dict(widths)}")


def check_schedule_widths(
    grow_at: Mapping[int, int | Mapping[int, int]] | None, qk_dims_at: Mapping[int, int | Sequence[int]] | None,
    model: PreTrainedModel, done: int,
) -> None:
    """A solved mode's widths, through the schedule's growths after step ``done`` (a resumed run's model has those
    before), against the largest rank a head's scores can have (they were refused at the offending growth step,
    after the training to it)."""
    adapter = get_adapter(model)
    widths = adapter.qk_head_dims(model.config)
    limit = qk_input_width(model, adapter)
    for step in sorted(step for step in (grow_at if grow_at is not None else qk_dims_at) if step > done):
        if grow_at is not None:
            entry, added = f"grow_at[{step}]", resolve_growth(grow_at[step], len(widths))
            widths = [width + extra for width, extra in zip(widths, added)]
        else:
            entry, target = f"qk_dims_at[{step}]", qk_dims_at[step]
            targets = [target] * len(widths) if isinstance(target, int) else list(target)
            widths = [max(width, want) for width, want in zip(widths, targets)]
        too_wide = {layer: width for layer, width in enumerate(widths) if width > limit}
        if too_wide:
            raise ValueError(
                f"{entry}: query/key widths {too_wide} exceed {limit}, the width of the query/key projections' "
                f"inputs ({QK_INPUT_WIDTH}) and the largest rank a head's scores can have: lower {entry}"
            )


def check_fixed_batches(model: PreTrainedModel, dataloader: Iterable[Any] | None,
                        eval_dataloader: Iterable[Any] | None, loss_fn: Any, growths: int, world_size: int,
                        read: bool) -> None:
    """The callback's fixed batches, before training, as `grow_in_training` checks them at each growth step: none
    (on one process: under DDP each process's own shard may be empty); where the growths ``read`` them (the solved
    modes), a one-shot iterator read out by the first of several ``growths`` (those still to come), and the
    batches of a list (not those of a DataLoader: iterating it would run its collator and draw from the random
    generators training uses), labels included."""
    for name, batches in (("dataloader", dataloader), ("eval_dataloader", eval_dataloader)):
        if batches is None:
            continue
        if world_size == 1 and known_length(batches) == 0:
            raise ValueError(f"{name} holds no batches: pass batches, or None to draw them from the training set")
        if not read:
            continue
        if growths > 1 and isinstance(batches, Iterator):
            raise ValueError(f"{name} is a one-shot iterator, which the first of the schedule's {growths} growths "
                             "reads out: pass a list of batches (each growth reads them again)")
        if isinstance(batches, (list, tuple)):
            for index, batch in enumerate(batches):
                check_batch(batch, f"{name} batch {index}", model)
                check_labels(batch, f"{name} batch {index}", model, loss_fn)


def check_schedule_layers(
    grow_at: Mapping[int, int | Mapping[int, int]] | None, qk_dims_at: Mapping[int, int | Sequence[int]] | None,
    model: PreTrainedModel,
) -> None:
    """The schedule's layers against the model's, before training (they were found wrong at the growth step)."""
    num_layers = len(get_adapter(model).qk_head_dims(model.config))
    for step, added in (grow_at or {}).items():
        with _naming(f"grow_at[{step}]"):
            resolve_growth(added, num_layers)
    for step, target in (qk_dims_at or {}).items():
        if not isinstance(target, int) and len(target) != num_layers:
            raise ValueError(f"qk_dims_at[{step}] has {len(target)} widths but the model has {num_layers} layers")


@contextlib.contextmanager
def _naming(entry: str) -> Iterator[None]:
    """Errors of a check prefixed with the schedule entry they are about."""
    try:
        yield
    except (TypeError, ValueError) as error:
        raise type(error)(f"{entry}: {error}") from None


#: `GrowthConfig`'s fields: the growth keywords that are options (the others are `grow_in_training`'s own).
_CONFIG_FIELDS = frozenset(option.name for option in dataclasses.fields(GrowthConfig))


def _growth_options(config: GrowthConfig | None, growth_kwargs: Mapping[str, Any]) -> GrowthConfig:
    """``config`` (or a default one) with the growth keywords that are its fields applied."""
    return resolve_config(config, {name: value for name, value in growth_kwargs.items() if name in _CONFIG_FIELDS})


def check_growth_options(mode: str | None, config: GrowthConfig | None, growth_kwargs: Mapping[str, Any],
                          dataloader: Iterable[Any] | None, eval_dataloader: Iterable[Any] | None) -> None:
    """Refuse, when the callback is made, growth options that `grow_in_training` would refuse at the growth step,
    mid-training: unknown names, bad values, the fast search in a mode that cannot take it, fixed batches that are
    none (checked when training begins: under DDP a process's own shard may be empty)."""
    unknown = sorted(set(growth_kwargs) - _CONFIG_FIELDS - set(inspect.signature(grow_in_training).parameters))
    if unknown:
        raise TypeError(f"unknown growth option(s) {unknown}: GrowthConfig's fields or grow_in_training's keywords")
    if growth_kwargs.get("init_std") is not None:
        check_init_std(growth_kwargs["init_std"])
    check_loss_fn(growth_kwargs.get("loss_fn"))
    owned = sorted(set(growth_kwargs) & _SET_BY_THE_CALLBACK)
    if owned:
        raise TypeError(
            f"GrowthCallback sets {owned} itself: the dims added come from the schedule (grow_at or qk_dims_at), the "
            "model, optimizer and accelerator from the Trainer (with several processes pass trainer=trainer), and "
            "the statistics are collected at each growth (pass dataloader= for fixed batches)"
        )
    options = _growth_options(config, growth_kwargs)
    if options.budget is not None:
        raise ValueError("growth in training adds p dims per layer; a budget allocation is grow_model's (budget=None)")
    if options.p is not None:
        raise ValueError(f"the dims added come from the schedule (grow_at or qk_dims_at), not the config's "
                         f"p={options.p!r}: leave p out of the config")
    if (mode or DEFAULT_MODE) in SOLVED_MODES:  # the baselines search no step
        check_fast_search(options.search, mode or DEFAULT_MODE, "the model")
    if options.rotate_factors and mode != "refactor":
        raise ValueError(f"rotate_factors rewrites refactored Q/K factors: pass mode='refactor' with it (mode is "
                         f"{mode or DEFAULT_MODE!r}, which it does not apply to)")


def check_solved_growth(model: PreTrainedModel, mode: str, config: GrowthConfig | None,
                         growth_kwargs: Mapping[str, Any], dataloader: Iterable[Any] | None,
                         eval_dataloader: Iterable[Any] | None, statistics_batches: int) -> None:
    """Refuse, before training, what `grow_in_training` would refuse of a solved growth at the growth step that the
    model and the options show now: a mode the architecture cannot grow by, statistics options that cannot run
    (Triton off CUDA, an offload folder that is not one, a memory budget below one layer's statistics: with the
    halves of cross_fit where `grow_in_training`'s default turns it on), and cross_fit on the one statistics batch
    of each growth (the callback's ``dataloader``, or ``statistics_batches`` drawn at each growth)."""
    adapter = get_adapter(model)
    adapter.check_mode(model, mode)
    options = _growth_options(config, growth_kwargs)
    if config is None:  # grow_in_training's defaults: the batches drawn at each growth (stand-ins) or the caller's
        drawn = dataloader is None
        batches, eval_batches = ([None] * statistics_batches, []) if drawn else (dataloader, eval_dataloader)
        defaults = _in_training_defaults(mode, growth_kwargs, batches, eval_batches, None, None, None)
        options = dataclasses.replace(options, cross_fit=defaults.get("cross_fit", options.cross_fit))
    statistics_batches = statistics_batches if dataloader is None else None
    check_statistics_arguments(
        options.statistics_method, next(model.parameters()).device, options.torch_compute_dtype, options.query_block,
        options.max_batches, options.memory_budget, options.torch_accumulate_dtype, options.offload_dir,
    )
    check_memory_budget(model, adapter, options)
    if statistics_batches is not None and options.max_batches is not None:
        statistics_batches = min(statistics_batches, options.max_batches)
    if options.cross_fit and statistics_batches is not None and statistics_batches < 2:
        raise ValueError(
            f"cross_fit splits each growth's statistics batches into two halves, but it gets {statistics_batches}: "
            "pass statistics_batches=2 or more to GrowthCallback, or cross_fit=False."
        )


#: `grow_in_training`'s arguments that the callback passes itself.
_SET_BY_THE_CALLBACK = frozenset({"model", "optimizer", "dataloader", "p", "accelerator", "statistics"})


def split_counts(available: int, statistics_batches: int, eval_batches: int) -> tuple[int, int]:
    """The statistics and held-out batches that ``available`` batches per process give: those asked for where
    there are enough, else ``available`` shared in their proportion, at least one of each (when any is held out;
    none at all from fewer than two batches)."""
    if available >= statistics_batches + eval_batches or eval_batches == 0:
        return min(available, statistics_batches), eval_batches
    if available < 2:
        return 0, 0  # no statistics batch beside a held-out one: refused by the callers
    held_out = min(available - 1, max(1, round(available * eval_batches / (statistics_batches + eval_batches))))
    return available - held_out, held_out


def check_training_set_size(train_dataloader: DataLoader | None, args, statistics_batches: int,
                             eval_batches: int) -> int:
    """Refuse, before training, a training set too small to draw a growth's batches from; say how a small one is
    shared (a set of known length: an IterableDataset is found short at the growth step). The statistics batches
    each growth gets."""
    dataset = getattr(train_dataloader, "dataset", None)
    if not isinstance(dataset, Sized) or isinstance(dataset, IterableDataset):
        return statistics_batches
    batch_size = args.per_device_train_batch_size
    available = math.ceil(len(dataset) / batch_size) // args.world_size
    statistics, held_out = split_counts(available, statistics_batches, eval_batches)
    if statistics < 1:
        raise ValueError(
            f"the training set gives {available} batch(es) of {batch_size} per process: a growth needs one for the "
            f"statistics{' and one held out' if eval_batches else ''}. Pass dataloader= (and eval_dataloader=) with "
            "batches of your own, or a larger training set."
        )
    if (statistics, held_out) != (statistics_batches, eval_batches):
        logger.warning(
            "the training set gives %d batches of %d per process: each growth uses %d for the statistics and %d held "
            "out (asked: %d and %d).", available, batch_size, statistics, held_out, statistics_batches, eval_batches
        )
    return statistics


def warn_about_training_settings(schedule: Mapping[int, Any], args, state, trainer: Any | None,
                                  growth_kwargs: Mapping[str, Any]) -> None:
    """Warn, before training, about settings under which a growth does not do what the Trainer would."""
    late = sorted(step for step in schedule if step > state.max_steps)
    if late:
        logger.warning("growth steps %s come after the last training step (%d): those growths do not happen "
                       "(the schedule counts optimizer steps, not batches).", late, state.max_steps)
    if args.load_best_model_at_end:
        logger.warning("load_best_model_at_end: checkpoints saved before a growth cannot be loaded into the grown "
                       "model, so the best checkpoint is the best of those saved since the last growth.")
    if "loss_fn" in growth_kwargs:
        return
    custom_loss = False
    if trainer is not None:
        from transformers import Trainer  # imported by the Trainer given

        custom_loss = (type(trainer).compute_loss is not Trainer.compute_loss
                       or getattr(trainer, "compute_loss_func", None) is not None)
    if custom_loss or args.label_smoothing_factor:
        logger.warning("the growths' statistics and line search use the model's own loss (outputs.loss), not the "
                       "Trainer's compute_loss or label smoothing: pass GrowthCallback(..., loss_fn=...) for its loss.")
