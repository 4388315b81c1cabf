"""`grow_model`: statistics, solve, line search and the grown model, with its report.

The step: per head, Z_new = best rank-(d_k + p) approximation of Z - lam_lh * P with P = C^+ M C^+ (see
`hf_grow.linalg`), the step size chosen on held-out batches. Step sizes are searched in relative units,
``lam_lh = step_size * unit_lh`` with ``unit_lh = ||Z_lh|| / ||P_lh||`` of the head (step mode "per_head"),
of its layer ("per_layer"), or one unit over all heads ("global"): at step size 1 the update lam P is as large
as Z itself in the norm of the truncation (of C, whitened, or Frobenius); the scores and weights
may move more (on MiniLM the searched 0.042 moved each head's Z by a median 47% in the plain Frobenius norm,
BENCHMARKS.md). The step modes "layer_search" and "coordinate" also search each layer's own step
(`layer_steps`). By default (step mode "auto") the held-out loss chooses steps per head or per layer for
whitened truncation; with truncation "auto" it chooses the truncation too (`candidates`).

The package, one job a module: `problem` (the solve: weights at any step size), `head_reports` (what each
head is expected to gain), `line_search` (held-out loss and the search over step sizes), `prepare`
(validation before any work, statistics, the solved problem), `search` (the line search on the grown model
and its report), `layer_steps` (searches of each layer's step, held-out passes that replay unchanged blocks),
`candidates` (with "auto" options: each candidate's line search, the choice confirmed on held-out batches the
search did not use), `sharding` (with several processes, each layer's owner, which alone holds its M and solves
it), `api` (`grow_model`).
"""

from .api import grow_model
from .line_search import best_step, evaluate_loss, search_step_size, split_batches
from ..config import AUTO_CHOICES, DEFAULT_TRUNCATION, SEARCHES, STEP_MODES
from .prepare import (
    PreparedGrowth,
    check_fast_search,
    check_growth,
    check_memory_budget,
    collect_configured_statistics,
    merged_if_peft,
    prepare_growth,
    resolve_growth,
)
from .statistics_checks import WEIGHTS_RTOL, check_statistics, check_weight_sample
from ..option_values import SOLVED_MODES as MODES
from .problem import GrowthProblem, QKWeights, write_weights
from .candidates import search_and_report


__all__ = [
    "AUTO_CHOICES",
    "DEFAULT_TRUNCATION",
    "MODES",
    "SEARCHES",
    "STEP_MODES",
    "WEIGHTS_RTOL",
    "GrowthProblem",
    "PreparedGrowth",
    "QKWeights",
    "best_step",
    "check_fast_search",
    "check_growth",
    "check_memory_budget",
    "check_statistics",
    "check_weight_sample",
    "collect_configured_statistics",
    "evaluate_loss",
    "grow_model",
    "search_step_size",
    "merged_if_peft",
    "prepare_growth",
    "resolve_growth",
    "search_and_report",
    "split_batches",
    "write_weights",
]
