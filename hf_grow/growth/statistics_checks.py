"""Statistics checked against the model they are to grow, before any solve: their shapes, their values, the M each
process solves from and the weights they were collected on."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter
from ..statistics import GrowthStatistics, weight_sample
from .sharding import Sharding


#: Statistics whose weight sample differs from the model's in any entry by more than this (relative to the entry,
#: beside `WEIGHTS_ATOL`) are refused: loading the same checkpoint in bfloat16 changes an entry by at most 2^-8 of
#: it (float16 by 2^-11, or by 2^-25 below its normal range), while a fine-tuning step moves many entries by more.
WEIGHTS_RTOL = 1e-2
WEIGHTS_ATOL = 1e-6


def check_statistics(
    statistics: GrowthStatistics, model: PreTrainedModel, adapter: ArchitectureAdapter, cross_fit: bool = False,
    sharding: Sharding | None = None,
) -> None:
    """Refuse statistics whose layers, heads or input width do not match ``model``, that are not finite, that
    lack the halves ``cross_fit`` solves from, or the M of a layer this process solves (all of them, or with
    ``sharding`` the ones it owns)."""
    config = model.config
    if cross_fit and statistics.half_gradients is None:
        raise ValueError(
            "cross_fit needs statistics with two halves of M, which these do not hold: collect them with "
            "cross_fit=True (collect_statistics, or hf-grow inspect --cross-fit --save-stats)."
        )
    if statistics.model_type is not None and statistics.model_type not in adapter.model_types:
        raise ValueError(
            f"the statistics were collected on a {statistics.model_type!r} model, not {config.model_type!r}: "
            "collect them on the model you grow."
        )
    layers, heads = len(adapter.attention_modules(model)), adapter.num_heads(config)
    width = adapter.hidden_size(config) + 1
    expected = (layers, (heads, width, width))
    held = [layer for layer, sums in enumerate(statistics.gradients) if sums is not None]
    found = (len(statistics.gradients), tuple(statistics.gradients[held[0]].shape) if held else ())
    if found[0] != layers or (held and found[1] != expected[1]):
        raise ValueError(
            f"the statistics were collected for another model: {found[0]} layers of M with shape {found[1]}, but "
            f"{type(model).__name__} has {layers} layers of {heads} heads over inputs of width {width - 1} (+1)."
        )
    shapes = [("C", statistics.second_moments, (width, width)), ("M", statistics.gradients, expected[1]),
              ("M's half", statistics.half_gradients or [], expected[1])]
    for name, sums, shape in shapes:  # every layer's (a damaged file failed inside the solve)
        wrong = [(layer, tuple(tensor.shape)) for layer, tensor in enumerate(sums)
                 if tensor is not None and tuple(tensor.shape) != shape]
        if wrong or len(sums) not in ((layers,) if name == "C" else (0, layers)):
            raise ValueError(
                f"the statistics hold {name} of layer {wrong[0][0]} with shape {wrong[0][1]}, where "
                f"{type(model).__name__} needs {shape}: the file is damaged or of another model; collect them again."
                if wrong else f"the statistics hold {name} for {len(sums)} layers, where {type(model).__name__} has "
                f"{layers}: the file is damaged or of another model; collect them again."
            )
    missing = [layer for layer in range(layers) if layer not in held and (sharding is None or sharding.owns(layer))]
    if missing:
        owners = "" if sharding is None else (
            f" (this process solves layers {[layer for layer in range(layers) if sharding.owns(layer)]}; "
            f"hf_grow.growth.sharding.plan_owners([1.0] * {layers}, {sharding.processes.world_size}) names the "
            "owners growth solves on)")
        raise ValueError(
            f"the statistics hold no M for layers {missing}{owners}: M is freed once its layer is solved, and "
            "statistics collected with owners= hold only their owner's layers. Collect them again, without owners "
            "or with the owners growth solves on."
        )
    halves = statistics.half_gradients or [None] * layers
    for layer, sums in enumerate(zip(statistics.second_moments, statistics.gradients, halves)):
        if not all(torch.isfinite(tensor).all() for tensor in sums if tensor is not None):
            raise FloatingPointError(
                f"the statistics of layer {layer} hold NaN or Inf: collect them again (in float32 or float64)."
            )
        if (torch.diagonal(sums[0]) < 0).any():  # sums of squares; a damaged C was taken as one of no tokens
            raise ValueError(
                f"the statistics hold a C of layer {layer} with negative diagonal entries, which sums of squares "
                "cannot have: the file is damaged; collect them again."
            )
    if not next(model.parameters()).is_meta:  # a meta model has no weights yet
        check_weight_sample(weight_sample(model), statistics)


def check_weight_sample(weights: Tensor, statistics: GrowthStatistics) -> None:
    """Refuse ``statistics`` collected on other weights than those of ``weights`` (`weight_sample`, or
    `checkpoint_weight_sample` of a saved model), entry by entry within `WEIGHTS_RTOL` (a norm of the whole sample
    would be the LayerNorm gains' and miss fine-tuned matrices); statistics saved without one pass."""
    if statistics.weights is None:
        return
    if weights.shape != statistics.weights.shape or not torch.allclose(
        weights, statistics.weights, rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL
    ):
        raise ValueError(
            "the statistics were collected on a model with other weights (another checkpoint of the same "
            "architecture): collect them on the model you grow."
        )
