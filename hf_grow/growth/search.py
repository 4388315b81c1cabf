"""The line search on the grown model, the chosen weights written into it, and the growth report.

`line_search` searches one solved problem's step on some held-out batches; `write_report` reports the step
chosen; `search_and_report` does both for the prepared problem (`hf_grow.growth.candidates` runs the line search
for each candidate of "auto" options and reports the one kept).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from transformers import PreTrainedModel

from ..progress import progress_bar
from ..report import CandidateReport, GrowthReport, LayerReport, LineSearchPoint
from ..version import __version__
from .head_reports import head_reports, weight_norms
from .layer_steps import HeldOutPasses, search_coordinates, search_layers_alone
from .line_search import best_step, evaluate_loss, search_step_size
from .prepare import PreparedGrowth
from .problem import Decompositions, GrowthProblem, QKWeights, write_weights


logger = logging.getLogger("hf_grow")


@dataclass
class SearchOutcome:
    """The step a line search chose, its weights (left in the target model) and what it cost."""

    step_size: float
    weights: QKWeights
    #: Held-out loss at step 0 (the old function) and at the chosen step; None without held-out batches.
    loss_before: float | None
    loss_after: float | None
    eval_weight: int
    unconstrained_loss: float | None = None
    points: list[LineSearchPoint] = field(default_factory=list)
    #: Full passes over the searched held-out batches after the one at step 0 (None without them).
    passes: float | None = None
    #: The held-out passes of the old function (step 0), every block's outputs recorded in the pass that measured
    #: ``loss_before``: the realized gains replay them (None without held-out batches or ``record_step_zero``).
    step_zero: HeldOutPasses | None = None
    #: Each layer's decomposition at the chosen step (`GrowthProblem.layer_weights`), where the search made it: the
    #: report reads them instead of decomposing again.
    decompositions: Decompositions = field(default_factory=dict)
    #: Each layer's step relative to the others at the chosen step (`GrowthProblem.layer_scales`), which the
    #: searches per layer set: the chosen weights are made with them.
    layer_scales: list[float] = field(default_factory=list)
    #: The searched step, where ``step_size`` is ``config.step_scale`` of it (`take_step_scale`).
    searched_step_size: float | None = None


@dataclass
class KnownPart:
    """The losses of some steps of the problem being searched, known on a part of the held-out batches (a
    candidate's search batches, evaluated with the same weights by its search): at those steps a search on all
    the batches evaluates only the ``rest`` and combines the two (`evaluate_loss`'s mean, weight by weight)."""

    losses: dict[float, float]
    rest: list[dict[str, Tensor]]
    combine: Callable[[float, float], float]
    #: What a pass over ``rest`` costs in full passes over all the held-out batches.
    share: float

    def loss_at(self, step: float) -> float | None:
        """The known part's loss at ``step`` (a step computed another way, equal to roundoff, counts), or None."""
        return next((loss for known, loss in self.losses.items() if math.isclose(known, step, rel_tol=1e-12)), None)


def search_and_report(
    prepared: PreparedGrowth,
    target: PreTrainedModel,
    *,
    measure_realized_gains: bool,
    progress: bool,
    started: float,
) -> GrowthReport:
    """Line-search the prepared problem's step on ``target`` (a model of the grown widths), leave the chosen
    weights in it, report. ``target`` computes the old function on entry (the step-0 weights)."""
    tick = time.perf_counter()
    outcome = line_search(
        prepared, prepared.problem, target, prepared.eval_batches, progress=progress,
        record_step_zero=measure_realized_gains,
    )
    outcome = take_step_scale(prepared, prepared.problem, target, outcome, prepared.eval_batches)
    prepared.seconds["line_search"] = time.perf_counter() - tick
    return write_report(
        prepared, prepared.problem, target, outcome, prepared.eval_batches,
        measure_realized_gains=measure_realized_gains, progress=progress, started=started,
    )


def line_search(
    prepared: PreparedGrowth,
    problem: GrowthProblem,
    target: PreTrainedModel,
    eval_batches: list[dict[str, Tensor]] | None,
    *,
    progress: bool,
    near: float | None = None,
    grid: tuple[float, int] | None = None,
    known: dict[float, float] | None = None,
    record_step_zero: bool = False,
    before: tuple[float, int] | None = None,
    recorded: HeldOutPasses | None = None,
    near_loss: float | None = None,
    known_part: KnownPart | None = None,
) -> SearchOutcome:
    """Search ``problem``'s step on ``eval_batches`` (or take the config's ``step_size``) in ``target``, which
    computes the old function on entry; on exit it holds the chosen step's weights. ``near``: a step already
    searched on some of the batches, from which a shorter search starts. ``grid``: the factor and the refinements
    of the search (`search_step_size`) from ``near`` or, in the steps' own search (step modes but those searched
    per layer), from the start; None: factor 2 refined twice, factor 4 refined four times. ``known``: for those
    searches, losses on ``eval_batches`` known at some steps (from a search of the same problem), not evaluated.
    ``record_step_zero``: keep every block's outputs from the step-0 pass (``SearchOutcome.step_zero``) for the
    realized gains to replay; only where they will be measured, since the records hold up to `CACHE_BYTES`.
    ``before``: the held-out loss and weight (`evaluate_loss`) of the old function on ``eval_batches``, known
    already (the candidates of "auto" options share it), so that it is not evaluated again; ``recorded``: with
    ``before``, the passes over ``eval_batches`` whose records of every block's outputs at step 0 were made with it
    (`HeldOutPasses.join_records`), taken instead of a recording pass; ``near_loss``:
    likewise the loss at ``near``; ``known_part``: losses known on part of ``eval_batches`` at some steps, where
    only the rest is evaluated."""
    search = _StepSearch(prepared, problem, target, eval_batches, known_part)
    loss_before, eval_weight, step_zero = search.step_zero(record_step_zero, before, recorded)
    measured = search.passes_done()  # the step-0 pass: the search's cost starts after it
    step_size, loss_after = prepared.config.step_size, None
    chosen: QKWeights | None = None
    unconstrained_loss = None
    if loss_before is not None:  # a given step too: reported, it would be NaN
        check_loss_before(loss_before, prepared, target, eval_batches)
    if step_size is None and not problem.has_gradient:  # said once, by `prepare_growth`
        step_size, loss_after = 0.0, loss_before
    if step_size is None:
        with progress_bar(desc="line search", unit="eval", enabled=progress) as bar:
            search.bar = bar
            losses, unconstrained_loss = search.losses(near, grid, dict(known or {}), near_loss)
            half = next(target.parameters()).dtype in (torch.float16, torch.bfloat16)
            step_size = best_step(losses, confirmed=half)
            loss_after = loss_before if step_size == 0 else losses[step_size]
            if problem.step_mode == "coordinate" and step_size > 0:
                chosen, loss_after = search.refine_each_layer(step_size, loss_after)
            bar.set_postfix(chosen_step=f"{step_size:.4g}", loss=f"{loss_after:.4f}")  # not the last step tried
    decompositions: Decompositions = {}
    if chosen is None:
        decompositions = search.decompositions_at(step_size)
        chosen = problem.weights(step_size, decompositions)
    write_weights(prepared.adapter, target, chosen)
    if eval_batches is not None and loss_after is None:
        loss_after = search.loss(target)
    return SearchOutcome(
        step_size, chosen, loss_before, loss_after, eval_weight, unconstrained_loss, search.points,
        None if measured is None else search.passes_done() - measured + search.extra_passes, step_zero, decompositions,
        list(problem.layer_scales),
    )


def check_loss_before(
    loss: float, prepared: PreparedGrowth, target: PreTrainedModel, batches: list[dict[str, Tensor]]
) -> None:
    """Refuse a held-out loss of the old function that is not finite, naming the first held-out batch whose loss is
    not (one process: with several, each would have to evaluate the same number of batches)."""
    if math.isfinite(loss):
        return
    where = ""
    if prepared.accelerator is None or prepared.accelerator.num_processes == 1:
        for index, batch in enumerate(batches):
            try:
                batch_loss = evaluate_loss(target, [batch], prepared.adapter, prepared.loss_fn)[0]
            except ValueError:  # no loss terms
                continue
            if not math.isfinite(batch_loss):
                where = f" ({batch_loss} on held-out batch {index} first)"
                break
    raise FloatingPointError(
        f"the held-out loss is {loss} before any step{where}: growth needs a finite loss. Check the held-out "
        "data, or load the model in a wider dtype (float16 overflows most easily)."
    )


class _StepSearch:
    """The evaluations of one line search: the held-out loss of ``target`` at a step of ``problem``, the points
    searched (shown on ``bar``, a progress bar), and the decompositions of the best step evaluated, from which its
    weights are made again (the bases' products alone, bit for bit) and which the report reads, not decomposing."""

    def __init__(
        self,
        prepared: PreparedGrowth,
        problem: GrowthProblem,
        target: PreTrainedModel,
        eval_batches: list[dict[str, Tensor]] | None,
        known_part: KnownPart | None,
    ):
        self.prepared, self.problem, self.target = prepared, problem, target
        self.eval_batches, self.known_part = eval_batches, known_part
        self.passes = None if eval_batches is None else self._new_passes()
        self.points: list[LineSearchPoint] = []
        self.extra_passes = 0.0  # not counted by ``passes``: on another object, or before the search's count starts
        self.loss_before: float | None = None
        self.bar: Any = None
        self._best: dict[str, Any] = {}  # loss, step and decompositions of the best step evaluated

    def _new_passes(self) -> HeldOutPasses:
        prepared = self.prepared
        return HeldOutPasses(self.target, prepared.adapter, self.eval_batches, prepared.loss_fn, prepared.accelerator)

    def passes_done(self) -> float | None:
        return None if self.passes is None else self.passes.passes

    def _evaluate_loss(self, model: PreTrainedModel, batches: list[dict[str, Tensor]]) -> tuple[float, int]:
        return evaluate_loss(model, batches, self.prepared.adapter, self.prepared.loss_fn, self.prepared.accelerator)

    def loss(self, candidate: PreTrainedModel) -> float:
        """The held-out loss of ``candidate``: the target as it now is, or another model (a full pass)."""
        if candidate is self.target:
            return self.passes.loss()
        self.extra_passes += 1  # the unconstrained reference's
        return self._evaluate_loss(candidate, self.eval_batches)[0]

    def step_zero(
        self, record: bool, before: tuple[float, int] | None, recorded: HeldOutPasses | None
    ) -> tuple[float | None, int, HeldOutPasses | None]:
        """The old function's held-out loss and weight (given as ``before``, or measured), and the passes that
        recorded every block's outputs while measuring it (given as ``recorded`` with ``before``, or made now), where
        ``record`` asks for them."""
        problem, step_size = self.problem, self.prepared.config.step_size
        if self.eval_batches is None:
            return None, 0, None
        # The pass at step 0 records every block where something replays them: the realized gains, and the search of
        # each layer alone (the other layers at step 0), from the same object; the coordinate search on its own.
        step_zero, coordinate = None, problem.step_mode == "coordinate"
        if record or (problem.step_mode == "layer_search" and step_size is None):
            if recorded is None:
                recorded = self._new_passes() if coordinate else self.passes
                measured = recorded.loss_recording()
                self.extra_passes += before is not None  # a pass for its records alone: a cost of the search
                before = before or measured
            if not coordinate:
                self.passes = recorded
            step_zero = recorded if record else None
        elif before is None:
            before = self._evaluate_loss(self.target, self.eval_batches)
        self.loss_before = before[0]
        return before[0], before[1], step_zero

    def loss_at_step(self, step: float) -> float:
        """The held-out loss of the problem's weights at ``step``, written into the target (only the batches
        outside ``known_part`` evaluated where it knows the rest)."""
        decompositions: Decompositions = {}
        write_weights(self.prepared.adapter, self.target, self.problem.weights(step, decompositions))
        part = None if self.known_part is None else self.known_part.loss_at(step)
        if part is None:
            loss = self.loss(self.target)
        else:
            rest = self._evaluate_loss(self.target, self.known_part.rest)[0]
            loss = self.known_part.combine(part, rest)
            self.passes.passes += self.known_part.share
        if not self._best or loss < self._best["loss"]:
            self._best.update(loss=loss, step=step, decompositions=decompositions)
        return loss

    def decompositions_at(self, step: float) -> Decompositions:
        """The decompositions made at ``step`` if it is the best step evaluated (else none)."""
        return self._best["decompositions"] if self._best.get("step") == step else {}

    def tracked(self, kind: str, evaluate_at: Callable[[float], float]) -> Callable[[float], float]:
        """``evaluate_at``, each step recorded as a point of ``kind`` and shown on the bar. Step 0 of the whole
        model ("rank") is the old function; of one layer ("layer l") it is not."""
        def run(step: float) -> float:
            loss = self.loss_before if step == 0 and kind == "rank" else evaluate_at(step)
            self.points.append(LineSearchPoint(step, loss if math.isfinite(loss) else None, kind))
            self.bar.update()
            self.bar.set_postfix(step=f"{step:.3g}", loss=f"{loss:.4f}")
            return loss

        return run

    def losses(
        self, near: float | None, grid: tuple[float, int] | None, known: dict[float, float], near_loss: float | None
    ) -> tuple[dict[float, float], float | None]:
        """The held-out loss at every step searched, by the search the arguments and the step mode ask for (see
        `line_search`), and the best loss of the unconstrained reference (``search="fast"`` only)."""
        problem, config = self.problem, self.prepared.config
        start = config.initial_step_size
        if near and near_loss is not None:
            known[near] = near_loss
        self.points += [
            LineSearchPoint(step, loss if math.isfinite(loss) else None, "rank") for step, loss in known.items()
        ]
        by_rank = self.tracked("rank", self.loss_at_step)
        if near:
            factor, refinements = grid or (2.0, 2)
            return search_step_size(by_rank, near, factor=factor, refinements=refinements, known=known), None
        if problem.step_mode == "layer_search":
            gains = search_layers_alone(
                problem, self.passes, self.prepared.adapter, self.target, start, self.loss_before, self.tracked
            )
            # each layer at its own best step alone, then one multiplier t of all of them
            return (search_step_size(by_rank, 1.0, factor=2.0) if gains else {0.0: 0.0}), None
        if config.search == "fast":  # bracketed by the full-rank update Z - lam P (nothing to decompose), then a
            # finer, shorter search of the truncated one near it, where the rank-constrained optimum sits
            unconstrained = self._unconstrained_losses(start)
            bracketed = best_step(unconstrained)
            return search_step_size(by_rank, bracketed or start, factor=2.0, refinements=2), unconstrained[bracketed]
        factor, refinements = grid or (4.0, 4)
        return search_step_size(by_rank, start, factor=factor, refinements=refinements, known=known), None

    def _unconstrained_losses(self, start: float) -> dict[float, float]:
        """The held-out losses of the full-rank update's search, in a reference model freed on return."""
        problem, adapter = self.problem, self.prepared.adapter
        full_rank = [part.target.width for part in problem.layers]
        scale_dims = problem.attention_scale_dims(full_rank)
        scalings = [adapter.scaling(self.prepared.model.config, layer, dim) for layer, dim in enumerate(scale_dims)]
        at_zero = unconstrained_weights(problem, 0.0, scalings)
        reference = adapter.build_grown_model(self.target, full_rank, at_zero, scale_dims)

        def evaluate_unconstrained(step: float) -> float:
            write_weights(adapter, reference, unconstrained_weights(problem, step, scalings))
            return self.loss(reference)

        return search_step_size(self.tracked("unconstrained", evaluate_unconstrained), start)

    def refine_each_layer(self, step_size: float, loss: float) -> tuple[QKWeights, float]:
        """``step_mode="coordinate"``: from ``step_size`` (held-out ``loss``), each layer's step refined in turn;
        the chosen weights are of no one step the search decomposed."""
        searched = self.problem.weights(step_size, self.decompositions_at(step_size))
        write_weights(self.prepared.adapter, self.target, searched)
        return search_coordinates(
            self.problem, self.passes, self.prepared.adapter, self.target, step_size, searched, loss, self.tracked
        )


def take_step_scale(
    prepared: PreparedGrowth,
    problem: GrowthProblem,
    target: PreTrainedModel,
    outcome: SearchOutcome,
    eval_batches: list[dict[str, Tensor]] | None,
) -> SearchOutcome:
    """``outcome`` at ``config.step_scale`` of its searched step (unchanged at 1, or at step 0): those weights
    written into ``target`` and their held-out loss, one more pass. A step shrunk toward the old function
    gives up part of the one-shot gain for training after growth that overfits (BENCHMARKS.md, issue #35).
    Where that step's held-out loss is above the old function's (the loss need not be convex along the line), step
    0 is taken: growth never leaves the held-out loss worse."""
    scale = prepared.config.step_scale
    if scale == 1 or outcome.step_size == 0:
        return outcome
    step, decompositions = scale * outcome.step_size, {}
    weights = problem.weights(step, decompositions)
    write_weights(prepared.adapter, target, weights)
    loss_after, passes = outcome.loss_after, outcome.passes
    if eval_batches is not None:
        loss_after = evaluate_loss(target, eval_batches, prepared.adapter, prepared.loss_fn, prepared.accelerator)[0]
        passes = None if passes is None else passes + 1
        if not loss_after <= outcome.loss_before:  # NaN too
            step, decompositions = 0.0, {}
            weights = problem.weights(step, decompositions)
            write_weights(prepared.adapter, target, weights)
            loss_after = outcome.loss_before
    return dataclasses.replace(
        outcome, step_size=step, weights=weights, loss_after=loss_after, passes=passes,
        decompositions=decompositions, searched_step_size=outcome.step_size,
    )


def unconstrained_weights(problem: GrowthProblem, step_size: float, scalings: list[float]) -> QKWeights:
    """Weights computing ``Z - lam P`` on the compact subspaces without truncation (rank k = d_k + s, all of
    Z - lam P where those are everything): queries ``L core(lam) / scaling``, keys ``R``; the reference of
    ``search="fast"``."""
    def layer_weights(layer: int) -> tuple[Tensor, Tensor]:
        target = problem.layers[layer].target
        core = target.core(problem.head_lams(step_size, layer))
        left, right = target.bases(core.dtype)
        return left @ core / scalings[layer], right.clone()

    with torch.no_grad():
        return {layer: problem.owner_computes(layer, lambda: layer_weights(layer)) for layer in range(len(scalings))}


def write_report(
    prepared: PreparedGrowth,
    problem: GrowthProblem,
    target: PreTrainedModel,
    outcome: SearchOutcome,
    eval_batches: list[dict[str, Tensor]] | None,
    *,
    measure_realized_gains: bool,
    progress: bool,
    started: float,
    candidates: list[CandidateReport] | None = None,
    selection: str | None = None,
    selection_margin: float | None = None,
) -> GrowthReport:
    """The growth report of ``outcome`` (``problem``'s step, whose weights ``target`` holds), with each layer's
    realized gain on ``eval_batches`` (against ``outcome.loss_before``, their loss at step 0) when measured."""
    model, adapter, config, seconds = prepared.model, prepared.adapter, prepared.config, prepared.seconds
    qk_after, step_size, loss_before = prepared.qk_after, outcome.step_size, outcome.loss_before
    tick = time.perf_counter()
    realized: list[float | None] = [None] * len(qk_after)
    if measure_realized_gains and eval_batches is not None and step_size > 0:
        unchanged, stepped = problem.weights(0.0), outcome.weights
        write_weights(adapter, target, unchanged)
        # Layer l's step alone leaves blocks 0..l-1 at step 0: their outputs, recorded when the line search measured
        # the loss at step 0, are replayed, so the passes cost about half of one full held-out pass per layer.
        passes = outcome.step_zero
        if passes is None or passes.batches is not eval_batches:
            passes = HeldOutPasses(target, adapter, eval_batches, prepared.loss_fn, prepared.accelerator)
        for layer in progress_bar(range(len(qk_after)), desc="realized gains", unit="layer", enabled=progress):
            write_weights(adapter, target, {layer: stepped[layer]})
            realized[layer] = loss_before - passes.loss(first_changed=layer)
            write_weights(adapter, target, {layer: unchanged[layer]})
            passes.record(layer)
        write_weights(adapter, target, stepped)
    layers = []
    for layer in range(len(problem.layers)):
        heads = head_reports(problem, layer, step_size, outcome.decompositions.get(layer))
        heads = [dataclasses.replace(head, weight_norm_after=after)  # from the weights written, on every process
                 for head, after in zip(heads, weight_norms(adapter, target, layer).tolist())]
        layers.append(
            LayerReport(
                layer=layer,
                qk_dim_before=prepared.qk_before[layer],
                qk_dim_after=qk_after[layer],
                expected_gain=sum(head.expected_gain for head in heads),
                realized_gain=realized[layer],
                heads=heads,
                lam=problem.lam(step_size, layer),
            )
        )
    seconds["report"] = time.perf_counter() - tick
    seconds["total"] = time.perf_counter() - started

    report = GrowthReport(
        model_class=type(model).__name__,
        model_type=model.config.model_type,
        model_loss=prepared.loss_fn is None,
        truncation=problem.truncation,
        search=config.search,
        solver="+".join(sorted(problem.methods_used)) or problem.solver,
        mode=problem.mode,
        step_size=step_size,
        lam=math.hypot(*(layer.lam for layer in layers)) / math.sqrt(len(layers)),  # no overflow of a huge lam
        eval_loss_before=loss_before,
        eval_loss_after=outcome.loss_after,
        unconstrained_eval_loss=outcome.unconstrained_loss,
        statistics_tokens=prepared.statistics.num_tokens,
        statistics_batches=prepared.statistics.num_batches,
        statistics_method=prepared.statistics.method,
        eval_weight=outcome.eval_weight,
        parameters_before=prepared.parameters_before,
        parameters_after=target.num_parameters(),
        seconds=seconds,
        line_search=outcome.points,
        layers=layers,
        budget=config.budget,
        step_mode=problem.step_mode,
        line_search_passes=outcome.passes,
        config=config.with_default_p().to_dict(),
        candidates=candidates or [],
        selection=selection,
        selection_margin=selection_margin,
        cross_fit=problem.cross_fit,
        searched_step_size=outcome.searched_step_size,
        hf_grow_version=__version__,
    )
    logger.info("grew %s: %s", type(model).__name__, report.summary())
    return report
