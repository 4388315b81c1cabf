"""`GrowthCallback`: growth on a schedule inside `transformers.Trainer` training."""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import logging
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from transformers import PreTrainedModel, TrainerCallback

from ..adapters import get_adapter
from ..config import GrowthConfig
from ..optimizer_state import DEFAULT_NEW_MOMENTS, check_new_moments
from ..report import GrowthReport
from .callback_checks import (check_fixed_batches, check_growth_options, check_resumed_widths, check_schedule,
                              check_schedule_layers, check_schedule_widths, check_solved_growth,
                              check_training_set_size, check_training_setup, split_counts,
                              warn_about_training_settings)
from .grow import GROWTH_MODES, SOLVED_MODES, grow_in_training, model_to_grow, resolved_mode
from .resize import check_growable, torch_optimizers

logger = logging.getLogger("hf_grow")


class GrowthCallback(TrainerCallback):
    """Grow a model's query/key heads during `transformers.Trainer` training, keeping the optimizer.

    At the end of each scheduled optimizer step, draws ``statistics_batches + eval_batches`` batches from the
    training set (with the Trainer's collator and batch size, in an order of its own; the global torch, Python and
    NumPy generators and a collator's own are restored after the draw, so a random collator such as masked LM's
    leaves the training order and masks as they were), collects statistics on the first ones, line-searches the
    step on the held-out rest, and resizes the model in place (`grow_in_training`). Training then continues with the
    same optimizer, step count and LR schedule; checkpoints saved afterwards carry the new ``qk_head_dims``.
    A training set of fewer batches is shared in the same proportion (at least one held out). An
    `IterableDataset` is read from its start at every growth, the k-th growth of the schedule taking the k-th run
    of batches (reading the runs before it). The statistics and the line search use the model's own loss
    (``outputs.loss``), not a Trainer's ``compute_loss`` or label smoothing: pass ``loss_fn`` for another.

    Checkpoints saved before a growth cannot be loaded into the grown model: with ``load_best_model_at_end`` the
    best checkpoint is the best of those saved since the last growth (each growth forgets the Trainer's best).

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
        statistics_batches, eval_batches: batches drawn for the statistics and for the line search. Draw
            enough for the statistics: with the plain M a MiniLM grown from 20 batches of 16 pairs fine-tuned
            worse than the original, from 30 level with it, from 50 better; with the cross-fitted M (the default
            from 2 statistics batches on; 1 gives the plain M) from 20 it was ahead in test loss and level in
            retrieval (BENCHMARKS.md). The default of 8 was not measured that way.
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

    ``reports`` maps each step at which the model grew, in the latest ``train()``, to its `GrowthReport` (None
    for the baselines); a summary also goes to ``state.log_history`` (and so to ``trainer_state.json``), and
    with ``trainer`` to the Trainer's loggers (``report_to``).
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
        check_schedule(grow_at, qk_dims_at)
        if mode is not None and mode not in GROWTH_MODES:
            raise ValueError(f"mode must be one of {GROWTH_MODES}, got {mode!r}")
        check_new_moments(new_moments)
        if statistics_batches < 1 or eval_batches < 1:
            raise ValueError("statistics_batches and eval_batches must be at least 1")
        check_growth_options(mode, config, growth_kwargs, dataloader, eval_dataloader)
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

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        self.reports = {}  # each train() (a second one, model_init, hyperparameter_search) grows on its schedule
        check_training_setup(args, self.trainer)
        model = model_to_grow(model)
        check_resumed_widths(model, state)
        check_growable(model, get_adapter(model), torch_optimizers(optimizer))
        check_schedule_layers(self.grow_at, self.qk_dims_at, model)
        schedule = self.grow_at if self.grow_at is not None else self.qk_dims_at
        mode = resolved_mode(model, self.mode)
        if mode in SOLVED_MODES:
            statistics_batches = self.statistics_batches  # a small training set shares fewer (cross_fit needs two)
            if self.dataloader is None:
                eval_count = 0 if self.eval_dataloader is not None else self.eval_batches
                statistics_batches = check_training_set_size(train_dataloader, args, statistics_batches, eval_count)
            check_solved_growth(model, mode, self.config, self.growth_kwargs, self.dataloader, self.eval_dataloader,
                                 statistics_batches)
            check_schedule_widths(self.grow_at, self.qk_dims_at, model, state.global_step)
        growths_left = sum(step > state.global_step for step in schedule)  # a resumed run skips those done
        check_fixed_batches(model, self.dataloader, self.eval_dataloader, self.growth_kwargs.get("loss_fn"),
                            growths_left, args.world_size, read=mode in SOLVED_MODES)
        warn_about_training_settings(schedule, args, state, self.trainer, self.growth_kwargs)

    def on_step_end(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        schedule = self.grow_at if self.grow_at is not None else self.qk_dims_at
        step = state.global_step
        if step not in schedule:
            return
        model = model_to_grow(model)
        added = self.grow_at[step] if self.grow_at is not None else _dims_to_reach(self.qk_dims_at[step], model)
        if isinstance(added, dict):
            added = {layer: extra for layer, extra in added.items() if extra}
            if not added:
                return
        eval_dataloader = self.eval_dataloader
        batches = self.dataloader
        mode = resolved_mode(model, self.mode)
        if batches is None and mode in SOLVED_MODES:  # the baselines need no data
            eval_count = 0 if self.eval_dataloader is not None else self.eval_batches
            batches, drawn_eval = _draw_batches(train_dataloader, args, self.seed + step, self.statistics_batches,
                                                eval_count, growth_index=sorted(schedule).index(step))
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
        _forget_best_checkpoint(state)
        _log_growth(list(model.config.qk_head_dims), mode, report, args, state, control, self.trainer)


def _log_growth(qk_head_dims: list[int], mode: str, report: GrowthReport | None, args, state, control,
                trainer: Any | None) -> None:
    """Record a growth in ``state.log_history`` (and so ``trainer_state.json``) and, given the Trainer, send its
    numbers to the Trainer's loggers too (``report_to``: TensorBoard, W&B, ...; a callback cannot reach them
    without it)."""
    losses = {} if report is None else dict(growth_eval_loss_before=report.eval_loss_before,
                                            growth_eval_loss_after=report.eval_loss_after)
    state.log_history.append({"step": state.global_step, "growth_mode": mode, "qk_head_dims": qk_head_dims, **losses})
    logger.info("step %d: grew query/key heads to %s (%s)", state.global_step, qk_head_dims, mode)
    if trainer is not None:  # scalars (and the mode as text) that every logger takes
        scalars = {"growth_mode": mode, "growth_qk_head_dim_mean": sum(qk_head_dims) / len(qk_head_dims), **losses}
        should_log = control.should_log  # the handler clears it: the Trainer's own log of this step must stay
        trainer.callback_handler.on_log(args, state, control, scalars)
        control.should_log = should_log


def _dims_to_reach(target: int | Sequence[int], model: PreTrainedModel) -> dict[int, int]:
    """The dims each layer adds to reach ``target`` (a width for every layer, or one per layer)."""
    current = get_adapter(model).qk_head_dims(model.config)
    targets = [target] * len(current) if isinstance(target, int) else list(target)
    return {layer: max(0, want - have) for layer, (want, have) in enumerate(zip(targets, current))}


def _forget_best_checkpoint(state) -> None:
    """Forget the Trainer's best metric and checkpoint after a growth: a checkpoint saved before it cannot be
    loaded into the grown model (``load_best_model_at_end`` would fail at the end of training)."""
    for name in ("best_metric", "best_global_step", "best_model_checkpoint"):
        if getattr(state, name, None) is not None:
            setattr(state, name, None)


@contextlib.contextmanager
def _generators_restored(seed: int, collate_fn: Any) -> Iterator[None]:
    """The global torch (CPU), Python and NumPy generators seeded with ``seed`` inside the block, and they and a
    collator's own generator (``DataCollatorForLanguageModeling(seed=...)``) restored after it: a collator that
    draws from them (masked LM's masking) draws the same in training as without the growth."""
    collator = getattr(collate_fn, "data_collator", collate_fn)  # inside the Trainer's RemoveColumnsCollator
    own = getattr(collator, "generator", None)
    own_state = own.get_state() if isinstance(own, torch.Generator) else copy.deepcopy(own)  # NumPy's, or None
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)
            if isinstance(own, torch.Generator):
                own.set_state(own_state)
                collator.generator = own
            elif hasattr(collator, "generator"):
                collator.generator = own_state  # None: made again at its seed when training next collates


def _draw_batches(
    train_dataloader: DataLoader, args, seed: int, statistics_batches: int, eval_batches: int, growth_index: int
) -> tuple[list, list]:
    """This process's statistics and held-out batches, from the training set through the Trainer's collator,
    in an order of their own (``seed``): every process draws the same batches and takes every world_size-th (as
    many on each; a small training set is shared as `split_counts` says). An IterableDataset, read from its start,
    gives the ``growth_index``-th run of batches (the last ones where it ends sooner), so that each growth of a
    schedule sees batches of its own."""
    count = (statistics_batches + eval_batches) * args.world_size
    dataset, collate_fn = train_dataloader.dataset, train_dataloader.collate_fn
    batch_size = args.per_device_train_batch_size
    generator = torch.Generator().manual_seed(seed)
    if isinstance(dataset, IterableDataset):
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, generator=generator)
    else:
        sampler = RandomSampler(dataset, generator=generator)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, generator=generator)
    skipped = growth_index * count if isinstance(dataset, IterableDataset) else 0
    with _generators_restored(seed, collate_fn):
        drawn = list(collections.deque(itertools.islice(loader, skipped + count), maxlen=count))
    drawn = drawn[: len(drawn) // args.world_size * args.world_size][args.process_index :: args.world_size]
    statistics, held_out = split_counts(len(drawn), statistics_batches, eval_batches)
    if statistics < 1:
        raise ValueError(f"the training set gave {len(drawn)} batch(es) per process: a growth needs one for the "
                         f"statistics{' and one held out' if eval_batches else ''} (pass dataloader=)")
    return drawn[:statistics], drawn[statistics : statistics + held_out]
