"""Steps per layer searched on the held-out batches, and held-out passes that skip the layers a step leaves alone.

Two searches set `GrowthProblem.layer_scales` (each layer's step relative to its per-layer unit):

- ``"layer_search"``: each layer's step line-searched alone (the other layers at step 0), then one multiplier
  of all of them line-searched together (the layers' steps interact: their sum usually overshoots);
- ``"coordinate"``: from the one-t per-layer step, each layer's step refined in turn, first to last, with the
  others fixed at their current steps.

Both keep every layer's step 0 and the multiplier 0 as candidates, so the held-out loss never gets worse.
When only layers >= l change, the blocks before l compute what they computed before: `HeldOutPasses` replays
their recorded outputs per held-out batch, so such an evaluation runs only blocks l.. (and the embeddings and
the head). Costs are counted in evaluations and in full passes over the held-out batches (`HeldOutPasses.passes`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter
from ..statistics import (
    LossFn,
    batch_loss_weight,
    compute_loss,
    iterate_batches,
    module_modes,
    restore_modes,
    without_kv_cache,
)
from .line_search import best_step, evaluate_loss, search_step_size
from .problem import GrowthProblem, QKWeights, write_weights


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")

#: Recorded block outputs are kept on the model's device up to this many bytes (all layers but the last, the
#: held-out batches' hidden states each); beyond it every evaluation is a full pass.
CACHE_BYTES = 2**30


class _Recorded(Exception):
    """Stops a recording pass once the block it records has run."""


def layer_blocks(model: nn.Module, adapter: ArchitectureAdapter) -> list[nn.Module] | None:
    """The model's transformer blocks, one per attention layer in order (the ModuleList that holds each layer's
    attention in its own entry), or None where there is no such list."""
    attentions = adapter.attention_modules(model)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == len(attentions):
            if all(
                any(inner is attention for inner in block.modules()) for block, attention in zip(module, attentions)
            ):
                return list(module)
    return None


class HeldOutPasses:
    """The held-out loss of ``model`` as it now is, with the outputs of unchanged leading blocks replayed.

    `record` keeps block l's outputs (as the model computes them now) per held-out batch; `loss` with
    ``first_changed = l`` replays blocks 0..l-1 from those records. Recording layer l needs blocks 0..l-1
    recorded and unchanged since; the searches below record each layer once its step is fixed.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        adapter: ArchitectureAdapter,
        batches: list[dict[str, Tensor]],
        loss_fn: LossFn | None,
        accelerator: Accelerator | None,
    ):
        self.model, self.adapter, self.batches, self.loss_fn, self.accelerator = (
            model, adapter, batches, loss_fn, accelerator
        )
        self.blocks = layer_blocks(model, adapter)
        self.num_layers = len(adapter.attention_modules(model))
        self.recorded: list[list[Any]] = []
        self.recorded_bytes = 0
        #: Held-out evaluations, and their cost in full passes over the held-out batches.
        self.evaluations = 0
        self.passes = 0.0

    def loss(self, first_changed: int = 0) -> float:
        """The held-out loss, replaying the blocks before ``first_changed`` where they are recorded."""
        replayed = min(first_changed, len(self.recorded))
        with self._replaying(replayed):
            loss = evaluate_loss(self.model, self.batches, self.adapter, self.loss_fn, self.accelerator)[0]
        self.evaluations += 1
        self.passes += (self.num_layers - replayed) / self.num_layers
        return loss

    def loss_recording(self, budget: int | None = None) -> tuple[float, int]:
        """The held-out loss and its weight (`evaluate_loss`) in one full pass that records every block's outputs
        on the way (but the last's, as `record` of each layer in turn would), for the cost of the pass alone. Needs
        nothing recorded yet; records past ``budget`` bytes (default `CACHE_BYTES`) are dropped, as `record` drops
        them."""
        budget = CACHE_BYTES if budget is None else budget
        outputs: list[list[Any]] = [[] for _ in range(self.num_layers - 1)] if self.blocks and not self.recorded else []
        held = [0]

        def keep(module: nn.Module, args: Any, output: Any, kept: list[Any]) -> None:
            held[0] += _bytes(output)
            if held[0] <= budget:
                kept.append(output)

        handles = [block.register_forward_hook(functools.partial(keep, kept=kept))
                   for block, kept in zip(self.blocks or [], outputs)]
        try:
            with _attentions_asked(self.model, self.loss_fn) as asked:
                loss, weight = evaluate_loss(self.model, self.batches, self.adapter, self.loss_fn, self.accelerator)
        finally:
            for handle in handles:
                handle.remove()
        self.evaluations += 1
        self.passes += 1
        if held[0] > budget or asked:
            self._forget(ATTENTIONS_ASKED if asked else f"held-out hidden states exceed {budget} bytes")
        elif outputs:
            self.recorded, self.recorded_bytes = outputs, held[0]
        return loss, weight

    def join_records(self, parts: list[HeldOutPasses | None]) -> None:
        """Take the records of ``parts``, whose batches are this object's one after the other, joined batch by batch:
        what `loss_recording` would have recorded, without its pass. Where a part is None (not recorded) or dropped
        its records, none are kept and every evaluation is a full pass. Needs nothing recorded yet."""
        if any(part is None or part.blocks is None for part in parts):
            self._forget()
        elif all(part.recorded for part in parts):
            self.recorded = [sum(outputs, []) for outputs in zip(*(part.recorded for part in parts))]
            self.recorded_bytes = sum(part.recorded_bytes for part in parts)

    def record(self, layer: int) -> None:
        """Record block ``layer``'s outputs on every held-out batch (blocks before it replayed; the pass stops
        after it). Only the next block in order is recorded, and not the last one (nothing replays it)."""
        if self.blocks is None or layer != len(self.recorded) or layer >= self.num_layers - 1:
            return
        outputs: list[Any] = []
        # The model's own loss runs it once a batch: its pass may stop after the block. A loss_fn may run it more
        # than once (a SentenceTransformer's loss: once per text column), and each call is replayed in turn.
        stops = self.loss_fn is None

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            outputs.append(output)
            if stops:
                raise _Recorded

        handle = self.blocks[layer].register_forward_hook(keep)
        modes = module_modes(self.model)
        self.model.eval()
        try:
            with self._replaying(layer), torch.no_grad(), without_kv_cache(self.model), \
                    _attentions_asked(self.model, self.loss_fn) as asked:
                for batch in iterate_batches(self.batches, self.model):
                    if batch_loss_weight(self.adapter, self.model, batch, self.loss_fn) == 0:
                        continue  # evaluate_loss skips it too: the replayed records stay in step
                    with contextlib.suppress(_Recorded):
                        compute_loss(self.model, batch, self.loss_fn)
        finally:
            handle.remove()
            restore_modes(modes)
        self.passes += (1 if stops else self.num_layers - layer) / self.num_layers
        self.recorded_bytes += sum(_bytes(output) for output in outputs)
        if asked or self.recorded_bytes * (self.num_layers - 1) / (layer + 1) > CACHE_BYTES:
            self._forget(ATTENTIONS_ASKED if asked else f"held-out hidden states exceed {CACHE_BYTES} bytes")
            return
        self.recorded.append(outputs)

    def _forget(self, why: str | None = None) -> None:
        """Drop the records (``why``, logged once): every evaluation a full pass."""
        if why is not None and self.blocks is not None:
            logger.info("%s: every evaluation is a full pass", why)
        self.blocks, self.recorded = None, []

    @contextlib.contextmanager
    def _replaying(self, count: int) -> Iterator[None]:
        """Blocks 0..count-1 return their recorded outputs, one batch per call, instead of computing them."""
        patched = []
        for block, outputs in zip(self.blocks[:count] if count else [], self.recorded):
            replay = iter(outputs)
            patched.append((block, block.__dict__.get("forward")))
            block.forward = lambda *args, _replay=replay, **kwargs: _next_record(_replay)
        try:
            yield
        finally:
            for block, forward in patched:
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward


#: Why replayed passes are dropped for a loss that asks for attentions (`_attentions_asked`).
ATTENTIONS_ASKED = "the loss reads the model's attentions, which replayed blocks do not make"


@contextlib.contextmanager
def _attentions_asked(model: nn.Module, loss_fn: LossFn | None) -> Iterator[list[bool]]:
    """A list that gets an entry where ``loss_fn`` asks the model, or a model inside it, for its attentions
    (``output_attentions``): a replayed block's attention modules never run, so the loss would see fewer. The
    model's own loss reads none. (A loss_fn reading the attention modules with hooks of its own is not seen.)"""
    asked: list[bool] = []

    def watch(module: nn.Module, args: Any, kwargs: dict) -> None:
        if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
            asked.append(True)

    # the model and every model inside it: a loss_fn may call model.transformer(...) or model.forward(...)
    handles = [] if loss_fn is None else [module.register_forward_pre_hook(watch, with_kwargs=True)
                                          for module in model.modules() if isinstance(module, PreTrainedModel)]
    try:
        yield asked
    finally:
        for handle in handles:
            handle.remove()


def _next_record(records: Iterator[Any]) -> Any:
    try:
        return next(records)
    except StopIteration:  # a bare StopIteration would end whatever loop runs the model
        raise RuntimeError(
            "the held-out batches ran the model more times than when their blocks' outputs were recorded: a "
            "loss_fn must run the model the same number of times on a batch each time it is called"
        ) from None


def _bytes(output: Any) -> int:
    if isinstance(output, Tensor):
        return output.numel() * output.element_size()
    if isinstance(output, (tuple, list)):
        return sum(_bytes(item) for item in output)
    return 0


Track = Callable[[str, Callable[[float], float]], Callable[[float], float]]


def search_coordinates(
    problem: GrowthProblem,
    passes: HeldOutPasses,
    adapter: ArchitectureAdapter,
    target: PreTrainedModel,
    step_size: float,
    weights: QKWeights,
    loss: float,
    track: Track,
) -> tuple[QKWeights, float]:
    """Refine each layer's step in turn, first to last, the others fixed, from the weights at ``step_size``
    (held-out ``loss``) in ``target``; returns the chosen weights, left in ``target``, and their held-out loss.

    Per layer, in relative step sizes of that layer: ``step_size`` is known, 0 (the layer unchanged) is tried
    first, then a factor-2 grid from ``step_size`` followed downhill and refined twice; the best is kept (of
    equal losses the smaller step).
    """
    weights = dict(weights)
    for layer in range(len(problem.layers)):
        tried: dict[float, tuple[Tensor, Tensor]] = {}

        def evaluate(step: float, layer: int = layer, tried: dict = tried) -> float:
            problem.layer_scales[layer] = step / step_size
            tried[step] = problem.layer_weights(layer, step_size)
            write_weights(adapter, target, {layer: tried[step]})
            return passes.loss(first_changed=layer)

        losses = search_step_size(
            track(f"layer {layer}", evaluate), step_size, factor=2.0, max_expansions=4, refinements=2,
            known={step_size: loss},
        )
        step = best_step(losses)
        problem.layer_scales[layer], loss = step / step_size, losses[step]
        weights[layer] = tried.get(step, weights[layer])
        write_weights(adapter, target, {layer: weights[layer]})
        passes.record(layer)
    return weights, loss


def search_layers_alone(
    problem: GrowthProblem,
    passes: HeldOutPasses,
    adapter: ArchitectureAdapter,
    target: PreTrainedModel,
    start: float,
    loss_before: float,
    track: Track,
) -> bool:
    """Line-search each layer's step alone (the others at step 0, as ``target`` holds them on entry and exit)
    and keep it as that layer's scale, so that the relative step size t then multiplies all of them; False
    when no layer's step gains alone (step 0 everywhere). ``passes`` may hold the step-0 pass's records
    (`HeldOutPasses.loss_recording`): they are the outputs this search would record, so none is recorded again."""
    problem.layer_scales[:] = [0.0] * len(problem.layers)
    alone = []
    for layer in range(len(problem.layers)):

        def evaluate(step: float, layer: int = layer) -> float:
            problem.layer_scales[layer] = step
            write_weights(adapter, target, {layer: problem.layer_weights(layer, 1.0)})
            return passes.loss(first_changed=layer)

        losses = search_step_size(track(f"layer {layer}", evaluate), start, known={0.0: loss_before})
        alone.append(best_step(losses))
        problem.layer_scales[layer] = 0.0
        write_weights(adapter, target, {layer: problem.layer_weights(layer, 1.0)})
        passes.record(layer)
    problem.layer_scales[:] = alone
    return any(alone)
