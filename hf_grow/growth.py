"""`grow_model`: statistics, solve, line search and the grown model, with its report.

The step: per head, Z_new = best rank-(d_k + p) approximation of Z - lam * P with P = C^+ M C^+ (see
`hf_grow.linalg`), one lam for the whole model, chosen on held-out batches. Step sizes are searched in
relative units, ``step_size = lam / lam_unit`` with ``lam_unit = sqrt(sum ||C^1/2 Z C^1/2||^2 / sum
||C^1/2 P C^1/2||^2)`` over all heads: at step size 1 the update moves the scores by about their own RMS size.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from . import linalg
from .adapters import ArchitectureAdapter, get_adapter
from .budget import allocate_budget, check_budget
from .distributed import Processes, unwrap_model
from .report import GrowthReport, HeadReport, LayerReport, LineSearchPoint
from .statistics import (
    GrowthStatistics,
    LossFn,
    batch_loss_weight,
    check_arguments as check_statistics_arguments,
    collect_statistics,
    compute_loss,
    iterate_batches,
    module_modes,
    restore_modes,
    weight_sample,
)


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")

#: Measured on trained GPT-2s (BENCHMARKS.md): truncating in the metric of C beats the Frobenius norm of Z.
DEFAULT_TRUNCATION = "whitened"
SEARCHES = ("exact", "fast")
#: "refactor": the rank-(d_k + p) truncation of Z - lam P rewrites all Q/K weights. "append": the old Q/K
#: weights are kept and the p new dimensions hold the best rank-p approximation of the step -lam P.
MODES = ("refactor", "append")
QKWeights = dict[int, tuple[Tensor, Tensor]]
#: Statistics whose weight sample differs from the model's by more than this (relative norm) are refused;
#: loading the same checkpoint in bfloat16 changes it by at most 2^-8.
WEIGHTS_RTOL = 1e-2

_NO_LOSS_TERMS = "{data} holds no loss terms (no batches, or every label is -100): pass batches with labels."


def evaluate_loss(
    model: PreTrainedModel,
    batches: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter | None = None,
    loss_fn: LossFn | None = None,
    accelerator: Accelerator | None = None,
) -> tuple[float, int]:
    """Mean loss over ``batches``, each batch weighted by the number of loss terms it averages over (with a
    ``loss_fn``, whose normalization is unknown, by its number of sequences).

    Returns ``(loss, total_weight)``; the model runs in eval mode without gradients and keeps its mode.
    With an ``accelerator``, every process passes its own batches and gets the loss over all of them.
    """
    model = unwrap_model(model, accelerator)
    adapter = adapter or get_adapter(model)
    processes = Processes(accelerator)
    device = next(model.parameters()).device
    modes = module_modes(model)
    model.eval()
    total, weight = 0.0, 0
    try:
        with processes.failing_together(), torch.no_grad():
            for batch in iterate_batches(batches, model):
                batch_weight = batch_loss_weight(adapter, model, batch, loss_fn)
                if batch_weight == 0:
                    continue  # no loss term: the model's loss is 0 / 0
                total += float(compute_loss(model, batch, loss_fn)) * batch_weight
                weight += batch_weight
    finally:
        restore_modes(modes)
    if processes.world_size > 1:
        total, weight = processes.sum_(torch.tensor([total, weight], dtype=torch.float64, device=device)).tolist()
        weight = int(weight)
    if weight == 0:
        raise ValueError(_NO_LOSS_TERMS.format(data="the evaluation data"))
    return total / weight, weight


@dataclass
class _LayerProblem:
    """Everything the step of one layer needs, in float64."""

    query: Tensor
    key: Tensor
    scaling_before: float
    scaling_after: float
    qk_dim_after: int
    bilinear: Tensor
    gradient: Tensor
    direction: Tensor
    metric: linalg.Metric


class _GrowthProblem:
    """The solved statistics of a model: Q/K weights for any step size, and what they are expected to gain."""

    def __init__(
        self,
        model: PreTrainedModel,
        adapter: ArchitectureAdapter,
        statistics: GrowthStatistics,
        qk_dims_after: list[int],
        truncation: str,
        rtol: float,
        solver: str,
        mode: str = "refactor",
    ):
        self.truncation = truncation
        self.solver = solver
        self.mode = mode
        self._unit_updates: dict[int, linalg.Factorization] = {}
        self._whitened_pairs: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self._starts: dict[tuple, Tensor] = {}
        #: The decomposition methods the solver ran (``"auto"`` resolves per size).
        self.methods_used: set[str] = set()
        self.layers: list[_LayerProblem] = []
        config = model.config
        with torch.no_grad():
            for layer, attention in enumerate(adapter.attention_modules(model)):
                query, key = adapter.read_qk(attention)
                qk_before = query.shape[-1]
                scaling_before = adapter.scaling(config, layer, qk_before)
                device = statistics.gradients[layer].device
                query, key = query.to(device), key.to(device)
                metric = linalg.metric_from_second_moment(statistics.mean_second_moment(layer), rtol=rtol)
                gradient = statistics.mean_gradient(layer)
                self.layers.append(
                    _LayerProblem(
                        query=query,
                        key=key,
                        scaling_before=scaling_before,
                        scaling_after=adapter.scaling(config, layer, qk_dims_after[layer]),
                        qk_dim_after=qk_dims_after[layer],
                        bilinear=linalg.bilinear_form(query, key, scaling_before),
                        gradient=gradient,
                        direction=linalg.solve_direction(gradient, metric),
                        metric=metric,
                    )
                )
            scores_sq = sum(float(linalg.whitened_norm_sq(p.bilinear, p.metric).sum()) for p in self.layers)
            step_sq = sum(float(linalg.whitened_norm_sq(p.direction, p.metric).sum()) for p in self.layers)
        # lam per unit step size: zero when the gradients vanish (nothing to gain); with all-zero Q/K the
        # unit step has whitened norm 1 instead of the scores' own size.
        self.lam_unit = math.sqrt((scores_sq or 1.0) / step_sq) if step_sq > 0 else 0.0

    def lam(self, step_size: float) -> float:
        return step_size * self.lam_unit

    def widen(self, qk_dims_after: list[int], adapter: ArchitectureAdapter, config) -> None:
        """Set the grown widths (decided after the statistics, e.g. by a budget)."""
        for layer, problem in enumerate(self.layers):
            problem.qk_dim_after = qk_dims_after[layer]
            problem.scaling_after = adapter.scaling(config, layer, qk_dims_after[layer])

    def gain_rates(self, layer: int) -> linalg.GainRates:
        """First-order expected gains of ``layer`` per unit step size (see `linalg.growth_gain_rates`)."""
        problem = self.layers[layer]
        with torch.no_grad():
            width = problem.query.shape[-1]
            rates = linalg.growth_gain_rates(problem.bilinear, problem.direction, problem.metric, width)
        return linalg.GainRates(rates.without_growth * self.lam_unit, rates.marginal * self.lam_unit)

    def decomposition(self, layer: int, step_size: float, truncation: str) -> linalg.Decomposition:
        """The decomposition of layer's ``Z - lam P`` (whitened or not) for truncations up to the grown width."""
        problem = self.layers[layer]
        base, direction = self._whitened(layer, truncation)
        metric = problem.metric if truncation == "whitened" else None
        target = base - self.lam(step_size) * direction
        return self._decompose(("step", layer, truncation), target, metric, problem.qk_dim_after)

    def unit_update(self, layer: int) -> linalg.Factorization:
        """The "append" update at lam = 1: the truncation of -P to the p added dimensions (computed once)."""
        if layer not in self._unit_updates:
            problem = self.layers[layer]
            metric = problem.metric if self.truncation == "whitened" else None
            added = problem.qk_dim_after - problem.query.shape[-1]
            _, direction = self._whitened(layer, self.truncation)
            decomposition = self._decompose(("unit", layer, self.truncation), -direction, metric, added)
            self._unit_updates[layer] = decomposition.truncate(added)
        return self._unit_updates[layer]

    def _whitened(self, layer: int, truncation: str) -> tuple[Tensor, Tensor]:
        """Z and P where ``truncation`` truncates them (whitened by C^1/2, or as they are), computed once:
        each line-search step then only forms ``Z - lam P`` there."""
        key = (layer, truncation)
        if key not in self._whitened_pairs:
            problem = self.layers[layer]
            pair = (problem.bilinear, problem.direction)
            if truncation == "whitened":
                pair = (linalg.whiten(problem.bilinear, problem.metric), linalg.whiten(problem.direction, problem.metric))
            self._whitened_pairs[key] = pair
        return self._whitened_pairs[key]

    def _decompose(
        self, key: tuple, whitened: Tensor, metric: linalg.Metric | None, rank: int
    ) -> linalg.Decomposition:
        """Decompose with the solver (``"auto"``: by size), the subspace method warm-started from the last
        decomposition under the same ``key`` (the previous line-search step)."""
        method = self.solver if self.solver != "auto" else linalg.choose_method(whitened.shape[-1], rank)
        self.methods_used.add(method)
        decomposition = linalg.decompose_whitened(whitened, metric, method, rank=rank, start=self._starts.get(key))
        if decomposition.basis is not None:
            self._starts[key] = decomposition.basis
        return decomposition

    def weights(self, step_size: float) -> QKWeights:
        """Augmented Q/K weights of the grown width for every layer. Step size 0 is exactly the old function:
        the old weights, zero-padded, with the change of scale folded into the queries (so in a bfloat16 or
        float16 model, up to the rounding of those queries). In "append" mode the old weights are kept at
        every step (layers without added dimensions do not change)."""
        weights = {}
        with torch.no_grad():
            for layer, problem in enumerate(self.layers):
                if self.mode == "append" and problem.qk_dim_after > problem.query.shape[-1]:
                    update = linalg.rescaled_to_step(self.unit_update(layer), self.lam(step_size))
                    weights[layer] = linalg.appended_weights(
                        problem.query, problem.key, problem.scaling_before, problem.scaling_after, update
                    )
                    continue
                if step_size == 0 or self.mode == "append":
                    padding = problem.qk_dim_after - problem.query.shape[-1]
                    fold = problem.scaling_before / problem.scaling_after
                    weights[layer] = (
                        torch.nn.functional.pad(problem.query * fold, (0, padding)),
                        torch.nn.functional.pad(problem.key, (0, padding)),
                    )
                    continue
                factors = self.decomposition(layer, step_size, self.truncation).truncate(problem.qk_dim_after)
                root_scaling = math.sqrt(problem.scaling_after)
                weights[layer] = (factors.left / root_scaling, factors.right / root_scaling)
        return weights

    def unconstrained_weights(self, step_size: float, scalings: list[float]) -> QKWeights:
        """Full-rank weights computing Z - lam P exactly: queries (Z - lam P) / scaling, keys the identity."""
        weights = {}
        with torch.no_grad():
            for layer, problem in enumerate(self.layers):
                target = problem.bilinear - self.lam(step_size) * problem.direction
                identity = torch.eye(target.shape[-1], dtype=target.dtype, device=target.device).expand_as(target)
                weights[layer] = (target / scalings[layer], identity.clone())
        return weights

    def head_reports(self, layer: int, step_size: float) -> list[HeadReport]:
        problem = self.layers[layer]
        lam = self.lam(step_size)
        qk_before = problem.query.shape[-1]
        with torch.no_grad():
            if self.mode == "append":
                # The old form stays: the step is the rank-p update alone, and without growth there is none.
                delta = torch.zeros_like(problem.bilinear)
                if problem.qk_dim_after > qk_before:
                    delta = linalg.rescaled_to_step(self.unit_update(layer), lam).product
                delta_kept = torch.zeros_like(delta)
                _, direction = self._whitened(layer, "whitened")
                added = problem.qk_dim_after - qk_before
                spectrum = self._decompose(
                    ("unit", layer, "whitened"), -lam * direction, problem.metric, max(added, 1)
                ).singular_values
                marginal = linalg.rank_gains(spectrum, lam)[:, : problem.qk_dim_after - qk_before]
            else:
                decomposition = self.decomposition(layer, step_size, self.truncation)
                grown, kept = decomposition.truncate(problem.qk_dim_after), decomposition.truncate(qk_before)
                delta, delta_kept = grown.product - problem.bilinear, kept.product - problem.bilinear
                if self.truncation != "whitened":
                    decomposition = self.decomposition(layer, step_size, "whitened")
                spectrum = decomposition.singular_values
                marginal = linalg.rank_gains(spectrum, lam)[:, qk_before : problem.qk_dim_after]
            expected = linalg.predicted_decrease(problem.gradient, delta, problem.metric, lam)
            expected_kept = linalg.predicted_decrease(problem.gradient, delta_kept, problem.metric, lam)
            first_order = -(problem.gradient * delta).sum(dim=(-2, -1))
        return [
            HeadReport(
                layer=layer,
                head=head,
                expected_gain=float(expected[head]),
                expected_gain_without_growth=float(expected_kept[head]),
                first_order_gain=float(first_order[head]),
                marginal_gains=[float(g) for g in marginal[head]],
            )
            for head in range(len(expected))
        ]


def _merged_if_peft(model: PreTrainedModel) -> PreTrainedModel:
    """A PEFT-wrapped model's base model with its adapters merged in (on a copy: the input is left unchanged).

    Growth rewrites the full Q/K weights, so LoRA deltas must be part of them; the grown model is a plain
    grown model. (peft's own target-module tables list Q and V only; where Q/K live is the adapter's business.)
    """
    peft = sys.modules.get("peft")  # a PeftModel implies peft is imported; no import cost otherwise
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    logger.warning(
        "%s wraps PEFT adapters %s: growing a copy of its base model with the adapters merged in "
        "(merge_and_unload); the input model is left unchanged.",
        type(model).__name__,
        sorted(model.peft_config),
    )
    return copy.deepcopy(model).merge_and_unload()


def _check_statistics(statistics: GrowthStatistics, model: PreTrainedModel, adapter: ArchitectureAdapter) -> None:
    """Refuse statistics whose layers, heads or input width do not match ``model``, or that are not finite."""
    config = model.config
    if statistics.model_type is not None and statistics.model_type not in adapter.model_types:
        raise ValueError(
            f"the statistics were collected on a {statistics.model_type!r} model, not {config.model_type!r}: "
            "collect them on the model you grow."
        )
    layers, heads, width = len(adapter.attention_modules(model)), adapter.num_heads(config), adapter.hidden_size(config) + 1
    expected = (layers, (heads, width, width))
    found = (len(statistics.gradients), tuple(statistics.gradients[0].shape) if statistics.gradients else ())
    if found != expected:
        raise ValueError(
            f"the statistics were collected for another model: {found[0]} layers of M with shape {found[1]}, but "
            f"{type(model).__name__} has {layers} layers of {heads} heads over inputs of width {width - 1} (+1)."
        )
    for layer, (second_moment, gradient) in enumerate(zip(statistics.second_moments, statistics.gradients)):
        if not (torch.isfinite(second_moment).all() and torch.isfinite(gradient).all()):
            raise FloatingPointError(
                f"the statistics of layer {layer} hold NaN or Inf: collect them again (in float32 or float64)."
            )
    if statistics.weights is not None:
        weights = weight_sample(model)
        if weights.shape != statistics.weights.shape or float(
            (weights - statistics.weights).norm()
        ) > WEIGHTS_RTOL * float(statistics.weights.norm()):
            raise ValueError(
                "the statistics were collected on a model with other weights (another checkpoint of the same "
                "architecture): collect them on the model you grow."
            )


def _resolve_growth(p: int | Mapping[int, int], num_layers: int) -> list[int]:
    """Dimensions added per layer, validated before any work."""
    if isinstance(p, bool) or not isinstance(p, (int, Mapping)):
        raise TypeError(f"p must be an int or a mapping {{layer: int}}, got {type(p).__name__}")
    if isinstance(p, int):
        if p <= 0:
            raise ValueError(
                f"p must be a positive number of query/key dimensions to add per head, got {p}. "
                "(To take the same step without adding dimensions, pass p={layer: 0, ...}.)"
            )
        return [p] * num_layers
    unknown = [layer for layer in p if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if unknown:
        raise ValueError(f"p names layers {unknown} but the model has layers 0..{num_layers - 1}")
    negative = {layer: value for layer, value in p.items() if not isinstance(value, int) or value < 0}
    if negative:
        raise ValueError(f"p must map layers to non-negative ints, got {negative}")
    return [p.get(layer, 0) for layer in range(num_layers)]


def _warn_unaligned(qk_after: list[int], growth: list[int]) -> None:
    unaligned = sorted({dim for dim, extra in zip(qk_after, growth) if extra and dim % 8})
    if unaligned:
        warnings.warn(
            f"query/key widths {unaligned} are not multiples of 8; fused attention kernels are fastest with "
            "multiples of 8.",
            stacklevel=3,
        )


def _split_batches(
    dataloader: Iterable,
    eval_dataloader: Iterable | None,
    eval_fraction: float,
    needs_eval: bool,
) -> tuple[Iterable, list[dict[str, Tensor]] | None]:
    """Statistics batches and held-out batches (materialized: the line search reads them many times)."""
    if eval_dataloader is not None:
        eval_batches = list(eval_dataloader)
        if not eval_batches:
            raise ValueError("eval_dataloader yielded no batches.")
        return dataloader, eval_batches
    if not needs_eval:
        return dataloader, None
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    batches = list(dataloader)
    if len(batches) < 2:
        raise ValueError(
            f"the dataloader yielded {len(batches)} batch(es): the line search holds out the last "
            f"{eval_fraction:.0%} of at least 2 batches. Pass more data, an eval_dataloader, or a step_size."
        )
    num_eval = max(1, round(eval_fraction * len(batches)))
    if num_eval >= len(batches):
        raise ValueError(
            f"eval_fraction={eval_fraction} holds out all {len(batches)} batches, leaving none for the statistics: "
            "lower eval_fraction, pass more data or an eval_dataloader."
        )
    return batches[:-num_eval], batches[-num_eval:]


def _line_search(
    evaluate: Callable[[float], float],
    start: float,
    factor: float = 4.0,
    max_expansions: int = 12,
    refinements: int = 4,
) -> dict[float, float]:
    """Losses at the step sizes tried: 0, a log grid from ``start`` followed downhill, then a refined bracket.

    The grid steps down until a step beats step 0, then moves by ``factor`` while the loss falls; the
    bracket around the best grid point is then halved ``refinements`` times in log space (geometric means).
    A non-finite loss (a step that overflows in low precision) counts as +inf, so it is never the best.
    """
    losses: dict[float, float] = {}

    def loss(step: float) -> float:
        if step not in losses:
            value = evaluate(step)
            losses[step] = value if math.isfinite(value) else math.inf
        return losses[step]

    step = start
    for _ in range(max_expansions):
        if loss(step) < loss(0.0):
            break
        step /= factor
    else:
        return losses
    for _ in range(max_expansions):
        if loss(step * factor) < loss(step):
            step *= factor
        elif loss(step / factor) < loss(step):
            step /= factor
        else:
            break
    low, best, high = step / factor, step, step * factor
    for _ in range(refinements):
        probe = math.sqrt(best * high) if high / best >= best / low else math.sqrt(low * best)
        if loss(probe) < loss(best):
            low, high = (best, high) if probe > best else (low, best)
            best = probe
        else:
            low, high = (low, probe) if probe > best else (probe, high)
    return losses


def _best_step(losses: Mapping[float, float]) -> float:
    """The step of least loss; of equal losses the smallest step (step 0 wins a tie: nothing is gained)."""
    return min(losses, key=lambda step: (losses[step], step))


def _write_weights(adapter: ArchitectureAdapter, model: PreTrainedModel, weights: QKWeights) -> None:
    attentions = adapter.attention_modules(model)
    for layer, (query, key) in weights.items():
        adapter.write_qk(attentions[layer], query, key)


def grow_model(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    p: int | Mapping[int, int] | None = None,
    *,
    budget: int | None = None,
    multiple_of: int = 1,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None = None,
    step_size: float | None = None,
    truncation: str = DEFAULT_TRUNCATION,
    search: str = "exact",
    loss_fn: LossFn | None = None,
    max_batches: int | None = None,
    statistics: GrowthStatistics | None = None,
    eval_fraction: float = 0.1,
    initial_step_size: float = 0.03,
    rtol: float = 1e-6,
    measure_realized_gains: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    solver: str = "auto",
    statistics_method: str = "auto",
    query_block: int | None = None,
    memory_budget: int | str | None = None,
    accelerator: Accelerator | None = None,
    progress: bool = False,
) -> PreTrainedModel:
    """Grow the query/key width of every attention head by ``p``, with weights solved from the loss.

    Args:
        model: a supported transformers model (GPT-2 or BERT classes, or a model grown by hf_grow), or a
            PeftModel around one (its adapters are merged into a copy first). Left unchanged.
        dataloader: dict batches passed as ``model(**batch)``; the loss is ``outputs.loss`` (or ``loss_fn``).
        p: dimensions added per head, in every layer, or a mapping ``{layer: p}`` (missing layers get 0;
            layers with 0 keep their width but still take the step). Default 8; not with ``budget``.
        budget: instead of ``p``, a total of dimensions added per head, summed over layers, allocated from the
            statistics before the line search: greedily, ``multiple_of`` dimensions at a time, to the layer whose
            next dimensions have the largest expected gain summed over its heads (in the metric of C, whatever
            the ``truncation``). The gains are first-order in
            the step lam (`hf_grow.linalg.growth_gain_rates`); all scale with the same lam, so the allocation
            does not depend on it. ``growth_report.budget`` records it.
        multiple_of: the chunk of a budget allocation (e.g. 8 keeps widths multiples of 8 for fused kernels).
        eval_dataloader: held-out batches for the line search and the before/after losses. Without it, the
            last ``eval_fraction`` of the dataloader's batches are held out (when a line search runs).
        step_size: skip the line search and take this step (relative units, see the module docstring);
            ``0.0`` returns a grown model that computes exactly the old function.
        truncation: ``"whitened"`` (rank truncation in the metric of C, the default) or ``"frobenius"``.
        search: ``"exact"`` searches the rank-constrained update; ``"fast"`` first brackets the step with
            the full-rank update Z - lam P (no SVD per step, also reported as an upper reference), then
            refines the rank-constrained step from there.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor`` instead of ``outputs.loss``.
        max_batches: use at most this many statistics batches.
        statistics: statistics already collected for this model (e.g. by `collect_statistics`), to grow it
            several ways without reading the data again; ``dataloader`` may then be None when
            ``eval_dataloader`` or ``step_size`` is given.
        initial_step_size: where the log-grid search starts.
        rtol: relative eigenvalue tolerance of C for pseudo-inverse and whitening.
        measure_realized_gains: evaluate the held-out loss with each layer's step alone (one pass per layer).
        compute_dtype: precision of the per-batch statistics products (float32 or float64).
        solver: how truncations are computed, at every line-search step: ``"subspace"`` (top singular
            directions by subspace iteration, warm-started from the previous step), ``"eigh"`` (eigendecomposition
            of A A^T), ``"svd"`` (full SVD, several times slower), or ``"auto"`` (the default: subspace where
            the grown width plus 16 is at most a sixth of the hidden size, eigh otherwise); see
            `hf_grow.linalg.decompose`.
        statistics_method: ``"auto"`` (the default: by device and sequence length), ``"chunked"`` (sdpa
            attention, M accumulated block by block in backward), ``"triton"`` (the same, fused kernels on CUDA)
            or ``"reference"`` (eager attention with materialized score gradients); see `collect_statistics`.
        query_block: queries per block of the chunked path (default: sized to the memory of one block).
        memory_budget: bytes (or a string such as ``"2GB"``) for the statistics' accumulators: M is collected
            for groups of layers in several passes over ``dataloader`` (see `collect_statistics`).
        accelerator: an `accelerate.Accelerator` to grow with several processes: call grow_model on every
            process with its own shard of the data (statistics and held-out batches); statistics and held-out
            losses are summed over the processes, and every process returns the same grown model. ``model``
            may be wrapped by the accelerator or by DistributedDataParallel.
        progress: show progress bars (on the main process).

    Returns:
        The grown model (a new object of the grown model type, same device and dtype) with the
        `GrowthReport` as ``grown.growth_report``; `save_pretrained` writes it as ``growth_report.json``.
    """
    started = time.perf_counter()
    model = _merged_if_peft(unwrap_model(model, accelerator))
    progress = progress and Processes(accelerator).is_main
    prepared = _prepare_growth(
        model,
        dataloader,
        p,
        mode="refactor",
        budget=budget,
        multiple_of=multiple_of,
        eval_dataloader=eval_dataloader,
        step_size=step_size,
        initial_step_size=initial_step_size,
        truncation=truncation,
        search=search,
        loss_fn=loss_fn,
        max_batches=max_batches,
        statistics=statistics,
        eval_fraction=eval_fraction,
        rtol=rtol,
        compute_dtype=compute_dtype,
        solver=solver,
        statistics_method=statistics_method,
        query_block=query_block,
        memory_budget=memory_budget,
        accelerator=accelerator,
        progress=progress,
    )
    tick = time.perf_counter()
    grown = prepared.adapter.build_grown_model(model, prepared.qk_after, prepared.problem.weights(0.0))
    prepared.seconds["solve"] += time.perf_counter() - tick
    grown.growth_report = _search_and_report(
        prepared,
        grown,
        step_size=step_size,
        search=search,
        loss_fn=loss_fn,
        initial_step_size=initial_step_size,
        measure_realized_gains=measure_realized_gains,
        progress=progress,
        started=started,
    )
    return grown


@dataclass
class _PreparedGrowth:
    """A validated growth with its statistics solved: what remains is the target model and the line search."""

    model: PreTrainedModel
    adapter: ArchitectureAdapter
    qk_before: list[int]
    qk_after: list[int]
    max_rank: int
    statistics: GrowthStatistics
    eval_batches: list[dict[str, Tensor]] | None
    problem: _GrowthProblem
    parameters_before: int
    seconds: dict[str, float]
    accelerator: Accelerator | None
    budget: int | None


def _prepare_growth(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    p: int | Mapping[int, int] | None,
    *,
    mode: str,
    budget: int | None,
    multiple_of: int,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None,
    step_size: float | None,
    initial_step_size: float,
    truncation: str,
    search: str,
    loss_fn: LossFn | None,
    max_batches: int | None,
    statistics: GrowthStatistics | None,
    eval_fraction: float,
    rtol: float,
    compute_dtype: torch.dtype,
    solver: str,
    statistics_method: str,
    query_block: int | None,
    memory_budget: int | str | None,
    accelerator: Accelerator | None,
    progress: bool,
) -> _PreparedGrowth:
    """Validate the arguments (before any work), collect or check the statistics and solve the problem."""
    processes = Processes(accelerator)
    adapter = get_adapter(model)
    qk_before = adapter.qk_head_dims(model.config)
    max_rank = adapter.hidden_size(model.config) + 1
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    growth: list[int] | None = None
    if budget is not None:
        if p is not None:
            raise ValueError("give either p or budget, not both: a budget decides the dimensions added per layer.")
        check_budget(budget, multiple_of, [max_rank - dim for dim in qk_before])
    elif multiple_of != 1:
        raise ValueError("multiple_of applies to a budget allocation: pass budget=N with it, or leave it at 1.")
    else:
        growth = _resolve_growth(8 if p is None else p, len(qk_before))
        qk_after = [dim + extra for dim, extra in zip(qk_before, growth)]
        too_wide = {layer: dim for layer, dim in enumerate(qk_after) if dim > max_rank}
        if too_wide:
            raise ValueError(
                f"query/key widths {too_wide} exceed hidden_size + 1 = {max_rank}, the largest rank a head's scores "
                "can have: choose a smaller p."
            )
    if truncation not in linalg.TRUNCATIONS:
        raise ValueError(f"truncation must be one of {linalg.TRUNCATIONS}, got {truncation!r}")
    if solver not in linalg.SOLVERS:
        raise ValueError(f"solver must be one of {linalg.SOLVERS}, got {solver!r}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    if step_size is not None and (not math.isfinite(step_size) or step_size < 0):
        raise ValueError(f"step_size must be a finite number >= 0, got {step_size}")
    if not (math.isfinite(initial_step_size) and initial_step_size > 0):
        raise ValueError(
            f"initial_step_size must be a finite number > 0 (the first step tried), got {initial_step_size}"
        )
    linalg.check_rtol(rtol)
    if growth is not None:
        _warn_unaligned(qk_after, growth)

    seconds: dict[str, float] = {}
    tick = time.perf_counter()
    if statistics is None:
        if dataloader is None:
            raise ValueError("growth needs a dataloader, or statistics collected before.")
        check_statistics_arguments(
            statistics_method, next(model.parameters()).device, compute_dtype, query_block, max_batches, memory_budget
        )
    else:
        _check_statistics(statistics, model, adapter)
        if eval_dataloader is None and step_size is None:
            raise ValueError(
                "with precomputed statistics, pass an eval_dataloader for the line search (or a step_size)."
            )
    with processes.failing_together():  # a process without data must not leave the others waiting
        statistics_batches, eval_batches = _split_batches(dataloader, eval_dataloader, eval_fraction, step_size is None)
        eval_terms = None
        if eval_batches is not None:
            eval_terms = sum(batch_loss_weight(adapter, model, batch, loss_fn) for batch in eval_batches)
    if eval_terms is not None:  # found now, not after the statistics pass
        device = next(model.parameters()).device
        if processes.sum_(torch.tensor(eval_terms, dtype=torch.float64, device=device)).item() == 0:
            raise ValueError(_NO_LOSS_TERMS.format(data="the held-out data"))
    if statistics is None:
        statistics = collect_statistics(
            model,
            statistics_batches,
            adapter,
            loss_fn,
            max_batches,
            compute_dtype=compute_dtype,
            progress=progress,
            method=statistics_method,
            query_block=query_block,
            memory_budget=memory_budget,
            accelerator=accelerator,
        )
    seconds["statistics"] = time.perf_counter() - tick

    tick = time.perf_counter()
    if growth is None:
        problem = _GrowthProblem(model, adapter, statistics, qk_before, truncation, rtol, solver, mode)
        gains = [problem.gain_rates(layer).marginal.sum(dim=0) for layer in range(len(qk_before))]
        growth = allocate_budget(gains, budget, multiple_of)
        qk_after = [dim + extra for dim, extra in zip(qk_before, growth)]
        problem.widen(qk_after, adapter, model.config)
        _warn_unaligned(qk_after, growth)
    else:
        problem = _GrowthProblem(model, adapter, statistics, qk_after, truncation, rtol, solver, mode)
    seconds["solve"] = time.perf_counter() - tick
    return _PreparedGrowth(
        model, adapter, qk_before, qk_after, max_rank, statistics, eval_batches, problem, model.num_parameters(), seconds,
        accelerator, budget,
    )


def _search_and_report(
    prepared: _PreparedGrowth,
    target: PreTrainedModel,
    *,
    step_size: float | None,
    search: str,
    loss_fn: LossFn | None,
    initial_step_size: float,
    measure_realized_gains: bool,
    progress: bool,
    started: float,
) -> GrowthReport:
    """Line-search the step on ``target`` (a model of the grown widths), leave the chosen weights in it, report.

    ``target`` computes the old function on entry (the step-0 weights); on exit it holds the chosen step.
    """
    model, adapter, problem, eval_batches = prepared.model, prepared.adapter, prepared.problem, prepared.eval_batches
    qk_after, seconds, accelerator = prepared.qk_after, prepared.seconds, prepared.accelerator

    def evaluate(candidate: PreTrainedModel) -> float:
        return evaluate_loss(candidate, eval_batches, adapter, loss_fn, accelerator)[0]

    # The best step's weights as evaluated: the solve is warm-started, so solving the same step again could
    # differ from them by roundoff.
    evaluated: dict[str, Any] = {}

    def evaluate_step(step: float) -> float:
        weights = problem.weights(step)
        _write_weights(adapter, target, weights)
        loss = evaluate(target)
        if not evaluated or loss < evaluated["loss"]:
            evaluated.update(loss=loss, step=step, weights=weights)
        return loss

    tick = time.perf_counter()
    points: list[LineSearchPoint] = []
    unconstrained_loss = None
    eval_weight = 0
    loss_before = loss_after = None
    if eval_batches is not None:
        loss_before, eval_weight = evaluate_loss(target, eval_batches, adapter, loss_fn, accelerator)
    if step_size is None and not math.isfinite(loss_before):
        raise FloatingPointError(
            f"the held-out loss is {loss_before} before any step: the line search needs a finite loss. Check the "
            "held-out data, or load the model in a wider dtype (float16 overflows most easily)."
        )
    if step_size is None and problem.lam_unit == 0:
        logger.warning("the loss has zero gradient with respect to every head's scores: nothing to gain, step 0.")
        step_size, loss_after = 0.0, loss_before
    if step_size is None:
        with tqdm(desc="line search", unit="eval", disable=not progress) as bar:

            def tracked(kind: str, evaluate_at: Callable[[float], float]) -> Callable[[float], float]:
                def run(step: float) -> float:
                    loss = loss_before if step == 0 else evaluate_at(step)
                    points.append(LineSearchPoint(step, loss if math.isfinite(loss) else None, kind))
                    bar.update()
                    bar.set_postfix(step=f"{step:.3g}", loss=f"{loss:.4f}")
                    return loss

                return run

            start = initial_step_size
            if search == "fast":
                max_rank = prepared.max_rank
                full_rank = [max_rank] * len(qk_after)
                scalings = [adapter.scaling(model.config, layer, max_rank) for layer in range(len(qk_after))]
                reference = adapter.build_grown_model(target, full_rank, problem.unconstrained_weights(0.0, scalings))

                def evaluate_unconstrained(step: float) -> float:
                    _write_weights(adapter, reference, problem.unconstrained_weights(step, scalings))
                    return evaluate(reference)

                unconstrained = _line_search(tracked("unconstrained", evaluate_unconstrained), start)
                bracketed = _best_step(unconstrained)
                unconstrained_loss = unconstrained[bracketed]
                del reference
                # The rank-constrained optimum sits near the unconstrained one: a finer, shorter search.
                losses = _line_search(tracked("rank", evaluate_step), bracketed or start, factor=2.0, refinements=2)
            else:
                losses = _line_search(tracked("rank", evaluate_step), start)
        step_size = _best_step(losses)
        loss_after = losses[step_size]
    chosen = evaluated["weights"] if evaluated.get("step") == step_size else problem.weights(step_size)
    _write_weights(adapter, target, chosen)
    if eval_batches is not None and loss_after is None:
        loss_after = evaluate(target)
    seconds["line_search"] = time.perf_counter() - tick

    tick = time.perf_counter()
    realized: list[float | None] = [None] * len(qk_after)
    if measure_realized_gains and eval_batches is not None and step_size > 0:
        unchanged, stepped = problem.weights(0.0), chosen
        for layer in tqdm(range(len(qk_after)), desc="realized gains", unit="layer", disable=not progress):
            _write_weights(adapter, target, {**unchanged, layer: stepped[layer]})
            realized[layer] = loss_before - evaluate(target)
        _write_weights(adapter, target, stepped)
    layers = []
    for layer in range(len(problem.layers)):
        heads = problem.head_reports(layer, step_size)
        layers.append(
            LayerReport(
                layer=layer,
                qk_dim_before=prepared.qk_before[layer],
                qk_dim_after=qk_after[layer],
                expected_gain=sum(head.expected_gain for head in heads),
                realized_gain=realized[layer],
                heads=heads,
            )
        )
    seconds["report"] = time.perf_counter() - tick
    seconds["total"] = time.perf_counter() - started

    report = GrowthReport(
        model_class=type(model).__name__,
        model_type=model.config.model_type,
        truncation=problem.truncation,
        search=search,
        solver="+".join(sorted(problem.methods_used)) or problem.solver,
        mode=problem.mode,
        step_size=step_size,
        lam=problem.lam(step_size),
        eval_loss_before=loss_before,
        eval_loss_after=loss_after,
        unconstrained_eval_loss=unconstrained_loss,
        statistics_tokens=prepared.statistics.num_tokens,
        statistics_batches=prepared.statistics.num_batches,
        statistics_method=prepared.statistics.method,
        eval_weight=eval_weight,
        parameters_before=prepared.parameters_before,
        parameters_after=target.num_parameters(),
        seconds=seconds,
        line_search=points,
        layers=layers,
        budget=prepared.budget,
    )
    logger.info("grew %s: %s", type(model).__name__, report.summary())
    return report
