"""`inspect_growth`: what growing each head would gain, from the statistics alone, without changing the model.

The gains are first-order in the step (`hf_grow.linalg.growth_gain_rates`), in loss per unit step size (the
relative units of `grow_model`): at step size t, adding k dimensions to a head lowers the solve's local model (the
linear term less the penalty ||Delta||^2 / 2 lam) by about t times the sum of its first k marginal gains, and the
loss itself by about twice that, each head at its own lam = t * unit (``step_mode``: the head's unit by default,
its layer's with "per_layer"; the norms of the ``truncation``, as a budget takes them).
The line search picks t later, on held-out data, and one t serves every head, so the ranking of heads and layers
(what a budget allocation uses) does not depend on it. The step modes that also search each layer's step on the
held-out batches ("layer_search", "coordinate") rank at the per-layer units they start from: those searches
run after the widths are decided.
`grow_model`'s report lists the same quantities at the chosen step (``HeadReport.marginal_gains``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .adapters import get_adapter
from .config import GrowthConfig, resolve_config
from .distributed import unwrap_model
from .files import write_atomically, write_text_atomically
from .growth import GrowthProblem, check_statistics, collect_configured_statistics, merged_if_peft
from .growth.prepare import check_weights_in_memory
from .progress import stage
from .statistics import GrowthStatistics, LossFn, check_loss_fn


PLOT_EXTRA = "matplotlib is needed for plots: pip install 'hf_grow[plot]'"


@dataclass
class HeadInspection:
    """Expected gains of one head per unit step size: of the solve at its current width (``gain_without_growth``)
    and of each added dimension, largest first (``marginal_gains``)."""

    layer: int
    head: int
    gain_without_growth: float
    marginal_gains: list[float]


@dataclass
class LayerInspection:
    """One layer: its query/key width, the gains summed over its heads, and each head's."""

    layer: int
    qk_dim: int
    gain_without_growth: float
    marginal_gains: list[float]
    heads: list[HeadInspection]

    def gain(self, added: int) -> float:
        """Expected gain of adding ``added`` dimensions to every head of the layer (beyond the solve without growth)."""
        return sum(self.marginal_gains[:added])


@dataclass
class GrowthInspection:
    """Per layer and head, the expected gain of adding 1..``max_dims`` query/key dimensions (see the module doc)."""

    model_class: str
    model_type: str
    statistics_tokens: int
    statistics_batches: int
    #: lam per unit step size, the root mean square of the layers' units. With ``step_mode="global"`` (one lam for
    #: all) multiply a gain per unit step size by lam / lam_unit for an absolute step lam; per layer or per head
    #: each gain is at its layer's or head's own unit (‖Z‖/‖P‖ in the truncation's norm), which this mean does not
    #: give.
    lam_unit: float
    max_dims: int
    layers: list[LayerInspection] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GrowthInspection:
        data = {key: value for key, value in data.items() if key in {f.name for f in fields(cls)}}
        data["layers"] = [
            LayerInspection(**{**layer, "heads": [HeadInspection(**head) for head in layer["heads"]]})
            for layer in data.get("layers", [])
        ]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        write_text_atomically(path, self.to_json())

    def columns(self) -> list[int]:
        """The numbers of added dimensions the table shows: powers of two up to ``max_dims``, and ``max_dims``."""
        shown = [2**i for i in range(self.max_dims.bit_length()) if 2**i <= self.max_dims]
        return shown if shown[-1] == self.max_dims else [*shown, self.max_dims]

    def table(self, heads: bool = True) -> str:
        """Cumulative expected gains per layer (``all``) and head: at p = 0 and of adding k dimensions."""
        columns = self.columns()
        lines = [
            "expected loss decrease per unit step size, first order, of the solve's local model: the limit as t -> 0 "
            "(at a small step size t, the loss falls by about 2t x these; added dims gain less at larger steps); p=0: "
            "the solve at the current width, +k: adding k dims per head on top of it",
            f"{'layer':>5} {'head':>4} {'qk':>4} {'p=0':>9} " + " ".join(f"{'+' + str(k):>9}" for k in columns),
        ]

        def row(layer: int, head: str, qk_dim: int, without: float, marginal: list[float]) -> str:
            cumulative = " ".join(f"{sum(marginal[:k]):9.3g}" for k in columns)
            return f"{layer:5d} {head:>4} {qk_dim:4d} {without:9.3g} {cumulative}"

        for layer in self.layers:
            lines.append(row(layer.layer, "all", layer.qk_dim, layer.gain_without_growth, layer.marginal_gains))
            if heads:
                for head in layer.heads:
                    lines.append(
                        row(layer.layer, str(head.head), layer.qk_dim, head.gain_without_growth, head.marginal_gains)
                    )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """A PNG of the spectra: per layer, the marginal gain of each added dimension, per head and summed."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(PLOT_EXTRA) from None
        columns = min(4, len(self.layers))
        rows = -(-len(self.layers) // columns)
        figure = Figure(figsize=(3.2 * columns, 2.6 * rows), layout="constrained")
        axes = figure.subplots(rows, columns, squeeze=False, sharey=True)
        dims = range(1, self.max_dims + 1)
        for axis, layer in zip(axes.flat, self.layers):
            for head in layer.heads:
                axis.plot(dims, _positive(head.marginal_gains), color="tab:blue", alpha=0.35, linewidth=0.8)
            axis.plot(dims, _positive(layer.marginal_gains), color="black", linewidth=1.6, label="sum of heads")
            axis.set_yscale("log")
            axis.set_title(f"layer {layer.layer} (d_k {layer.qk_dim})", fontsize=9)
            axis.set_xlabel("added dimension", fontsize=8)
        for axis in axes.flat[len(self.layers) :]:
            axis.set_visible(False)
        axes[0, 0].set_ylabel("expected gain / step size", fontsize=8)
        axes[0, 0].legend(fontsize=7)
        figure.suptitle(f"{self.model_class}: first-order gain of each added query/key dimension", fontsize=10)
        write_atomically(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110))


def _positive(values: list[float]) -> list[float]:
    """Log axes cannot show zeros (dimensions beyond the data's rank): NaN leaves a gap instead."""
    return [value if value > 0 else float("nan") for value in values]


def inspect_growth(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None = None,
    *,
    config: GrowthConfig | None = None,
    statistics: GrowthStatistics | None = None,
    loss_fn: LossFn | None = None,
    max_batches: int | None = None,
    max_dims: int = 16,
    rtol: float | None = None,
    compute_dtype: torch.dtype | str | None = None,
    statistics_method: str | None = None,
    query_block: int | None = None,
    step_mode: str | None = None,
    truncation: str | None = None,
    progress: bool = False,
) -> GrowthInspection:
    """Expected gains of growing every head by 1..``max_dims`` dimensions, from one pass of statistics.

    Collects the statistics over ``dataloader`` (or takes ``statistics`` collected on this model, e.g. loaded
    with `GrowthStatistics.load`), solves the step direction of every head and reports the first-order gains
    (see the module docstring), per unit of the relative step size with each layer's lam as ``step_mode``
    sets it (the same as `grow_model`'s, so that rankings agree). Needs no held-out data and leaves the model
    unchanged.

    The statistics and solve options are those of a `GrowthConfig` (``config``, default ``GrowthConfig()``, e.g. the
    one you grow with): its ``rtol``, ``step_mode``, ``truncation``, ``max_batches``, ``compute_dtype``,
    ``statistics_method``, ``query_block``, ``memory_budget`` and ``cross_fit``; the keywords of the same names, when
    not None, replace them. The gains are in the metric of C, per unit of the step size with each layer's lam in
    the units of the ``truncation`` and ``step_mode`` (of "auto", the simplest candidate's), as a budget allocates
    them; the other options do not apply here. Collected here, each group of layers' M is solved and freed once its
    pass is done (as in `grow_model`): with a ``memory_budget``, no more than a group's M is held at a time.
    """
    if isinstance(max_dims, bool) or not isinstance(max_dims, int) or max_dims <= 0:
        raise ValueError(f"max_dims must be a positive int, got {max_dims!r}")
    overrides = dict(
        max_batches=max_batches, rtol=rtol, compute_dtype=compute_dtype, statistics_method=statistics_method,
        query_block=query_block, step_mode=step_mode, truncation=truncation,
    )
    config = resolve_config(config, {name: value for name, value in overrides.items() if value is not None})
    model = merged_if_peft(unwrap_model(model))  # as grow_model takes it: compiled, DDP or accelerate-wrapped
    adapter = get_adapter(model)
    check_weights_in_memory(model)  # offloaded weights: the solve reads Q/K after the statistics pass
    check_loss_fn(loss_fn)
    qk_dims = adapter.qk_head_dims(model.config)
    truncation, step_mode = config.candidates[0]  # as a budget ranks: the simplest of "auto" options

    def solve(statistics: GrowthStatistics, layers: Iterable[int], release: bool) -> GrowthProblem:
        return GrowthProblem(
            model, adapter, statistics, qk_dims, truncation, config.rtol, "eigh", step_mode=step_mode,
            mode=adapter.growth_modes[0], with_rates=True, cross_fit=config.cross_fit, layers=layers, release=release,
        )

    problem: GrowthProblem | None = None
    if statistics is None:
        if dataloader is None:
            raise ValueError("inspect_growth needs a dataloader, or statistics collected before.")

        def solve_group(collected: GrowthStatistics, layers: list[int]) -> None:
            # as `grow_model`: each group of layers is solved, and its M freed, once its pass is done
            nonlocal problem
            with stage("gains", enabled=progress):
                if problem is None:
                    problem = solve(collected, layers, release=True)
                else:
                    problem.solve_layers(layers)

        statistics = collect_configured_statistics(
            model, dataloader, adapter, loss_fn, config, progress=progress, on_group=solve_group
        )
    else:
        check_statistics(statistics, model, adapter, config.cross_fit)
        with stage("gains", enabled=progress):
            problem = solve(statistics, range(len(qk_dims)), release=False)
    layers = []
    for layer, qk_dim in enumerate(qk_dims):
        rates = problem.gain_rates(layer)
        marginal = torch.nn.functional.pad(rates.marginal, (0, max(0, max_dims - rates.marginal.shape[-1])))
        marginal = marginal[:, :max_dims]
        heads = [
            HeadInspection(layer, head, float(rates.without_growth[head]), [float(g) for g in marginal[head]])
            for head in range(marginal.shape[0])
        ]
        layers.append(
            LayerInspection(
                layer=layer,
                qk_dim=qk_dim,
                gain_without_growth=float(rates.without_growth.sum()),
                marginal_gains=[float(g) for g in marginal.sum(dim=0)],
                heads=heads,
            )
        )
    return GrowthInspection(
        model_class=type(model).__name__,
        model_type=model.config.model_type,
        statistics_tokens=statistics.num_tokens,
        statistics_batches=statistics.num_batches,
        lam_unit=problem.lam_unit,
        max_dims=max_dims,
        layers=layers,
    )
