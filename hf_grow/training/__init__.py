"""Growth during training: widen the query/key heads of a model in place, so that its optimizer carries on.

`grow_model` returns a new model; inside a training loop the model object, its Parameters and the optimizer
must survive. Here the model is already of a grown type (built from a grown config, or converted once with
`to_grown_model` before the optimizer is created), and growth resizes its Q/K Parameters in place
(``param.data = ...``: the optimizer's param_groups, the LR scheduler and the Trainer keep working) and remaps
the optimizer state: moments of entries that keep their meaning are kept, new entries start at zero (or, with
``new_moments="head_mean"``, their second moments at their head's; see `hf_grow.optimizer_state`), the step
count is kept.

Growth modes (the first two solved from the loss statistics, the last two baselines without statistics):

- ``"refactor"``: every Q/K weight becomes the rank-(d_k + p) truncation of Z - lam P (`grow_model`'s solve);
  their optimizer moments are reset to zero, since no old entry keeps its meaning.
- ``"append"`` (the default): the old Q/K weights are kept (with ``keep_attention_scale=False`` the change of
  attention scale is folded into the queries) and the p new dimensions hold the best rank-p approximation of the
  step -lam P in the metric of C; the moments of the old entries are kept (the queries' rescaled where folded).
- ``"zero"``: plain function-preserving widening: new query dims random (``init_std``), new key dims zero.
- ``"random"``: new query and key dims both random (``init_std``): not function-preserving.

With Adam, entries whose moments start at zero while the step count is large take up to a few times the
usual update size for their first ~1/(1 - beta2) steps (the bias correction assumes moments of age ``step``);
``new_moments="head_mean"`` avoids that; it measured no better on the plateau task, and worse inside
`transformers.Trainer` (BENCHMARKS.md), so it is not the default.

The default ``mode="append"`` (since 2026-11-27; before, ``"refactor"``) is what measured best of the two solved
modes in language-model pretraining with `GrowthCallback` on CPU models (ahead of the original in the mean in every
setting measured, with a shallower dip after the growth than refactor's, within the seed spread; level with zero
widening with the scale kept on the largest of them; on the H100 model refactor was ahead of it within the
spread); ``"refactor"`` left a retrieval plateau earlier (`recipes/benchmarks/bench_bottleneck.py`,
`recipes/benchmarks/bench_growth_callback.py`, BENCHMARKS.md).
"""

from .callback import GrowthCallback
from .grow import DEFAULT_MODE, GROWTH_MODES, grow_in_training
from .peft_base import save_grown_base
from .resize import OPTIMIZER_STATE_DEGREES, resize_qk_, to_grown_model

__all__ = [
    "DEFAULT_MODE",
    "GROWTH_MODES",
    "OPTIMIZER_STATE_DEGREES",
    "GrowthCallback",
    "grow_in_training",
    "resize_qk_",
    "save_grown_base",
    "to_grown_model",
]
