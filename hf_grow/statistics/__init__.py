"""First-order statistics of the attention scores, collected over a dataloader.

Per layer, C = sum X'^T X' over non-padding tokens; per head, M_i = sum X'^T G_i X' with G_i = dLoss/dS_i
the gradient of the loss with respect to the pre-softmax scores S_i (scale included, mask excluded).
M_i is exactly dLoss/dZ_i for the bilinear form Z_i of `hf_grow.linalg`.

The package, one job a module: `kernels` (the attention under collection and the M products: methods
"chunked", "triton", "reference"), `collector` (the hooks that accumulate C and M on a batch), `collect`
(`collect_statistics` over a dataloader, in one or several passes), `container` (`GrowthStatistics` and its
file format), `memory` (the accumulators' bytes and the layer groups of a memory budget), `offload` (M's
accumulators in memory-mapped files), `batches` (batches, loss terms and losses as the statistics and the line
search see them).
"""

from .batches import (
    LossFn,
    batch_loss_weight,
    check_batch,
    check_labels,
    check_loss_fn,
    compute_loss,
    describe,
    iterate_batches,
    map_tensors,
    module_modes,
    restore_modes,
    token_shapes,
    walk_tensors,
    without_kv_cache,
)
from ..option_values import STATISTICS_METHODS as METHODS
from ..option_values import is_positive_int, parse_bytes
from .collect import check_method_runs, check_statistics_arguments, collect_statistics
from .container import STATISTICS_FORMAT, GrowthStatistics, checkpoint_weight_sample, weight_sample
from .kernels import (
    CPU_REFERENCE_MAX_LENGTH,
    STATISTICS_ATTENTION,
    choose_method,
    default_query_block,
    score_gradient_products,
    statistics_attention,
    triton_available,
)
from .memory import layer_groups, m_copies, return_free_memory, statistics_bytes
from .offload import OFFLOAD_PREFIX, check_offload_dir


__all__ = [
    "CPU_REFERENCE_MAX_LENGTH",
    "METHODS",
    "OFFLOAD_PREFIX",
    "STATISTICS_ATTENTION",
    "STATISTICS_FORMAT",
    "GrowthStatistics",
    "LossFn",
    "batch_loss_weight",
    "check_batch",
    "check_labels",
    "check_loss_fn",
    "check_method_runs",
    "check_statistics_arguments",
    "is_positive_int",
    "check_offload_dir",
    "choose_method",
    "collect_statistics",
    "compute_loss",
    "describe",
    "default_query_block",
    "iterate_batches",
    "layer_groups",
    "m_copies",
    "map_tensors",
    "module_modes",
    "parse_bytes",
    "return_free_memory",
    "restore_modes",
    "score_gradient_products",
    "statistics_attention",
    "statistics_bytes",
    "token_shapes",
    "triton_available",
    "walk_tensors",
    "checkpoint_weight_sample",
    "weight_sample",
    "without_kv_cache",
]
