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
there is known from its search and confirmation; at the steps the kept candidate's search evaluated, only the
confirmation batches are evaluated, `search.KnownPart`).
The searches of the candidates but the simplest stop before their refinements (`COARSE_GRID`) and go on only
while the best candidate could be among them (`REACH_FACTOR`): the kept candidate's search is the full one, a
candidate whose loss curve cannot come near the best one's is reported at its coarse step (`CandidateReport.coarse`).
The old function (step 0) is the same for every candidate: its loss on each held-out batch is evaluated once
(`OldFunction`), recording the blocks' outputs on the way where the realized gains replay them.
The statistics and the solve are shared: one solve serves both truncations, its compact target truncated either
way ("refactor") or both unit updates ("append") (`GrowthProblem.holds`), so M is freed group by group as for one
candidate, and truncations and step modes are switched without solving again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..distributed import Processes
from ..report import CandidateReport, GrowthReport
from . import search
from .layer_steps import CACHE_BYTES, HeldOutPasses
from .line_search import evaluate_loss, within_precision
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
    parts = prepared.confirmation
    if parts is None:  # nothing to choose by: a given step size, or one held-out batch
        report = search.search_and_report(prepared, target, **reporting)
        report.selection = "simplest"
        report.candidates = [CandidateReport(report.truncation, report.step_mode, report.step_size, None, None)]
        return report
    tick = time.perf_counter()
    old = OldFunction(prepared, target, *parts, record=measure_realized_gains)
    # before any candidate's search: both parts' losses are needed anyway (the final search's step 0)
    search.check_loss_before(old.on_all()[0], prepared, target, prepared.eval_batches)
    (kept, searched, passes), reports, selection, margin = _choose(prepared, target, old, progress=progress)
    problem = prepared.problem
    problem.set_truncation(kept.truncation)  # a problem shared by the candidates holds the last one's settings
    problem.set_step_mode(kept.step_mode)  # the report's steps per layer and head are the chosen mode's
    if kept.step_mode == "layer_search":  # its step multiplies the layers' own, found by its search: keep them
        problem.layer_scales[:] = searched.layer_scales
    # The kept candidate's step, searched again on every held-out batch (those of the confirmation too), from the
    # step its search found (from the start where that was 0): with few batches, a step searched on part of them
    # is noisier (BENCHMARKS: MiniLM). Its losses at step 0 (the old function's, with the blocks' outputs that the
    # realized gains replay) and at that step are known on both parts. Where the kept candidate's search evaluated
    # a step, only the confirmation batches are evaluated (`search.KnownPart`). A coordinate candidate's loss is
    # that of its layers' refined steps, which the final search refines again from the common step: not known.
    write_weights(prepared.adapter, target, old.weights)
    outcome = search.line_search(
        prepared, problem, target, prepared.eval_batches, progress=progress, near=searched.step_size,
        record_step_zero=measure_realized_gains, before=old.on_all(),
        recorded=old.recorded_on(prepared.eval_batches) if measure_realized_gains else None,
        near_loss=None if kept.step_mode == "coordinate" else old.combined(kept.search_loss, kept.confirm_loss),
        known_part=old.known_part(searched),
    )
    # every pass but the one at step 0 over all the held-out batches that any growth makes
    outcome.passes += passes + old.passes - 1
    outcome = search.take_step_scale(prepared, problem, target, outcome, prepared.eval_batches)
    prepared.seconds["line_search"] = time.perf_counter() - tick
    return search.write_report(
        prepared, problem, target, outcome, prepared.eval_batches, **reporting,
        candidates=reports, selection=selection, selection_margin=margin,
    )


class OldFunction:
    """The held-out loss of the old function (step 0: the same for every candidate) on the search and on the
    confirmation batches, each evaluated once, when first needed; with ``record``, every block's outputs recorded
    in the same passes (`HeldOutPasses.loss_recording`, within `CACHE_BYTES` for both parts), for the realized gains
    to replay (`recorded_on`)."""

    def __init__(
        self,
        prepared: PreparedGrowth,
        target: PreTrainedModel,
        search_batches: Batches,
        confirm_batches: Batches,
        *,
        record: bool = False,
    ):
        self.prepared, self.target, self.record = prepared, target, record
        self.batches = {"search": search_batches, "confirm": confirm_batches}
        # every process's batches (each holds its own shard): the shares, and the report, the same on all of them
        counts = Processes(prepared.accelerator).sum_(torch.tensor(
            [float(len(search_batches)), float(len(confirm_batches))], dtype=torch.float64,
            device=next(target.parameters()).device,
        ))
        self.counts = {"search": counts[0].item(), "confirm": counts[1].item()}
        self.recordings: dict[str, HeldOutPasses] = {}
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
            recordings = self.recordings.values()
            if self.record and all(recording.blocks is not None for recording in recordings):
                recording = self._passes(self.batches[part])
                budget = CACHE_BYTES - sum(done.recorded_bytes for done in recordings)  # both parts within it
                self.losses[part] = recording.loss_recording(budget)
                self.recordings[part] = recording
            else:  # not recording, or a part before dropped its records (too large)
                self.losses[part] = evaluate_loss(
                    self.target, self.batches[part], prepared.adapter, prepared.loss_fn, prepared.accelerator
                )
            self.passes += self.share(part)
            self.part_weights[part] = self.losses[part][1]
        return self.losses[part]

    def share(self, part: str) -> float:
        """The ``part``'s share of the held-out batches: what a pass over it costs in passes over all of them."""
        return self.counts[part] / sum(self.counts.values())

    def recorded_on(self, batches: Batches) -> HeldOutPasses:
        """The passes over ``batches`` (the search batches, then the confirmation batches, as the held-out batches
        with loss terms are split) with the blocks' outputs both parts recorded (none where they were dropped),
        without a pass; the parts' records are then released here."""
        self.on_all()  # both parts evaluated (and recorded)
        joined = self._passes(batches)
        joined.join_records([self.recordings.get(part) for part in ("search", "confirm")])
        self.recordings.clear()
        return joined

    def _passes(self, batches: Batches) -> HeldOutPasses:
        prepared = self.prepared
        return HeldOutPasses(self.target, prepared.adapter, batches, prepared.loss_fn, prepared.accelerator)

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
#: The coarse searches of the candidates but the simplest (`search.line_search`'s ``grid``): the grid walk from
#: the start without refinements, from a sibling's step with one; each a prefix of the full search.
COARSE_GRID = {"start": (4.0, 0), "near": (2.0, 1)}
#: A coarse search is completed where its loss, less this many times the most that the rest of its search could
#: gain by a bound for convex losses (`_reach`), is below the best candidate's loss. The full searches gained up
#: to 1.21x that bound on bench_line_search's three trained models (the loss is not quite convex in log step).
REACH_FACTOR = 2.0


@dataclass
class _Candidate:
    """A candidate's search on the search batches: its report, outcome (without its weights) and where it began."""

    report: CandidateReport
    outcome: search.SearchOutcome
    near: float | None


def _choose(
    prepared: PreparedGrowth, target: PreTrainedModel, old: OldFunction, *, progress: bool
) -> tuple[Kept, list[CandidateReport], str, float]:
    """Line-search every candidate on the search batches, confirm on the confirmation batches (`OldFunction`
    holds both and the loss at step 0 on them): the candidate kept (its report, its outcome on the search
    batches, and what the searches and confirmations cost in full passes over all the held-out batches),
    every candidate's report, how it was chosen ("search" or "fallback") and its confirmation margin over the
    simplest.

    The simplest candidate's search is the full one (the default growth's). The others are first searched
    coarsely (`COARSE_GRID`), then completed, with the losses found so far, while the best of them all could
    still be among them (`REACH_FACTOR`): the kept candidate's search is always complete, and a candidate whose
    loss curve cannot come near the best one's costs fewer passes."""
    adapter, loss_fn, accelerator = prepared.adapter, prepared.loss_fn, prepared.accelerator
    search_batches, confirm_batches = old.batches["search"], old.batches["confirm"]
    problem = prepared.problem  # solved once for every candidate
    passes = {"search": 0.0, "confirm": 0}

    def searched(
        truncation: str,
        step_mode: str,
        near: float | None,
        *,
        grid: tuple[float, int] | None = None,
        known: dict[float, float] | None = None,
        confirmed: tuple[float, float] | None = None,
    ) -> _Candidate:
        """Search the candidate (from ``near``; ``grid`` and ``known`` as `search.line_search`'s) and confirm its
        step: the confirmation loss of step 0 is the old function's, of the step ``confirmed`` (step, loss) the
        loss given."""
        problem.set_truncation(truncation)  # one solve holds both truncations (`prepare_growth`)
        problem.set_step_mode(step_mode)
        write_weights(adapter, target, old.weights)
        outcome = search.line_search(
            prepared, problem, target, search_batches, progress=progress, near=near, before=old.loss("search"),
            grid=grid, known=known,
        )
        passes["search"] += outcome.passes
        if outcome.step_size == 0:
            confirm_loss = old.loss("confirm")[0]
        elif confirmed is not None and confirmed[0] == outcome.step_size:
            confirm_loss = confirmed[1]
        else:  # the weights the search left in the target
            confirm_loss, old.part_weights["confirm"] = evaluate_loss(
                target, confirm_batches, adapter, loss_fn, accelerator
            )
            passes["confirm"] += 1
        report = CandidateReport(truncation, step_mode, outcome.step_size, outcome.loss_after, confirm_loss,
                                 coarse=grid is not None)
        logger.info("candidate %s, %s: step %.4g, search loss %.5f, confirmation loss %.5f%s", truncation,
                    step_mode, report.step_size, report.search_loss, report.confirm_loss, " (coarse)" * report.coarse)
        # the weights and decompositions are not needed again: the kept step's are made by the final search
        return _Candidate(report, dataclasses.replace(outcome, weights={}, decompositions={}), near)

    candidates: list[_Candidate] = []
    first_of_truncation: dict[str, tuple[float, float]] = {}  # the step and lam unit its first search found
    for truncation, step_mode in prepared.config.candidates:
        problem.set_truncation(truncation)
        problem.set_step_mode(step_mode)
        near = _near(first_of_truncation.get(truncation), problem)
        walks = step_mode in ("global", "per_layer", "per_head") and prepared.config.search == "exact"
        grid = COARSE_GRID["start" if near is None else "near"] if candidates and walks else None
        candidates.append(searched(truncation, step_mode, near, grid=grid))
        found = candidates[-1].report
        # a step whose gain the model's precision explains (bfloat16's rounding) seeds nothing: near it the next
        # candidate's shorter search missed a gain of 1.77 nats on MiniLM; a full search from the start finds it
        gained = not within_precision(found.search_loss, old.loss("search")[0], next(target.parameters()).dtype)
        first_of_truncation.setdefault(truncation, (found.step_size if gained else 0.0, problem.lam_unit))
    while True:
        best_loss = min(candidate.report.search_loss for candidate in candidates)
        within_reach = [  # the best itself is completed: the kept candidate's search is the full one
            index for index, candidate in enumerate(candidates) if candidate.report.coarse
            and (candidate.report.search_loss == best_loss or _reach(candidate.outcome) < best_loss)
        ]
        if not within_reach:
            break
        for index in within_reach:  # its search completed: the steps searched so far are not evaluated again
            candidate, report = candidates[index], candidates[index].report
            known = _searched_losses(candidate.outcome)
            candidates[index] = searched(report.truncation, report.step_mode, candidate.near, known=known,
                                         confirmed=(report.step_size, report.confirm_loss))
    simplest = candidates[0]
    best = min(candidates, key=lambda candidate: candidate.report.search_loss)  # the first (simpler) of a tie
    # a confirmation loss that is not finite (NaN: a step overflowing in low precision) confirms nothing
    best_confirm, simplest_confirm = (_or_inf(candidate.report.confirm_loss) for candidate in (best, simplest))
    confirmed = best_confirm < simplest_confirm
    selection = "fallback" if best is not simplest and not confirmed else "search"
    kept = best if confirmed else simplest
    # in full passes over all the held-out batches: the searches' over their part, the confirmations' over theirs
    cost = passes["search"] * old.share("search") + passes["confirm"] * old.share("confirm")
    margin = simplest_confirm - _or_inf(kept.report.confirm_loss)
    margin = margin if math.isfinite(margin) else None
    return (kept.report, kept.outcome, cost), [candidate.report for candidate in candidates], selection, margin


def _or_inf(loss: float) -> float:
    """+inf for a loss that is not finite, so that it compares as the worst (NaN compares false with everything)."""
    return loss if math.isfinite(loss) else math.inf


def _searched_losses(outcome: search.SearchOutcome) -> dict[float, float]:
    """The loss at each step > 0 that a search of the whole model evaluated (+inf where it was not finite)."""
    return {point.step_size: math.inf if point.loss is None else point.loss
            for point in outcome.points if point.kind == "rank" and point.step_size > 0}


def _reach(outcome: search.SearchOutcome) -> float:
    """The least loss that the rest of a coarse search could find, less `REACH_FACTOR` times the gain that bound
    allows: -inf where the best step has no searched step on either side (or one of infinite loss); the loss at
    step 0 where no step beat it. Between the best step and each neighbour, a loss convex in log step is at least
    the larger of two secants extended: the one through the best step and its other neighbour, and the one
    through that neighbour and the next searched step beyond it (where there is one)."""
    if outcome.step_size == 0:
        return outcome.loss_after
    searched = sorted((math.log(step), loss) for step, loss in _searched_losses(outcome).items())
    best = next(index for index, (step, _) in enumerate(searched) if step == math.log(outcome.step_size))
    if best in (0, len(searched) - 1) or not math.isfinite(searched[best - 1][1] + searched[best + 1][1]):
        return -math.inf
    least = math.inf
    for side in (-1, 1):
        neighbour, beyond = best + side, best + 2 * side
        lines = [(searched[best - side], searched[best])]
        if 0 <= beyond < len(searched) and math.isfinite(searched[beyond][1]):
            lines.append((searched[beyond], searched[neighbour]))
        least = min(least, _least_of_largest(lines, searched[best][0], searched[neighbour][0]))
    loss = searched[best][1]
    return loss - REACH_FACTOR * (loss - least)


def _least_of_largest(lines: list[tuple[tuple[float, float], tuple[float, float]]], start: float, end: float) -> float:
    """The least over [start, end] (either order) of the largest of the lines, each through two (x, y) points: at
    an end or where two lines cross (the largest of lines is convex)."""
    def value(line, x):
        (x0, y0), (x1, y1) = line
        return y0 + (y1 - y0) / (x1 - x0) * (x - x0)

    xs = [start, end]
    if len(lines) == 2:
        slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in lines]
        if slopes[0] != slopes[1]:
            crossing = start + (value(lines[1], start) - value(lines[0], start)) / (slopes[0] - slopes[1])
            if min(start, end) <= crossing <= max(start, end):
                xs.append(crossing)
    return min(max(value(line, x) for line in lines) for x in xs)


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
