"""The solve problem: statistics and Q/K weights in, the weights of the grown widths at any step size out.

Per layer, Z = scaling * W'_Q W'_K^T, the direction P = C^+ M C^+ and the metric of C (see `hf_grow.linalg`),
all in float64, solved once into the compact form of `hf_grow.compact`; per step, the rank-(d_k + p)
truncation of Z - lam P (on small matrices) factored into wider W_Q, W_K.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .. import compact, linalg
from ..adapters import ArchitectureAdapter, scale_dims_after_growth
from ..config import SIMPLEST_STEP_MODE, STEP_MODES
from ..statistics import GrowthStatistics, return_free_memory
from .layer_solve import LayerProblem, decomposition_method, solve_layer
from .sharding import Sharding
from .step_scaling import StepScaling


QKWeights = dict[int, tuple[Tensor, Tensor]]
#: Each layer's `StepWeights.decomposition` at one step (the chosen one's, for the report), by layer.
Decompositions = dict[int, linalg.Decomposition]


class StepWeights(StepScaling):
    """The Q/K weights of a solved problem at any step size: each layer's compact target ("refactor") or unit
    update ("append"), at the head lams of its `StepScaling`. Needs ``layers`` solved, ``mode``, ``truncation``
    and ``solver``; touches no (heads, d, d) tensor."""

    layers: list[LayerProblem]
    mode: str
    solver: str
    #: Refactored factors written times the DCT-II matrix (`linalg.dct_rotation`): the same scores.
    rotate_factors: bool = False

    def decomposition(
        self, layer: int, step_size: float, truncation: str, columns: int | None = None
    ) -> linalg.Decomposition:
        """The decomposition of layer's compact ``Z - lam P`` in the ``truncation``'s norm, in core coordinates:
        its truncations (up to rank ``columns``, None: any) map to Q/K factors by the target's bases
        (`compact.CompactTarget.to_model`)."""
        method = "svd" if self.solver == "svd" else "eigh"
        lams = self.head_lams(step_size, layer)
        return self.layers[layer].target.decompose(lams, method, columns, truncation)

    def unit_update(self, layer: int) -> linalg.Factorization:
        """The "append" update at lam = 1: the truncation of -P to the layer's added dimensions; under
        grouped-query attention, the joint truncation of each group's heads with one key."""
        problem = self.layers[layer]
        added = problem.qk_dim_after - problem.query.shape[-1]
        unit = problem.updates[self.truncation].unit
        return linalg.Factorization(unit.left[..., :added], unit.right[..., :added], unit.singular_values)

    def weights(self, step_size: float, decompositions: Decompositions | None = None) -> QKWeights:
        """Augmented Q/K weights of the grown width for every layer (see `layer_weights`, which reads and fills
        ``decompositions``)."""
        return {layer: self.layer_weights(layer, step_size, decompositions) for layer in range(len(self.layers))}

    def layer_weights(
        self, layer: int, step_size: float, decompositions: Decompositions | None = None
    ) -> tuple[Tensor, Tensor]:
        """Augmented Q/K weights of ``layer`` at its own lam for ``step_size``. Step size 0 is exactly the old
        function: the old weights, zero-padded, with the change of scale folded into the queries (so in a
        bfloat16 or float16 model, up to the rounding of those queries). In "append" mode the old weights are
        kept at every step (layers without added dimensions do not change). With ``sharding``, computed by the
        layer's owner and broadcast: every process must ask for the same layers in the same order.

        ``decompositions``: the layers' `decomposition` at this step and lams ("refactor", lam > 0), by layer:
        one found there is used instead of decomposing again (the same weights, bit for bit, for a fraction of
        the cost), one made is put there, so that the line search keeps its best step's for the report (with
        ``sharding``, on the layer's owner only: it alone decomposes)."""
        return self.owner_computes(layer, lambda: self._own_layer_weights(layer, step_size, decompositions))

    def owner_computes(self, layer: int, compute: Callable[[], Any]) -> Any:
        """``compute()`` of ``layer``: here, or with ``sharding`` on the layer's owner, broadcast to every process
        (on the device of this process's statistics). Every process must call it, in the same order."""
        if self.sharding is None:
            return compute()
        return self.sharding.computed(layer, compute, self.statistics.second_moments[layer].device)

    def _own_layer_weights(
        self, layer: int, step_size: float, decompositions: Decompositions | None
    ) -> tuple[Tensor, Tensor]:
        problem = self.layers[layer]
        lam = self.lam(step_size, layer)
        with torch.no_grad():
            if self.mode == "append" and problem.qk_dim_after > problem.query.shape[-1]:
                update = linalg.rescaled_to_step(self.unit_update(layer), self.head_lams(step_size, layer))
                if problem.groups < problem.query.shape[0]:  # one key per group (repeated in the update)
                    per_group = problem.query.shape[0] // problem.groups
                    update = linalg.Factorization(update.left, update.right[::per_group], update.singular_values)
                return linalg.appended_weights(
                    problem.query, problem.key, problem.scaling_before, problem.scaling_after, update
                )
            if lam == 0 or self.mode == "append":
                padding = problem.qk_dim_after - problem.query.shape[-1]
                fold = problem.scaling_before / problem.scaling_after
                return (
                    torch.nn.functional.pad(problem.query * fold, (0, padding)),
                    torch.nn.functional.pad(problem.key, (0, padding)),
                )
            target = problem.target
            width = problem.qk_dim_after
            decomposition = (decompositions or {}).get(layer)
            if decomposition is None:
                decomposition = self.decomposition(layer, step_size, self.truncation, width)
                if decompositions is not None:
                    decompositions[layer] = decomposition
            factors = target.to_model(decomposition.truncate(width))
            root_scaling = math.sqrt(problem.scaling_after)
            query, key = factors.left / root_scaling, factors.right / root_scaling
            if self.rotate_factors:
                rotation = linalg.dct_rotation(width, query.dtype, query.device)
                query, key = query @ rotation, key @ rotation
            return query, key


class GrowthProblem(StepWeights):
    """The solved statistics of a model: Q/K weights for any step size (`StepWeights`), and what they are expected
    to gain.

    Each layer is solved once at construction (`solve_layer`): after that no step touches a (heads, d, d)
    tensor, and the statistics' M may be freed layer by layer (``release``). ``cross_fit``: solve from the
    cross-fitted M (`GrowthStatistics.cross_fitted_gradient`; the statistics must hold its halves).
    ``sharding``: several processes solve together, each the layers it owns (whose M it must hold) and keeps;
    the others get their skeletons once all are solved (`sharding.skeleton`), and their weights at each step
    (`owner_computes`): every process must then solve the same layers, and ask for their weights, in the same
    order.
    """

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
        step_mode: str = SIMPLEST_STEP_MODE,
        *,
        max_dims_after: list[int] | None = None,
        with_rates: bool = False,
        layers: Iterable[int] | None = None,
        release: bool = False,
        cross_fit: bool = False,
        sharding: Sharding | None = None,
        keep_attention_scale: bool = False,
        rotate_factors: bool = False,
    ):
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {step_mode!r}")
        self.statistics = statistics
        self.step_mode = step_mode
        self.truncation = truncation
        self.solver = solver
        self.mode = mode
        #: The decomposition methods the solver ran (``"auto"`` resolves per size).
        self.methods_used: set[str] = set()
        self._model, self._adapter, self._rtol = model, adapter, rtol
        self._with_rates, self._release = with_rates, release
        self.cross_fit = cross_fit
        self.sharding = sharding
        self._requested: list[int] = []  # the layers asked for, in order: shared once every layer is
        self._methods: dict[int, set[str]] = {}
        self._max_dims = list(max_dims_after or qk_dims_after)
        self._qk_dims_after = list(qk_dims_after)
        self.keep_attention_scale = keep_attention_scale
        self.rotate_factors = rotate_factors
        self._qk_dims_before = adapter.qk_head_dims(model.config)  # before an in-place growth changes the config
        self._scale_dims_before = adapter.attention_scale_dims(model.config)
        self._attentions = adapter.attention_modules(model)
        self.layers: list[LayerProblem | None] = [None] * len(self._attentions)
        #: Each layer's step relative to the others: lam_l = step_size * layer_lam_units[l] * layer_scales[l].
        #: 1 everywhere unless a search per layer (step modes "layer_search", "coordinate") set them.
        self.layer_scales: list[float] = [1.0] * len(self.layers)
        self.solve_layers(range(len(self.layers)) if layers is None else layers)

    def solve_layers(self, layers: Iterable[int]) -> None:
        """Solve ``layers`` from the statistics (their M must be there), freeing each M after (``release``); the
        steps are set once every layer is solved. With ``sharding``, this process solves the ones it owns, and
        every process gets every layer once all have been asked for."""
        layers = list(layers)
        self._requested += layers
        if self.sharding is None:
            self._solve(layers)
        else:
            with self.sharding.processes.failing_together():  # a failed solve must not leave the others waiting
                self._solve([layer for layer in layers if self.sharding.owns(layer)])
            if sorted(self._requested) == list(range(len(self.layers))):
                devices = [moment.device for moment in self.statistics.second_moments]
                self.sharding.share_skeletons(self.layers, self._methods, devices)
        if all(part is not None for part in self.layers):
            self.set_step_mode(self.step_mode)
        self.methods_used = set().union(*self._methods.values())

    def _solve(self, layers: list[int]) -> None:
        truncations = (self.truncation,) if self.truncation == "whitened" else (self.truncation, "whitened")
        config = self._model.config
        scale_dims_after = self.attention_scale_dims(self._qk_dims_after)
        with torch.no_grad():
            for layer in layers:
                part = _layer_problem(
                    self._adapter, self._attentions[layer], self.statistics, layer,
                    scaling_before=self._adapter.scaling(config, layer, self._scale_dims_before[layer]),
                    scaling_after=self._adapter.scaling(config, layer, scale_dims_after[layer]),
                    qk_dim_after=self._qk_dims_after[layer],
                    rtol=self._rtol,
                )
                gradient = _gradient_source(
                    self.statistics, layer, part, self.cross_fit, self._max_dims[layer], self.solver, self.mode
                )
                self._methods[layer] = solve_layer(
                    part, gradient, self.mode, truncations, self._max_dims[layer], self.solver, self._with_rates
                )
                _check_finite_step(part, layer)
                self.layers[layer] = part
                if self._release:
                    self.statistics.release(layer)
                return_free_memory()  # the layer's transients, ~0.3 GiB at GPT-2 small, stayed in the heap

    def holds(self, truncation: str) -> bool:
        """Whether the solve can step with ``truncation``: its compact target with the certificate that truncation
        reports ("refactor"), or its unit update ("append"). A problem solved for Frobenius truncation holds the
        whitened one too."""
        def held(part: LayerProblem) -> bool:
            if self.mode == "append":
                return truncation in part.updates
            return part.target is not None and (truncation == "whitened" or part.target.plain_tail is not None)

        return all(held(part) for part in self.layers)

    def set_truncation(self, truncation: str) -> None:
        """Truncate the ``truncation`` way from now on, without solving again (it must be `held`)."""
        if not self.holds(truncation):
            raise ValueError(f"this problem was not solved for {truncation!r} truncation: solve it again")
        self.truncation = truncation
        self.set_step_mode(self.step_mode)

    def widen(self, qk_dims_after: list[int], adapter: ArchitectureAdapter, config) -> None:
        """Set the grown widths (decided after the statistics, e.g. by a budget), at most ``max_dims_after``."""
        too_wide = [layer for layer, dim in enumerate(qk_dims_after) if dim > self._max_dims[layer]]
        if too_wide:
            raise ValueError(f"layers {too_wide} were solved for narrower widths {self._max_dims}")
        scale_dims_after = self.attention_scale_dims(qk_dims_after)
        for layer, problem in enumerate(self.layers):
            problem.qk_dim_after = qk_dims_after[layer]
            problem.scaling_after = adapter.scaling(config, layer, scale_dims_after[layer])

    def attention_scale_dims(self, qk_dims_after: list[int]) -> list[int]:
        """The widths whose attention scale the layers take once grown to ``qk_dims_after`` (the grown config's
        `attention_scale_dims`): the new widths, or the old scales with ``keep_attention_scale``."""
        return scale_dims_after_growth(
            self._qk_dims_before, self._scale_dims_before, qk_dims_after, self.keep_attention_scale
        )

    def gain_rates(self, layer: int) -> linalg.GainRates:
        """First-order expected gains of ``layer`` per unit step size (see `linalg.growth_gain_rates`): solved with
        ``with_rates=True`` only."""
        rates = self.layers[layer].rates
        if rates is None:
            raise RuntimeError("gain rates are computed with the solve: build the problem with with_rates=True")
        unit = self.layer_lam_units[layer] * self.head_factors[layer]  # each head's, before any search per layer
        return linalg.GainRates(rates.without_growth * unit, rates.marginal * unit[:, None])


def _check_finite_step(part: LayerProblem, layer: int) -> None:
    """A step norm that is not finite would make the layer's lam 0, silently: refused, naming the heads."""
    step_norms = part.norms["whitened"][1]
    if not torch.isfinite(step_norms).all():
        heads = torch.nonzero(~torch.isfinite(step_norms)).flatten().tolist()
        raise FloatingPointError(
            f"layer {layer}'s statistics give a non-finite step for heads {heads}: M or C holds NaN or Inf "
            "(collect_statistics refuses such statistics; check statistics made or changed by hand)"
        )


def _layer_problem(
    adapter: ArchitectureAdapter,
    attention: torch.nn.Module,
    statistics: GrowthStatistics,
    layer: int,
    *,
    scaling_before: float,
    scaling_after: float,
    qk_dim_after: int,
    rtol: float,
) -> LayerProblem:
    """``layer``'s problem before its solve: its Q/K weights in float64 on the statistics' device, its attention
    scales before and after growth, and the metric of its C at relative tolerance ``rtol``."""
    query, key = adapter.read_qk(attention)
    device = statistics.gradients[layer].device  # no reference to M past its release
    inputs = query.shape[-2]
    second_moment = statistics.mean_second_moment(layer)[:inputs, :inputs]
    return LayerProblem(
        query=query.to(device, torch.float64),
        key=key.to(device, torch.float64),
        scaling_before=scaling_before,
        scaling_after=scaling_after,
        qk_dim_after=qk_dim_after,
        metric=linalg.metric_from_second_moment(second_moment, rtol=rtol),
        norms={},
    )


def _gradient_source(
    statistics: GrowthStatistics,
    layer: int,
    part: LayerProblem,
    cross_fit: bool,
    widest: int,
    solver: str,
    mode: str,
) -> Callable[[slice], Tensor]:
    """M of the heads of ``layer`` over its inputs in C's eigenbasis (U^T M U), as `solve_layer` asks for it: the
    mean over all batches, or with ``cross_fit`` the cross-fitted mean, keeping the top directions a truncation up
    to width ``widest`` could use (the compact rank) found by the solve's own decomposition method."""
    inputs = part.query.shape[-2]
    if not cross_fit:
        return lambda heads: part.metric.to_basis(statistics.mean_gradient(layer, heads)[:, :inputs, :inputs])
    added = max(1, widest - part.query.shape[-1])
    method = decomposition_method(solver, mode, inputs, added, part.query.shape[0] // part.groups)
    rank = compact.compact_rank(inputs, widest)
    return lambda heads: statistics.cross_fitted_gradient(layer, part.metric, rank, method, heads, in_basis=True)


def write_weights(adapter: ArchitectureAdapter, model: PreTrainedModel, weights: QKWeights) -> None:
    attentions = adapter.attention_modules(model)
    for layer, (query, key) in weights.items():
        adapter.write_qk(attentions[layer], query, key)
