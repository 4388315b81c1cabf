"""The growth report: what was grown, on how much data, what it was expected to gain and what it gained.

`grow_model` attaches it to the grown model as ``model.growth_report``; `save_pretrained` of a grown model
writes it beside the weights as ``growth_report.json`` (`load_growth_report` reads it back).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .files import write_text_atomically


REPORT_FILENAME = "growth_report.json"
#: How the summary qualifies the report's lam, by step mode (per layer where not listed).
STEP_MODE_NOTES = {"global": "", "per_head": ", per head"}


#: The model classes (by name ending) whose loss is a language model's own: next-token or masked.
LANGUAGE_MODEL_HEADS = ("LMHeadModel", "ForCausalLM", "ForMaskedLM")


@dataclass
class HeadReport:
    """Expected loss decreases of one head under the local model of the chosen step (see `hf_grow.linalg`).

    ``expected_gain``: of the update applied (rank d_k + p). ``expected_gain_without_growth``: of the same
    solve truncated to the old rank d_k. ``marginal_gains``: sigma_r^2 / (2 lam) of each added dimension
    (whitened truncation; the spectrum that tells where growth pays). ``first_order_gain``: -<M, dZ>.
    """

    layer: int
    head: int
    expected_gain: float
    expected_gain_without_growth: float
    first_order_gain: float
    marginal_gains: list[float]
    #: This head's absolute step (its layer's but with ``step_mode="per_head"``; None in older reports).
    lam: float | None = None
    #: The compact solve's certificate at this step: how far (at most) its target's singular values lie from the
    #: exact target's, relative to the smallest one kept (0: exact; `hf_grow.compact`). None in older reports.
    compact_perturbation: float | None = None
    #: The root mean square of this head's pre-softmax scores ``x'^T Z y'`` over independent pairs of statistics
    #: tokens (||Z|| in the metric of C; with rotary positions, at relative position 0), before growth and at the
    #: chosen step: how much sharper the step makes attention. None in older reports.
    score_rms_before: float | None = None
    score_rms_after: float | None = None
    #: The plain Frobenius norm of this head's Z = scaling W'_Q W'_K^T (model coordinates, with the bias row),
    #: before growth and at the chosen step. Grown far beyond the score RMS, it is weight where the statistics'
    #: inputs hardly vary (C's small eigenvalues), which bfloat16's rounding of the inputs reaches. None in older
    #: reports.
    weight_norm_before: float | None = None
    weight_norm_after: float | None = None


@dataclass
class LayerReport:
    layer: int
    qk_dim_before: int
    qk_dim_after: int
    expected_gain: float
    #: Held-out loss decrease when only this layer takes the chosen step (None when not measured).
    realized_gain: float | None
    heads: list[HeadReport]
    #: This layer's absolute step, Z_new = Z - lam * P (None in reports written before steps per layer); with
    #: ``step_mode="per_head"`` the layer's reference step, each head's own in `HeadReport.lam`.
    lam: float | None = None

    @property
    def score_rms_before(self) -> float | None:
        """The heads' scores' root mean square before growth (`HeadReport.score_rms_before`; None if unknown)."""
        return _root_mean_square([head.score_rms_before for head in self.heads])

    @property
    def score_rms_after(self) -> float | None:
        """The heads' scores' root mean square at the chosen step (`HeadReport.score_rms_after`)."""
        return _root_mean_square([head.score_rms_after for head in self.heads])

    @property
    def weight_norm_ratio(self) -> float | None:
        """The heads' ||Z|| (`HeadReport.weight_norm_before` / `weight_norm_after`, root mean square over the
        heads) at the chosen step over before growth; None if unknown."""
        before = _root_mean_square([head.weight_norm_before for head in self.heads])
        after = _root_mean_square([head.weight_norm_after for head in self.heads])
        return None if before is None or after is None or before == 0 else after / before


def _root_mean_square(values: list[float | None]) -> float | None:
    if not values or any(value is None for value in values):
        return None
    return math.sqrt(sum(value * value for value in values) / len(values))


@dataclass
class LineSearchPoint:
    step_size: float
    #: None where the held-out loss was not finite (a step that overflows in low precision): JSON has no NaN.
    loss: float | None
    #: "rank" for the rank-(d_k+p) truncation, "unconstrained" for the full-rank update Z - lam P, "layer l"
    #: for a step of layer l alone, the others fixed (step modes "layer_search", "coordinate"; ``step_size`` is
    #: then that layer's own).
    kind: str = "rank"


@dataclass
class CandidateReport:
    """One (truncation, step_mode) candidate of ``"auto"`` options, at its best line-searched step."""

    truncation: str
    step_mode: str
    step_size: float
    #: Held-out loss at that step on the batches its step was searched on, and on the confirmation batches. (The
    #: kept candidate's step is then searched again on all the held-out batches: `GrowthReport.step_size`.)
    search_loss: float | None
    confirm_loss: float | None
    #: True where its search stayed coarse (`hf_grow.growth.candidates`): at its best, the loss could not have
    #: come near the kept candidate's, so its search was not refined to the end.
    coarse: bool = False


#: How the step's M was formed, by `GrowthReport.cross_fit`: one line of the summary and of the model card.
CROSS_FIT_NOTES = {
    False: "the mean over all statistics batches",
    True: "cross-fitted (`cross_fit`): kept to what the odd and the even statistics batches agree on",
}


@dataclass
class GrowthReport:
    model_class: str
    model_type: str
    truncation: str
    search: str
    #: The chosen step in relative units: at 1 the update is as large as Z (see `hf_grow.growth`); with
    #: ``step_mode="layer_search"``, the multiplier of the layers' own steps.
    step_size: float
    #: The steps in absolute units of the mean statistics, Z_new = Z - lam * P: the root mean square of the
    #: layers' own (`LayerReport.lam`; one lam for all with ``step_mode="global"``).
    lam: float
    #: Held-out loss of the grown model at step 0, the old function (in bfloat16/float16 up to the model's own
    #: rounding: the rescaled query weights, kernels at the new head width); the line search compares every step
    #: with it.
    eval_loss_before: float | None
    eval_loss_after: float | None
    #: Best held-out loss of the full-rank update (search="fast" with one step mode; None where the default's
    #: choice between two step modes searched): an upper reference for growth.
    unconstrained_eval_loss: float | None
    statistics_tokens: int
    statistics_batches: int
    eval_weight: int
    parameters_before: int
    parameters_after: int
    seconds: dict[str, float]
    #: Every step the line search evaluated, with its loss over all the held-out batches (the step-0 point is
    #: ``eval_loss_before``, the chosen step's ``eval_loss_after``). With several candidates these are the final
    #: search's, from the kept candidate's step; each candidate's own search, on part of the batches, is in
    #: `candidates`.
    line_search: list[LineSearchPoint] = field(default_factory=list)
    layers: list[LayerReport] = field(default_factory=list)
    #: How the truncations were computed (`hf_grow.linalg.DECOMPOSITION_METHODS`, joined by "+" where
    #: ``solver="auto"`` chose differently per layer).
    solver: str = "eigh"
    #: "refactor" (all Q/K weights rewritten) or "append" (old weights kept, new dimensions hold the step).
    mode: str = "refactor"
    #: Total added dimensions per head that were allocated to the layers by expected gain (None: ``p`` given).
    budget: int | None = None
    #: How M was collected (`hf_grow.statistics.METHODS`, joined by "+" where ``"auto"`` chose per batch).
    statistics_method: str | None = None
    #: How each layer's lam follows the step size (`hf_grow.config.STEP_MODES`); `LayerReport.lam` gives them.
    step_mode: str = "global"
    #: What the line search cost, in full passes over the held-out batches (an evaluation that replays the
    #: unchanged leading blocks counts by the share of blocks it runs; None without held-out batches), beyond
    #: the pass at step 0 (the loss before) that every growth makes.
    line_search_passes: float | None = None
    #: The `hf_grow.GrowthConfig` that produced the model, as a dict (None in reports written before it).
    config: dict | None = None
    #: With truncation or step_mode "auto": every candidate, the simplest first (empty without a choice).
    candidates: list[CandidateReport] = field(default_factory=list)
    #: How the candidate was chosen: "search" (the search's best, confirmed or the simplest itself), "fallback"
    #: (the confirmation disagreed with the search: the simplest kept), "simplest" (no held-out choice could be
    #: made: a given step_size, or too few held-out batches to keep some for confirmation); None without "auto".
    selection: str | None = None
    #: The simplest candidate's confirmation loss minus the chosen one's (> 0: the choice gains on batches its
    #: search never saw; 0 when the simplest is kept).
    selection_margin: float | None = None
    #: Whether the step was solved from the cross-fitted M (`GrowthConfig.cross_fit`; False in older reports).
    cross_fit: bool = False
    #: With ``step_scale`` < 1: the line search's best step, of which ``step_size`` is that fraction (None: the
    #: step taken is the searched one).
    searched_step_size: float | None = None
    #: Whether the losses are the model's own (``outputs.loss``); False where a ``loss_fn`` gave them.
    model_loss: bool = True
    #: The hf_grow version that grew the model (None in reports written before it was recorded).
    hf_grow_version: str | None = None

    @property
    def step_fraction(self) -> str | None:
        """"f of the searched s" where the step taken is ``step_scale`` of the searched one; None otherwise."""
        if self.searched_step_size is None:
            return None
        return f"{self.step_size / self.searched_step_size:.3g} of the searched {self.searched_step_size:.4g}"

    @property
    def candidate_name(self) -> str:
        return f"{self.truncation}, {self.step_mode.replace('_', ' ')}"

    @property
    def qk_dims_before(self) -> list[int]:
        return [layer.qk_dim_before for layer in self.layers]

    @property
    def qk_dims_after(self) -> list[int]:
        return [layer.qk_dim_after for layer in self.layers]

    @property
    def parameters_added(self) -> int:
        return self.parameters_after - self.parameters_before

    @property
    def language_model_loss(self) -> bool:
        """Whether the model was grown on a language model's loss (next-token or masked), which a perplexity
        describes: a language model's own loss, not a ``loss_fn`` (a sentence encoder's loss, say)."""
        return self.model_loss and self.model_class.endswith(LANGUAGE_MODEL_HEADS)

    @property
    def perplexity_before(self) -> float | None:
        if self.eval_loss_before is None or not self.language_model_loss:
            return None
        return math.exp(self.eval_loss_before)

    @property
    def perplexity_after(self) -> float | None:
        if self.eval_loss_after is None or not self.language_model_loss:
            return None
        return math.exp(self.eval_loss_after)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GrowthReport:
        """The report of ``to_dict``; entries of a newer hf_grow's report that this one does not know are left out
        (at every level: a report on the Hub may come from a later version)."""
        data = _known(cls, data)
        points = data.get("line_search", [])
        data["line_search"] = [LineSearchPoint(**_known(LineSearchPoint, point)) for point in points]
        data["candidates"] = [CandidateReport(**_known(CandidateReport, entry)) for entry in data.get("candidates", [])]
        data["layers"] = [
            LayerReport(**{**_known(LayerReport, layer),
                           "heads": [HeadReport(**_known(HeadReport, head)) for head in layer["heads"]]})
            for layer in data.get("layers", [])
        ]
        return cls(**data)

    def to_json_file(self, path: str | os.PathLike) -> None:
        write_text_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def summary(self) -> str:
        """A short human-readable table (`summary_table`)."""
        return summary_table(self)

    def selection_summary(self) -> str:
        """One line: which candidate of the "auto" options was kept, how, and by how much (`selection_line`)."""
        return selection_line(self)


def summary_table(report: GrowthReport) -> str:
    """A short human-readable table of a growth report (`GrowthReport.summary`)."""

    def before_after(before: float | None, after: float | None) -> str:
        return f"before {format_loss(before)}  after {format_loss(after)}"

    fraction = "" if report.step_fraction is None else f" ({report.step_fraction})"
    lines = [f"held-out loss  {before_after(report.eval_loss_before, report.eval_loss_after)}"]
    if report.language_model_loss:  # not a sentence encoder's loss of its own
        lines.append(f"perplexity     {before_after(report.perplexity_before, report.perplexity_after)}")
    lines += [
        f"step size {report.step_size:.4g}{fraction} "
        f"(lam {report.lam:.4g}{STEP_MODE_NOTES.get(report.step_mode, ', per layer')}),"
        f" mode {report.mode}, truncation {report.truncation}, search {report.search}",
        f"Q/K dims {report.qk_dims_before} -> {report.qk_dims_after}, parameters added {report.parameters_added:,}",
    ]
    if report.selection is not None:
        lines.append(selection_line(report))
    lines.append(f"M {CROSS_FIT_NOTES[report.cross_fit]}")
    if report.budget is not None:
        lines.append(f"budget of {report.budget} added dims per head allocated to layers by expected gain")
    if report.unconstrained_eval_loss is not None:
        lines.append(f"full-rank update (reference) held-out loss {format_loss(report.unconstrained_eval_loss)}")
    lines.append("layer  qk  expected gain  realized gain  score rms  Z norm")
    for layer in report.layers:
        lines.append(
            f"{layer.layer:5d}  {layer.qk_dim_before}->{layer.qk_dim_after}  {layer.expected_gain:13.5f}  "
            f"{format_loss(layer.realized_gain):>13}  {format_score_rms(layer)}  {format_weight_ratio(layer)}"
        )
    return "\n".join(lines)


def selection_line(report: GrowthReport) -> str:
    """One line: which candidate of the "auto" options was kept, how, and by how much
    (`GrowthReport.selection_summary`)."""
    others = len(report.candidates) - 1
    if report.selection == "simplest":
        return (f"{report.candidate_name} kept without a held-out choice (a step size given, or fewer than two "
                "held-out batches with loss terms)")
    if report.selection == "fallback":
        searched = min(report.candidates, key=lambda c: math.inf if c.search_loss is None else c.search_loss)
        return (
            f"{report.candidate_name} kept: the search preferred {searched.truncation}, "
            f"{searched.step_mode.replace('_', ' ')}, which the confirmation batches did not"
        )
    margin = f", {report.selection_margin:.4g} below the simplest on confirmation" if report.selection_margin else ""
    return f"{report.candidate_name} chosen by held-out loss over {others} other candidate(s){margin}"


def format_score_rms(layer: LayerReport) -> str:
    """The layer's scores' root mean square before -> after the step, as the summary and the model card show it."""
    before, after = layer.score_rms_before, layer.score_rms_after
    return "-" if before is None or after is None else f"{before:.3g}->{after:.3g}"


def format_weight_ratio(layer: LayerReport) -> str:
    """The layer's ||Z|| at the step over before it (`LayerReport.weight_norm_ratio`), e.g. ``x1.02``."""
    ratio = layer.weight_norm_ratio
    return "-" if ratio is None else f"x{ratio:.3g}"


def format_loss(value: float | None) -> str:
    """A loss, perplexity or realized gain as the summary and the model card show it: 4 decimals, "-" where not
    measured."""
    return "-" if value is None else f"{value:.4f}"


def _known(cls: type, data: dict) -> dict:
    """The entries of ``data`` that are fields of the dataclass ``cls``."""
    names = {field.name for field in fields(cls)}
    return {key: value for key, value in data.items() if key in names}


def load_growth_report(directory: str | os.PathLike) -> GrowthReport:
    """Read ``growth_report.json`` from a folder written by `save_pretrained` of a grown model."""
    path = Path(directory) / REPORT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no {REPORT_FILENAME} in {directory}: was this model grown and saved by hf_grow?")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not a growth report ({error}): a damaged file? Save the model again") from None
    return GrowthReport.from_dict(data)
