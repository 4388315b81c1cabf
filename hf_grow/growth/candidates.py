"""The candidates of "auto" options chosen by held-out loss, the choice confirmed on batches the search never saw.

With ``truncation="auto"`` and/or ``step_mode="auto"`` (`GrowthConfig.candidates`), each (truncation, step
mode) candidate is line-searched on the first part of the held-out batches. The one of least loss there is
kept only if it also beats the simplest candidate (the first: whitened truncation, steps per head) on the rest,
the confirmation batches (``confirm_fraction`` of them). Otherwise the simplest is kept: with few held-out
batches, the search's best can fit their noise (BENCHMARKS: the per-layer searches on MiniLM's 8 batches).
The kept candidate's step is then searched again on all the held-out batches, from the step found on part of
them: a step searched on fewer batches is noisier.

Cost: one line search per truncation on the search batches, a shorter one for each other candidate (from the
step its truncation's first candidate found: per head or per layer, the step sizes are alike), one pass over the
confirmation batches per candidate, and a shorter line search on all the batches (from the kept step, whose loss
there is known from its search and confirmation; by sqrt(2), steps whose loss on the search batches the kept
candidate's search mostly knows already: there only the confirmation batches are evaluated, `search.KnownPart`).
The old function (step 0) is the same for every candidate: its loss on each held-out batch is evaluated once
(`OldFunction`), unless the realized gains need the final search's step-0 pass to record the blocks' outputs.
The statistics and the solve are shared: one solve holds both truncations' targets ("refactor") or unit updates
("append") (`GrowthProblem.holds`), so M is freed group by group as for one candidate, and truncations and step
modes are switched without solving again.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..distributed import Processes
from ..report import CandidateReport, GrowthReport
from . import search
from .line_search import evaluate_loss, held_out_count
from .prepare import PreparedGrowth
from .problem import GrowthProblem, write_weights


logger = logging.getLogger("hf_grow")
Batches = list[dict[str, Tensor]]


def search_and_report(
    prepared: PreparedGrowth,
    target: PreTrainedModel,
    *,
    measure_realized_gains: bool,
    progress: bool,
    started: float,
) -> GrowthReport:
    """`search.search_and_report` for the config's one candidate; with "auto" options, the candidate chosen by
    held-out loss and confirmed (module docstring). ``target`` computes the old function on entry."""
    config = prepared.config
    reporting = dict(measure_realized_gains=measure_realized_gains, progress=progress, started=started)
    if len(config.candidates) == 1:
        return search.search_and_report(prepared, target, **reporting)
    parts = confirmation_split(prepared.eval_batches, config.confirm_fraction, config.step_size is None)
    processes = Processes(prepared.accelerator)
    if processes.world_size > 1:  # every process must take the same branch: none searches if one cannot
        cannot = torch.tensor(float(parts is None), device=next(prepared.model.parameters()).device)
        parts = None if processes.sum_(cannot).item() > 0 else parts
    if parts is None:  # nothing to choose by: a given step size, or one held-out batch
        report = search.search_and_report(prepared, target, **reporting)
        report.selection = "simplest"
        report.candidates = [CandidateReport(report.truncation, report.step_mode, report.step_size, None, None)]
        return report
    tick = time.perf_counter()
    old = OldFunction(prepared, target, *parts)
    (kept, searched, passes), reports, selection, margin = _choose(prepared, target, old, progress=progress)
    problem = prepared.problem
    problem.set_truncation(kept.truncation)  # a problem shared by the candidates holds the last one's settings
    problem.set_step_mode(kept.step_mode)  # the report's steps per layer and head are the chosen mode's
    if kept.step_mode == "layer_search":  # its step multiplies the layers' own, found by its search: keep them
        problem.layer_scales[:] = searched.layer_scales
    # The kept candidate's step, searched again on every held-out batch (those of the confirmation too), from the
    # step its search found (from the start where that was 0): with few batches, a step searched on part of them
    # is noisier (BENCHMARKS: MiniLM). Its losses at step 0 and at that step are known on both parts (at step 0
    # the old function's, unless the pass must record the blocks' outputs for the realized gains). It walks by
    # sqrt(2) and refines once (to the resolution of factor 2 refined twice): a search of the candidate's own
    # refined to sqrt(2) around its best, so at those steps only the confirmation batches are evaluated.
    write_weights(prepared.adapter, target, old.weights)
    outcome = search.line_search(
        prepared, problem, target, prepared.eval_batches, progress=progress, near=searched.step_size,
        near_grid=(math.sqrt(2.0), 1), record_step_zero=measure_realized_gains,
        before=None if measure_realized_gains else old.on_all(),
        near_loss=old.combined(kept.search_loss, kept.confirm_loss), known_part=old.known_part(searched),
    )
    # every pass but the one at step 0 over all the held-out batches that any growth makes
    outcome.passes += passes + old.passes + measure_realized_gains - 1
    prepared.seconds["line_search"] = time.perf_counter() - tick
    return search.write_report(
        prepared, problem, target, outcome, prepared.eval_batches, **reporting,
        candidates=reports, selection=selection, selection_margin=margin,
    )


def confirmation_split(
    batches: Batches | None, fraction: float, searched: bool
) -> tuple[Batches, Batches] | None:
    """The held-out batches for the search and the last ``fraction`` of them (at least one) for confirmation;
    None when no choice can be made: a step size was given (not ``searched``), or fewer than 2 batches."""
    if not searched or batches is None or len(batches) < 2:
        return None
    count = min(held_out_count(len(batches), fraction), len(batches) - 1)
    return batches[:-count], batches[-count:]


class OldFunction:
    """The held-out loss of the old function (step 0: the same for every candidate) on the search and on the
    confirmation batches, each evaluated once, when first needed."""

    def __init__(
        self, prepared: PreparedGrowth, target: PreTrainedModel, search_batches: Batches, confirm_batches: Batches
    ):
        self.prepared, self.target = prepared, target
        self.batches = {"search": search_batches, "confirm": confirm_batches}
        self.weights = prepared.problem.weights(0.0)  # the old function at the grown widths, whatever the candidate
        self.losses: dict[str, tuple[float, int]] = {}
        #: Each part's loss weight (`evaluate_loss`), whatever the function: the same at every step.
        self.part_weights: dict[str, int] = {}
        #: The passes made, in full passes over all the held-out batches.
        self.passes = 0.0

    def loss(self, part: str) -> tuple[float, int]:
        """The old function's loss and weight (`evaluate_loss`) on the ``"search"`` or ``"confirm"`` batches; writes
        the old weights into the target when it evaluates."""
        if part not in self.losses:
            prepared = self.prepared
            write_weights(prepared.adapter, self.target, self.weights)
            self.losses[part] = evaluate_loss(
                self.target, self.batches[part], prepared.adapter, prepared.loss_fn, prepared.accelerator
            )
            self.passes += self.share(part)
            self.part_weights[part] = self.losses[part][1]
        return self.losses[part]

    def share(self, part: str) -> float:
        """The ``part``'s share of the held-out batches: what a pass over it costs in passes over all of them."""
        return len(self.batches[part]) / sum(len(batches) for batches in self.batches.values())

    def on_all(self) -> tuple[float, int]:
        """The old function's loss and weight on all the held-out batches, from those of both parts."""
        search_loss, confirm_loss = self.loss("search")[0], self.loss("confirm")[0]
        return self.combined(search_loss, confirm_loss), sum(self.part_weights.values())

    def known_part(self, searched: search.SearchOutcome) -> search.KnownPart:
        """The search batches' losses at the steps the kept candidate's search evaluated (the same weights there):
        the final search on all the batches evaluates only the confirmation batches at those steps."""
        losses = {point.step_size: point.loss for point in searched.points
                  if point.kind == "rank" and point.step_size > 0 and point.loss is not None}
        return search.KnownPart(losses, self.batches["confirm"], self.combined, self.share("confirm"))

    def combined(self, search_loss: float, confirm_loss: float) -> float:
        """A loss on all the held-out batches from its losses on the search and the confirmation batches (once
        each part's weight is known)."""
        search_weight, confirm_weight = self.part_weights["search"], self.part_weights["confirm"]
        return (search_loss * search_weight + confirm_loss * confirm_weight) / (search_weight + confirm_weight)


Kept = tuple[CandidateReport, search.SearchOutcome, float]


def _choose(
    prepared: PreparedGrowth, target: PreTrainedModel, old: OldFunction, *, progress: bool
) -> tuple[Kept, list[CandidateReport], str, float]:
    """Line-search every candidate on the search batches, confirm on the confirmation batches (`OldFunction`
    holds both and the loss at step 0 on them): the candidate kept (its report, its outcome on the search
    batches, and what the searches and confirmations cost in full passes over all the held-out batches),
    every candidate's report, how it was chosen ("search" or "fallback") and its confirmation margin over the
    simplest."""
    adapter, loss_fn, accelerator = prepared.adapter, prepared.loss_fn, prepared.accelerator
    search_batches, confirm_batches = old.batches["search"], old.batches["confirm"]

    def confirm(outcome: search.SearchOutcome) -> float:
        """The confirmation loss of the weights ``outcome`` left in the target: the old function's at step 0."""
        if outcome.step_size == 0:
            return old.loss("confirm")[0]
        loss, weight = evaluate_loss(target, confirm_batches, adapter, loss_fn, accelerator)
        old.part_weights["confirm"] = weight
        return loss

    problem = prepared.problem  # solved once for every candidate
    reports: list[CandidateReport] = []
    simplest = best = None
    first_of_truncation: dict[str, tuple[float, float]] = {}  # the step and lam unit its first search found
    searched_passes, confirm_passes = 0.0, 0
    for truncation, step_mode in prepared.config.candidates:
        problem.set_truncation(truncation)  # one solve holds both truncations (`prepare_growth`)
        problem.set_step_mode(step_mode)
        near = _near(first_of_truncation.get(truncation), problem)
        before = old.loss("search")
        write_weights(adapter, target, old.weights)
        outcome = search.line_search(
            prepared, problem, target, search_batches, progress=progress, near=near, before=before
        )
        searched_passes += outcome.passes
        first_of_truncation.setdefault(truncation, (outcome.step_size, problem.lam_unit))
        confirm_loss = confirm(outcome)
        confirm_passes += outcome.step_size > 0
        report = CandidateReport(truncation, step_mode, outcome.step_size, outcome.loss_after, confirm_loss)
        reports.append(report)
        logger.info("candidate %s, %s: step %.4g, search loss %.5f, confirmation loss %.5f", truncation, step_mode,
                    report.step_size, report.search_loss, report.confirm_loss)
        kept = (report, outcome)
        simplest = simplest or kept
        if best is None or report.search_loss < best[0].search_loss:
            best = kept  # the earlier (simpler) candidate wins a tie
    confirmed = best[0].confirm_loss < simplest[0].confirm_loss
    selection = "fallback" if best is not simplest and not confirmed else "search"
    report, outcome = best if confirmed else simplest
    # in full passes over all the held-out batches: the searches' over their part, the confirmations' over theirs
    passes = searched_passes * old.share("search") + confirm_passes * old.share("confirm")
    return (report, outcome, passes), reports, selection, simplest[0].confirm_loss - report.confirm_loss


def _near(searched: tuple[float, float] | None, problem: GrowthProblem) -> float | None:
    """Where a candidate's shorter search starts: the step its truncation's first candidate found (``searched``:
    that step and its lam per unit step), at the same model-wide lam (`StepScaling.lam`; per head or per layer
    the lam units are the same). None, a full search, for a truncation's first candidate (the other truncation's
    step can be far off: 64x on the BPE GPT-2 of bench_candidates), where that one found step 0, and for searches
    per layer, which start from the layers alone."""
    if searched is None or 0 in searched or problem.lam_unit == 0 or problem.step_mode == "layer_search":
        return None
    step_size, unit = searched
    return step_size * unit / problem.lam_unit
