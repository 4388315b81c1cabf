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
from .head_reports import head_reports
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
    already (the candidates of "auto" options share it), so that it is not evaluated again; ``near_loss``:
    likewise the loss at ``near``; ``known_part``: losses known on part of ``eval_batches`` at some steps, where
    only the rest is evaluated."""
    model, adapter = prepared.model, prepared.adapter
    accelerator = prepared.accelerator
    config, loss_fn, step_size = prepared.config, prepared.loss_fn, prepared.config.step_size

    passes = None if eval_batches is None else HeldOutPasses(target, adapter, eval_batches, loss_fn, accelerator)

    def evaluate(candidate: PreTrainedModel) -> float:
        if candidate is target:
            return passes.loss()
        return evaluate_loss(candidate, eval_batches, adapter, loss_fn, accelerator)[0]

    # The best step's decompositions as evaluated: its weights are made from them again (the bases' products
    # alone, bit for bit the same), and the report reads them instead of decomposing the chosen step once more.
    evaluated: dict[str, Any] = {}

    def evaluate_step(step: float) -> float:
        decompositions: Decompositions = {}
        write_weights(adapter, target, problem.weights(step, decompositions))
        part = None if known_part is None else known_part.loss_at(step)
        if part is None:
            loss = evaluate(target)
        else:
            rest = evaluate_loss(target, known_part.rest, adapter, loss_fn, accelerator)[0]
            loss = known_part.combine(part, rest)
            passes.passes += known_part.share
        if not evaluated or loss < evaluated["loss"]:
            evaluated.update(loss=loss, step=step, decompositions=decompositions)
        return loss

    def evaluated_at(step: float) -> Decompositions:
        return evaluated["decompositions"] if evaluated.get("step") == step else {}

    points: list[LineSearchPoint] = []
    chosen: QKWeights | None = None
    decompositions: Decompositions = {}
    unconstrained_loss = None
    eval_weight = 0
    loss_before = loss_after = step_zero = None
    # The pass at step 0 records every block where something replays them: the realized gains, and the search of
    # each layer alone, which replays the same outputs (the other layers stay at step 0) from the same object. The
    # coordinate search records each layer's chosen step instead: its own object.
    alone = problem.step_mode == "layer_search" and step_size is None
    if eval_batches is not None and (record_step_zero or alone):
        recording = passes
        if problem.step_mode == "coordinate":
            recording = HeldOutPasses(target, adapter, eval_batches, loss_fn, accelerator)
        loss_before, eval_weight = recording.loss_recording()
        step_zero = recording if record_step_zero else None
    elif eval_batches is not None and before is not None:
        loss_before, eval_weight = before
    elif eval_batches is not None:
        loss_before, eval_weight = evaluate_loss(target, eval_batches, adapter, loss_fn, accelerator)
    measured = 0.0 if passes is None else passes.passes  # the step-0 pass: the search's cost starts after it
    if step_size is None and not math.isfinite(loss_before):
        raise FloatingPointError(
            f"the held-out loss is {loss_before} before any step: the line search needs a finite loss. Check the "
            "held-out data, or load the model in a wider dtype (float16 overflows most easily)."
        )
    if step_size is None and not problem.has_gradient:
        logger.warning("the loss has zero gradient with respect to every head's scores: nothing to gain, step 0.")
        step_size, loss_after = 0.0, loss_before
    if step_size is None:
        with progress_bar(desc="line search", unit="eval", enabled=progress) as bar:

            def tracked(kind: str, evaluate_at: Callable[[float], float]) -> Callable[[float], float]:
                def run(step: float) -> float:
                    # step 0 of the whole model is the old function; of one layer ("layer l") it is not
                    loss = loss_before if step == 0 and kind == "rank" else evaluate_at(step)
                    points.append(LineSearchPoint(step, loss if math.isfinite(loss) else None, kind))
                    bar.update()
                    bar.set_postfix(step=f"{step:.3g}", loss=f"{loss:.4f}")
                    return loss

                return run

            start = config.initial_step_size
            known = dict(known or {})
            if near and near_loss is not None:
                known[near] = near_loss
            points += [
                LineSearchPoint(step, loss if math.isfinite(loss) else None, "rank") for step, loss in known.items()
            ]
            if near:
                factor, refinements = grid or (2.0, 2)
                losses = search_step_size(
                    tracked("rank", evaluate_step), near, factor=factor, refinements=refinements, known=known
                )
            elif problem.step_mode == "layer_search":
                gains = search_layers_alone(problem, passes, adapter, target, start, loss_before, tracked)
                # each layer at its own best step alone, then one multiplier t of all of them
                losses = search_step_size(tracked("rank", evaluate_step), 1.0, factor=2.0) if gains else {0.0: 0.0}
            elif config.search == "fast":
                full_rank = [part.target.width for part in problem.layers]
                scale_dims = problem.attention_scale_dims(full_rank)
                scalings = [adapter.scaling(model.config, layer, dim) for layer, dim in enumerate(scale_dims)]
                reference = adapter.build_grown_model(
                    target, full_rank, unconstrained_weights(problem, 0.0, scalings), scale_dims
                )

                def evaluate_unconstrained(step: float) -> float:
                    write_weights(adapter, reference, unconstrained_weights(problem, step, scalings))
                    return evaluate(reference)

                unconstrained = search_step_size(tracked("unconstrained", evaluate_unconstrained), start)
                bracketed = best_step(unconstrained)
                unconstrained_loss = unconstrained[bracketed]
                del reference
                # The rank-constrained optimum sits near the unconstrained one: a finer, shorter search.
                losses = search_step_size(tracked("rank", evaluate_step), bracketed or start, factor=2.0, refinements=2)
            else:
                factor, refinements = grid or (4.0, 4)
                losses = search_step_size(
                    tracked("rank", evaluate_step), start, factor=factor, refinements=refinements, known=known
                )
            step_size = best_step(losses)
            loss_after = loss_before if step_size == 0 else losses[step_size]
            if problem.step_mode == "coordinate" and step_size > 0:
                searched = problem.weights(step_size, evaluated_at(step_size))
                write_weights(adapter, target, searched)
                # each layer's step refined in turn: the chosen weights are of no one step the search decomposed
                chosen, loss_after = search_coordinates(
                    problem, passes, adapter, target, step_size, searched, loss_after, tracked
                )
    if chosen is None:
        decompositions = evaluated_at(step_size)
        chosen = problem.weights(step_size, decompositions)
    write_weights(adapter, target, chosen)
    if eval_batches is not None and loss_after is None:
        loss_after = evaluate(target)
    return SearchOutcome(
        step_size, chosen, loss_before, loss_after, eval_weight, unconstrained_loss, points,
        None if passes is None else passes.passes - measured, step_zero, decompositions, list(problem.layer_scales),
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
    gives up part of the one-shot gain for training after growth that overfits (BENCHMARKS.md, issue #35)."""
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
        truncation=problem.truncation,
        search=config.search,
        solver="+".join(sorted(problem.methods_used)) or problem.solver,
        mode=problem.mode,
        step_size=step_size,
        lam=math.sqrt(sum(layer.lam**2 for layer in layers) / len(layers)),
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
        config=config.to_dict(),
        candidates=candidates or [],
        selection=selection,
        selection_margin=selection_margin,
        cross_fit=problem.cross_fit,
        searched_step_size=outcome.searched_step_size,
    )
    logger.info("grew %s: %s", type(model).__name__, report.summary())
    return report
