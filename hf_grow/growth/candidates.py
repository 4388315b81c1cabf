"""The candidates of "auto" options chosen by held-out loss, the choice confirmed on batches the search never saw.

With ``truncation="auto"`` and/or ``step_mode="auto"`` (`GrowthConfig.candidates`), each (truncation, step
mode) candidate is line-searched on the first part of the held-out batches. The one of least loss there is
kept only if it also beats the simplest candidate (the first: whitened truncation, steps per head) on the rest,
the confirmation batches (``confirm_fraction`` of them). Otherwise the simplest is kept: with few held-out
batches, the search's best can fit their noise (BENCHMARKS: the per-layer searches on MiniLM's 8 batches).
The kept candidate's step is then searched again on all the held-out batches, from the step found on part of
them: a step searched on fewer batches is noisier.

Cost: one line search per candidate on the search batches, one pass over the confirmation batches per
candidate, and a shorter line search on all the batches. The statistics are shared. "refactor" growth is solved
once for both truncations (`GrowthProblem.holds`), so M is freed group by group as for one candidate; "append"
growth is solved again for Frobenius truncation from the M kept (at most two problems alive: the simplest's and
the best so far). Step modes are switched without solving again.
"""

from __future__ import annotations

import logging
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
    (problem, truncation, step_mode, searched, passes), reports, selection, margin = _choose(
        prepared, target, *parts, progress=progress
    )
    problem.set_truncation(truncation)  # a problem shared by the candidates holds the last one's settings
    problem.set_step_mode(step_mode)  # the report's steps per layer and head are the chosen mode's
    # The kept candidate's step, searched again on every held-out batch (those of the confirmation too), from the
    # step its search found (from the start where that was 0): with few batches, a step searched on part of them
    # is noisier (BENCHMARKS: MiniLM).
    write_weights(prepared.adapter, target, problem.weights(0.0))
    outcome = search.line_search(
        prepared, problem, target, prepared.eval_batches, progress=progress, near=searched.step_size,
        record_step_zero=measure_realized_gains,
    )
    outcome.passes += passes
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


Kept = tuple[GrowthProblem, str, str, search.SearchOutcome, float]


def _choose(
    prepared: PreparedGrowth, target: PreTrainedModel, search_batches: Batches, confirm_batches: Batches,
    *, progress: bool,
) -> tuple[Kept, list[CandidateReport], str, float]:
    """Line-search every candidate on ``search_batches``, confirm on ``confirm_batches``: the candidate kept (its
    problem, truncation, step mode, outcome on the search batches, and what choosing cost in full passes over all
    the held-out batches), every candidate's report, how it was chosen ("search" or "fallback") and its
    confirmation margin over the simplest."""
    adapter, loss_fn, accelerator = prepared.adapter, prepared.loss_fn, prepared.accelerator
    at_zero = prepared.problem.weights(0.0)  # the old function at the grown widths, whatever the candidate

    def confirm() -> tuple[float, int]:
        return evaluate_loss(target, confirm_batches, adapter, loss_fn, accelerator)

    problem = prepared.problem  # the simplest candidate's truncation and step mode
    reports: list[CandidateReport] = []
    simplest = best = None
    searched_passes, confirm_passes = 0.0, 0
    for truncation, step_mode in prepared.config.candidates:
        if problem.holds(truncation):  # one solve for both truncations ("refactor" growth)
            problem.set_truncation(truncation)
        else:
            problem = GrowthProblem(
                prepared.model, adapter, prepared.statistics, prepared.qk_after, truncation, prepared.config.rtol,
                prepared.config.solver, problem.mode, step_mode, cross_fit=prepared.config.cross_fit,
                sharding=problem.sharding,
            )
        problem.set_step_mode(step_mode)
        write_weights(adapter, target, at_zero)
        outcome = search.line_search(prepared, problem, target, search_batches, progress=progress)
        searched_passes += outcome.passes
        confirm_passes += 1
        confirm_loss, confirm_weight = confirm()
        report = CandidateReport(truncation, step_mode, outcome.step_size, outcome.loss_after, confirm_loss)
        reports.append(report)
        logger.info("candidate %s, %s: step %.4g, search loss %.5f, confirmation loss %.5f", truncation, step_mode,
                    report.step_size, report.search_loss, report.confirm_loss)
        kept = (problem, step_mode, outcome, report)
        simplest = simplest or kept
        if best is None or report.search_loss < best[3].search_loss:
            best = kept  # the earlier (simpler) candidate wins a tie; the loser's problem is freed with it
    confirmed = best[3].confirm_loss < simplest[3].confirm_loss
    selection = "fallback" if best is not simplest and not confirmed else "search"
    problem, step_mode, outcome, report = best if confirmed else simplest
    search_weight = outcome.eval_weight
    # in full passes over all the held-out batches: the searches' over their part, the confirmations' over theirs
    passes = (searched_passes * search_weight + confirm_passes * confirm_weight) / (search_weight + confirm_weight)
    chosen = (problem, report.truncation, step_mode, outcome, passes)
    return chosen, reports, selection, simplest[3].confirm_loss - report.confirm_loss
