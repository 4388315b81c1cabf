"""Fused Triton kernels for the score-gradient products M_i = X'^T G_i X' (``method="triton"``).

`hf_grow.statistics.score_gradient_products` computes G = dLoss/dS one block of queries at a time in
PyTorch, and on a GPU its time goes to the elementwise passes over the (b, h, block, s) float32 tensors of
scores, probabilities and G. These kernels keep every tile of G on chip instead, the way flash-attention's
backward computes dQ = dS K with K replaced by X':

1. `_softmax_rows`: per query row, the softmax max and log-sum (online, over key tiles) and
   delta = rowsum(dO * O), with O = P V recomputed from the same tiles (so G's rows sum to zero exactly).
2. `_gradient_times_inputs`: per (batch, head, query tile, column tile of X'), the sum over key tiles of
   G X' with G = P * (dO V^T - delta), P = exp(S - max - log-sum): never written to memory.

The remaining product X'^T (G X') summed over the batch is one batched matrix product in PyTorch.

The kernels run on CUDA; with ``TRITON_INTERPRET=1`` set before this module is imported, Triton's
interpreter runs them on CPU tensors (how the tests check them on machines without a GPU). Only this module
imports triton, and `hf_grow.statistics` imports it only for ``method="triton"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs


# Elements of the float32 G X' buffer of one launch (b, h, queries, d): 2^26 numbers are 256 MiB.
_BUFFER_ELEMENTS = 2**26

# Masked scores are filled with float32's lowest value, as in the PyTorch path: finite, so a fully masked
# row is uniform instead of NaN.
_LOWEST = tl.constexpr(-3.4028234663852886e38)

# Tile sizes: autotuned on a GPU; in the interpreter one small configuration (it runs every tile in Python).
if knobs.runtime.interpret:
    row_configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})]
    product_configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 16})]
else:
    row_configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3))
    ]
    product_configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_D": d}, num_warps=w, num_stages=st)
        for m, n, d, w, st in (
            (64, 64, 128, 4, 2),
            (64, 64, 128, 8, 2),
            (128, 64, 128, 8, 2),
            (64, 32, 256, 8, 2),
            (128, 32, 64, 4, 3),
            (64, 64, 64, 4, 3),
        )
    ]


@triton.jit
def _load_rows(ptr, b, h, stride_b, stride_h, stride_row, stride_col, offs_row, row_in, WIDTH, BLOCK: tl.constexpr):
    """A (rows, BLOCK) float32 tile of head h of sequence b; columns past WIDTH and rows not in are zero."""
    offs_col = tl.arange(0, BLOCK)
    return tl.load(
        ptr + b * stride_b + h * stride_h + offs_row[:, None] * stride_row + offs_col[None, :] * stride_col,
        mask=row_in[:, None] & (offs_col[None, :] < WIDTH), other=0.0,
    ).to(tl.float32)


@triton.jit
def _scores(
    q, k_ptr, offs_m, offs_n, stride_kn, stride_kk, offs_qk, QK_DIM,
    mask_ptr, stride_mm, stride_mn, LENGTH, scaling,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """Scaled, masked scores of a (query tile, key tile); keys past the sequence are -inf (left out)."""
    key_in = offs_n < LENGTH
    k = tl.load(
        k_ptr + offs_n[None, :] * stride_kn + offs_qk[:, None] * stride_kk,
        mask=key_in[None, :] & (offs_qk[:, None] < QK_DIM), other=0.0,
    ).to(tl.float32)
    scores = tl.dot(q, k, input_precision=PRECISION) * scaling
    pair_in = (offs_m[:, None] < LENGTH) & key_in[None, :]
    if MASK_KIND == 1:  # boolean, True = attend
        allowed = tl.load(
            mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=pair_in, other=0
        )
        scores = tl.where(allowed != 0, scores, _LOWEST)
    elif MASK_KIND == 2:  # additive
        scores += tl.load(
            mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=pair_in, other=0.0
        ).to(tl.float32)
    elif CAUSAL:
        scores = tl.where(offs_n[None, :] <= offs_m[:, None], scores, _LOWEST)
    return tl.where(key_in[None, :], scores, float("-inf"))


@triton.autotune(configs=row_configs, key=["LENGTH", "QK_DIM", "V_DIM"])
@triton.jit
def _softmax_rows(
    q_ptr, k_ptr, v_ptr, do_ptr, mask_ptr, max_ptr, logsum_ptr, delta_ptr,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_mb, stride_mh, stride_mm, stride_mn,
    HEADS, LENGTH, QK_DIM, V_DIM, scaling,
    QK_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, sequence_head = tl.program_id(0), tl.program_id(1)
    b, h = sequence_head // HEADS, sequence_head % HEADS
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_qk, offs_v = tl.arange(0, QK_BLOCK), tl.arange(0, V_BLOCK)
    row_in = offs_m < LENGTH
    q = _load_rows(q_ptr, b, h, stride_qb, stride_qh, stride_qm, stride_qk, offs_m, row_in, QK_DIM, QK_BLOCK)
    k_ptr += b * stride_kb + h * stride_kh
    v_ptr += b * stride_vb + h * stride_vh
    mask_ptr += b * stride_mb + h * stride_mh
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    weighted = tl.zeros([BLOCK_M, V_BLOCK], tl.float32)
    # Causal without a mask: keys after the tile's last query are all masked, so they are skipped.
    end = tl.minimum(LENGTH, (tile + 1) * BLOCK_M) if (CAUSAL and MASK_KIND == 0) else LENGTH
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        scores = _scores(
            q, k_ptr, offs_m, offs_n, stride_kn, stride_kk, offs_qk, QK_DIM,
            mask_ptr, stride_mm, stride_mn, LENGTH, scaling, MASK_KIND, CAUSAL, PRECISION,
        )
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp(row_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        v = tl.load(
            v_ptr + offs_n[:, None] * stride_vn + offs_v[None, :] * stride_vk,
            mask=(offs_n[:, None] < LENGTH) & (offs_v[None, :] < V_DIM), other=0.0,
        ).to(tl.float32)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        weighted = weighted * rescale[:, None] + tl.dot(probs, v, input_precision=PRECISION)
        row_max = new_max
    grad_output = _load_rows(
        do_ptr, b, h, stride_ob, stride_oh, stride_om, stride_ok, offs_m, row_in, V_DIM, V_BLOCK
    )
    delta = tl.sum(grad_output * weighted, axis=1) / row_sum
    if MASK_KIND == 1:  # a query that a boolean mask lets attend to no key has no score gradient (G = 0)
        delta = tl.where(row_max > _LOWEST, delta, 0.0)
    rows = sequence_head * LENGTH + offs_m
    tl.store(max_ptr + rows, row_max, mask=row_in)
    tl.store(logsum_ptr + rows, tl.log(row_sum), mask=row_in)
    tl.store(delta_ptr + rows, delta, mask=row_in)


@triton.autotune(configs=product_configs, key=["LENGTH", "WIDTH", "QK_DIM", "V_DIM"])
@triton.jit
def _gradient_times_inputs(
    q_ptr, k_ptr, v_ptr, do_ptr, x_ptr, mask_ptr, max_ptr, logsum_ptr, delta_ptr, out_ptr,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_xb, stride_xn, stride_xd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_yb, stride_yh, stride_ym, stride_yd,
    HEADS, LENGTH, WIDTH, QK_DIM, V_DIM, FIRST_QUERY, LAST_QUERY, scaling,
    QK_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, column_tile, sequence_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = sequence_head // HEADS, sequence_head % HEADS
    offs_m = FIRST_QUERY + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = column_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_qk, offs_v = tl.arange(0, QK_BLOCK), tl.arange(0, V_BLOCK)
    row_in = offs_m < LAST_QUERY
    q = _load_rows(q_ptr, b, h, stride_qb, stride_qh, stride_qm, stride_qk, offs_m, row_in, QK_DIM, QK_BLOCK)
    grad_output = _load_rows(
        do_ptr, b, h, stride_ob, stride_oh, stride_om, stride_ok, offs_m, row_in, V_DIM, V_BLOCK
    )
    rows = sequence_head * LENGTH + offs_m
    row_max = tl.load(max_ptr + rows, mask=row_in, other=0.0)
    row_logsum = tl.load(logsum_ptr + rows, mask=row_in, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_in, other=0.0)
    if MASK_KIND == 1:
        grad_output = tl.where((row_max > _LOWEST)[:, None], grad_output, 0.0)
    k_ptr += b * stride_kb + h * stride_kh
    v_ptr += b * stride_vb + h * stride_vh
    x_ptr += b * stride_xb
    mask_ptr += b * stride_mb + h * stride_mh
    projected = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(LENGTH, FIRST_QUERY + (tile + 1) * BLOCK_M) if (CAUSAL and MASK_KIND == 0) else LENGTH
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        scores = _scores(
            q, k_ptr, offs_m, offs_n, stride_kn, stride_kk, offs_qk, QK_DIM,
            mask_ptr, stride_mm, stride_mn, LENGTH, scaling, MASK_KIND, CAUSAL, PRECISION,
        )
        # Subtract the max first: a fully masked row's scores equal it exactly, so the row stays uniform.
        probs = tl.exp((scores - row_max[:, None]) - row_logsum[:, None])
        v = tl.load(
            v_ptr + offs_n[None, :] * stride_vn + offs_v[:, None] * stride_vk,
            mask=(offs_n[None, :] < LENGTH) & (offs_v[:, None] < V_DIM), other=0.0,
        ).to(tl.float32)
        gradient = probs * (tl.dot(grad_output, v, input_precision=PRECISION) - delta[:, None])
        x = tl.load(
            x_ptr + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd,
            mask=(offs_n[:, None] < LENGTH) & (offs_d[None, :] < WIDTH), other=0.0,
        ).to(tl.float32)
        projected += tl.dot(gradient, x, input_precision=PRECISION)
    out_rows = offs_m - FIRST_QUERY
    tl.store(
        out_ptr + b * stride_yb + h * stride_yh + out_rows[:, None] * stride_ym + offs_d[None, :] * stride_yd,
        projected, mask=row_in[:, None] & (offs_d[None, :] < WIDTH),
    )


def score_gradient_products_fused(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_output: Tensor,
    inputs: Tensor,
    mask: Tensor | None,
    scaling: float,
    is_causal: bool,
    tf32: bool = False,
) -> Tensor:
    """`hf_grow.statistics.score_gradient_products` with fused kernels: per head, sum_b X'^T G X' in float32.

    Same arguments: ``query``/``key`` (b, h, s, d_k), ``value``/``grad_output`` (b, h, s, d_v), ``inputs`` X'
    (b, s, d), ``mask`` boolean (True = attend), additive or None (then ``is_causal`` says whether queries see
    later keys). Any float dtype in, float32 products (``tf32``: on TF32 tensor cores). Returns (h, d, d).
    """
    batch, heads, length, qk_dim = query.shape
    v_dim, width = value.shape[-1], inputs.shape[-1]
    if query.device.type != "cuda" and not knobs.runtime.interpret:
        raise RuntimeError(
            f"the triton statistics kernels run on CUDA devices, not {query.device.type} (or in Triton's "
            "interpreter, TRITON_INTERPRET=1): use method='chunked' instead."
        )
    if key.shape[-2] != length:
        raise ValueError("statistics need full self-attention scores: run the model without a KV cache")
    if mask is None:
        mask_kind, mask = 0, query.new_zeros(1, 1, 1, 1)
    else:
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mask = mask[..., :length].expand(batch, heads, length, length)
    mask_strides = mask.stride() if mask_kind else (0, 0, 0, 0)
    common = dict(
        QK_BLOCK=max(16, triton.next_power_of_2(qk_dim)), V_BLOCK=max(16, triton.next_power_of_2(v_dim)),
        MASK_KIND=mask_kind, CAUSAL=bool(is_causal), PRECISION="tf32" if tf32 else "ieee",
    )
    strides = (*query.stride(), *key.stride(), *value.stride(), *grad_output.stride())
    row_max, row_logsum, delta = (
        torch.empty(batch * heads * length, dtype=torch.float32, device=query.device) for _ in range(3)
    )
    _softmax_rows[lambda meta: (-(-length // meta["BLOCK_M"]), batch * heads)](
        query, key, value, grad_output, mask, row_max, row_logsum, delta, *strides, *mask_strides,
        heads, length, qk_dim, v_dim, scaling, **common,
    )
    products = torch.zeros(heads, width, width, dtype=torch.float32, device=query.device)
    block = max(1, min(length, _BUFFER_ELEMENTS // (batch * heads * width)))
    for first in range(0, length, block):
        last = min(first + block, length)
        projected = torch.empty(batch, heads, last - first, width, dtype=torch.float32, device=query.device)

        def grid(meta, queries=last - first):
            return (-(-queries // meta["BLOCK_M"]), -(-width // meta["BLOCK_D"]), batch * heads)

        _gradient_times_inputs[grid](
            query, key, value, grad_output, inputs, mask, row_max, row_logsum, delta, projected,
            *strides, *inputs.stride(), *mask_strides, *projected.stride(),
            heads, length, width, qk_dim, v_dim, first, last, scaling, **common,
        )
        rows = inputs[:, first:last].to(torch.float32).reshape(-1, width)  # (b * queries, d)
        products += torch.matmul(rows.mT, projected.transpose(0, 1).reshape(heads, -1, width))
    return products

