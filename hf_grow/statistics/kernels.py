"""The attention of a model under statistics collection, and the products M_i = sum X'^T G_i X' it feeds.

Three methods, with the same result:

- ``"chunked"``: the model runs sdpa attention, as in training; in backward, a hook on each attention output
  receives dLoss/dO and accumulates M one block of queries at a time, the way flash-attention's backward
  computes dQ (recompute the block's softmax P, dP = dO V^T, G = P * (dP - rowsum(P * dP)), M += X'^T (G X')).
  No b * h * s * s tensor is ever held: memory per block is b * h * block * s.
- ``"triton"``: the same, with fused kernels (`hf_grow.statistics.triton_kernels`) that keep each tile of G on
  chip.
- ``"reference"``: eager attention whose materialized scores hand their gradient G to a hook.

``"auto"`` (the default) picks per batch by device and sequence length (`choose_method`). Where a query may
attend to no key at all (a pad position before the first token of a left-padded sequence), sdpa gives it a zero
output and eager a uniform average: ``"auto"`` keeps the model's own convention (eager models get the
reference method), while ``"chunked"`` or ``"triton"`` forced on an eager model follow sdpa's.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


class AttentionObserver(Protocol):
    """What `statistics_attention` asks of the observer a module is registered with
    (`collector.GradientProducts`), stated here so that this module imports nothing of the collector's, which
    imports it."""

    #: The method of the forward pass under way: "reference", "chunked" or "triton".
    batch_method: str
    #: The model normally runs eager attention (whose fully masked rows the statistics keep).
    eager_model: bool

    def collects(self, layer: int) -> bool:
        """Whether this pass collects M of ``layer``."""

    def score_hook(self, layer: int) -> Callable[[Tensor], None] | None:
        """The reference method: the hook that receives G = dLoss/dS of ``layer``."""

    def on_attention_output(
        self, layer: int, output: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
        scaling: float, is_causal: bool,
    ) -> None:
        """The chunked and triton methods: ``layer``'s attention output, whose gradient brings M."""


STATISTICS_ATTENTION = "hf_grow_statistics"
# Up to this many tokens per sequence the reference method is the faster one on a CPU (BENCHMARKS.md).
CPU_REFERENCE_MAX_LENGTH = 256

# Per attention module of the model under collection: the collector and the layer. Read by `statistics_attention`.
COLLECTING: dict[nn.Module, tuple[AttentionObserver, int]] = {}

# Elements of one (b, h, block, s) float tensor in the chunked path. On a CPU, 2^21 float32 numbers
# (8 MiB) stay in cache and skip most of a causal mask's upper triangle: 1.2-1.9x faster than 1024-query blocks
# from 1024 tokens on, in the training step's memory (BENCHMARKS.md). On a GPU, 2^26 (256 MiB) keeps kernels busy.
_CPU_BLOCK_ELEMENTS = 2**21
_GPU_BLOCK_ELEMENTS = 2**26
# Fewer queries per block than this cost more in per-block overhead than they save in memory (2.3x a training
# step at 8 queries, 1.35x at 32, on a CPU at batch 8 x 2048 tokens: BENCHMARKS.md).
_MIN_QUERY_BLOCK = 32


def statistics_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention of a model whose statistics are being collected.

    For the chunked and triton methods, transformers' sdpa attention handing its inputs and output to the
    collector; for the reference method, eager attention handing the gradient of its scores to it.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    is_causal = attention_mask is None and query.shape[2] > 1 and causal
    collector, layer = COLLECTING.get(module, (None, None))
    collects = collector is not None and collector.collects(layer)
    if collector is not None and collector.batch_method == "reference":
        # Every layer runs eager attention, also those whose M is collected in another pass: the same forward.
        hook = collector.score_hook(layer) if collects else None
        zero_masked_rows = not collector.eager_model  # as the model's own sdpa attention does
        key, value = _repeat_key_value_heads(query, key, value)
        return _eager_attention(query, key, value, attention_mask, scaling, is_causal, zero_masked_rows, hook)
    output, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if collects and output.requires_grad:
        key, value = _repeat_key_value_heads(query, key, value)
        collector.on_attention_output(layer, output, query, key, value, attention_mask, scaling, is_causal)
    return output, weights


def _repeat_key_value_heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query attention's key/value heads repeated for each query head of their group, (b, h, s, d):
    the score gradients G_i of query head i pair with its group's keys."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def _eager_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    is_causal: bool,
    zero_masked_rows: bool,
    hook: Callable[[Tensor], None] | None,
) -> tuple[Tensor, Tensor]:
    """Attention with materialized scores, whose gradient goes to ``hook``; masks as `score_gradient_products`.

    ``zero_masked_rows``: a query that may attend to no key gets a zero output, as in sdpa (eager attention
    averages all values uniformly instead). Scores are formed in float32 at least: formed in a float16 model's
    dtype, their gradient reached the hook rounded to float16 (M 5.9e-2 off where the chunked method's was 4.2e-3).
    In every layer, hooked or not: the passes of a ``memory_budget`` (each hooks another group) and a checkpointed
    layer's recomputation (not hooked) compute the same function as a single pass.
    """
    query, key = (tensor.to(torch.promote_types(tensor.dtype, torch.float32)) for tensor in (query, key))
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if hook is not None and scores.requires_grad:
        scores.register_hook(hook)
    mask = _block_mask(mask, 0, query.shape[-2], key.shape[-2], is_causal, query.device)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(value.dtype)
    if zero_masked_rows and mask is not None and mask.dtype == torch.bool:
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def _block_mask(mask: Tensor | None, start: int, stop: int, num_keys: int, is_causal: bool, device) -> Tensor | None:
    """The mask rows of queries ``start:stop``: boolean (True = attend), additive float, or None."""
    if mask is not None:
        return mask[..., start:stop, :num_keys]
    if not is_causal:
        return None
    return torch.arange(start, stop, device=device)[:, None] >= torch.arange(num_keys, device=device)[None, :]


def score_gradient_products(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_output: Tensor,
    inputs: Tensor,
    mask: Tensor | None,
    scaling: float,
    is_causal: bool,
    block: int,
    dtype: torch.dtype,
) -> Tensor:
    """Per head, the sum over the batch of X'^T G X' (G = dLoss/dS), computed one block of queries at a time.

    ``query``/``key`` (b, h, s, d_k), ``value``/``grad_output`` (b, h, s, d_v) of one attention call and its
    output gradient, ``inputs`` X' (b, s, d); ``mask`` as the attention received it (boolean, additive or
    None with ``is_causal``). Within a block the softmax rows are complete, so G = P * (dP - rowsum(P * dP)).
    G is exactly dLoss/dS: zero where a boolean mask replaces the score (a query that may attend to no key has
    a uniform softmax row but no score gradient); an additive mask passes the gradient on. Returns (h, d, d)
    in ``dtype``.
    """
    batch, heads, length = query.shape[:3]
    width = inputs.shape[-1]
    query, key, value, grad_output, inputs = (t.to(dtype) for t in (query, key, value, grad_output, inputs))
    products = torch.zeros(heads, width, width, dtype=dtype, device=query.device)
    for start in range(0, length, block):
        stop = min(start + block, length)
        # Causal without a mask: the block's queries see keys up to ``stop`` only, so skip the rest (half the work).
        seen = stop if mask is None and is_causal else key.shape[-2]
        keys_t, values_t, seen_inputs = key[:, :, :seen].mT, value[:, :, :seen].mT, inputs[:, :seen]
        # In place where possible: the (b, h, block, s) tensors dominate time and memory.
        scores = torch.matmul(query[:, :, start:stop] * scaling, keys_t)
        block_mask = _block_mask(mask, start, stop, seen, is_causal, query.device)
        if block_mask is not None and block_mask.dtype == torch.bool:
            scores.masked_fill_(~block_mask, torch.finfo(dtype).min)  # finite: fully masked rows stay finite
        elif block_mask is not None:
            scores.add_(block_mask.to(dtype))
        probs = torch.softmax(scores, dim=-1)
        del scores
        block_grad = grad_output[:, :, start:stop]
        if mask is not None and mask.dtype == torch.bool:
            # Elsewhere P is 0 where the mask is False; a fully masked row gets G = 0 from a zero dLoss/dO row.
            block_grad = block_grad * block_mask.any(dim=-1, keepdim=True)
        # rowsum(P * dP) = rowsum(dO * O) with O = P V: from (b, h, block, d_v) tensors only.
        row_sums = (block_grad * torch.matmul(probs, values_t.mT)).sum(dim=-1, keepdim=True)
        grad_scores = torch.matmul(block_grad, values_t).sub_(row_sums).mul_(probs)
        del probs
        # G X' per sequence: (b, h * block, keys) @ (b, keys, d), then X'^T (G X') summed over sequences and queries.
        projected = torch.matmul(grad_scores.reshape(batch, -1, seen), seen_inputs).reshape(batch, heads, -1, width)
        rows = inputs[:, start:stop].reshape(-1, width)  # (b * block, d)
        products += torch.matmul(rows.mT, projected.transpose(0, 1).reshape(heads, -1, width))
    return products


def default_query_block(device: torch.device, batch: int, heads: int, length: int) -> int:
    """Queries per block of the chunked method: as many as keep one (b, h, block, s) tensor within the device's
    budget, but at least 32 (or the whole sequence)."""
    elements = _CPU_BLOCK_ELEMENTS if device.type == "cpu" else _GPU_BLOCK_ELEMENTS
    return min(length, max(_MIN_QUERY_BLOCK, elements // (batch * heads * length)))


# A new attention name needs its mask function too, or transformers runs it without any mask.
AttentionInterface.register(STATISTICS_ATTENTION, statistics_attention)
AttentionMaskInterface.register(STATISTICS_ATTENTION, sdpa_mask)


def choose_method(device: torch.device, length: int, eager_model: bool) -> str:
    """The method ``"auto"`` runs for a batch of sequences of ``length`` tokens on ``device``.

    Eager models get the reference method, which keeps their own fully masked rows. Otherwise the reference
    method is the faster one on a CPU up to `CPU_REFERENCE_MAX_LENGTH` tokens, and the chunked method beyond
    it and on GPUs, where it also needs less memory (BENCHMARKS.md).
    """
    if eager_model or (device.type == "cpu" and length <= CPU_REFERENCE_MAX_LENGTH):
        return "reference"
    return "chunked"


def triton_available(device: torch.device) -> bool:
    """Whether ``method="triton"`` can run on ``device``: CUDA with triton installed, or Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    from triton import knobs  # imported only here: statistics need no triton otherwise

    return device.type == "cuda" or bool(knobs.runtime.interpret)


def without_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Statistics products in their own dtype even when the caller runs the model under autocast."""
    return torch.autocast(device.type, enabled=False)


#: The backends whose float32 matmuls the statistics run in IEEE float32 or TF32 (torch's per-backend API, 2.9 on).
_MATMUL_BACKENDS = ("cuda", "mkldnn")


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """Float32 matmuls on TF32 tensor cores or in IEEE float32 for the pass, the caller's settings restored after it.

    Through the per-backend API where torch has it: once a backend's precision was set that way (transformers'
    ``TrainingArguments(tf32=...)`` does), the global getter raises, and the global setter pins every backend, so
    a later generic setting (``torch.backends.fp32_precision``) would reach none of them.
    """
    if not hasattr(torch.backends, "fp32_precision"):  # torch before 2.9
        original = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(original)
        return
    backends = [getattr(torch.backends, name).matmul for name in _MATMUL_BACKENDS]
    original = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        for backend, value in zip(backends, original):
            backend.fp32_precision = value


def tf32_matmuls() -> bool:
    """Whether CUDA float32 matmuls run on TF32 tensor cores now (in a pass: as `matmul_precision` set them)."""
    if not hasattr(torch.backends, "fp32_precision"):
        return torch.get_float32_matmul_precision() != "highest"
    return torch.backends.cuda.matmul.fp32_precision == "tf32"
