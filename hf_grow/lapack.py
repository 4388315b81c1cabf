"""LAPACK decompositions of batches of matrices, on a CPU one matrix per worker thread (pure torch, no transformers)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor


def per_matrix(decomposition: Callable[[Tensor], Any], matrices: Tensor) -> Any:
    """``decomposition`` (a LAPACK routine: eigh, QR) of a matrix or a batch: a tensor as one batched call gives it,
    or a tuple of its tensors. On a CPU with several torch threads the matrices are split across as many Python
    threads, each decomposing its share (a worker's LAPACK runs with the process's thread count too, measured with
    MKL: the result is bit for bit the batched call's at the same thread count, and differs in the last bits
    between thread counts). The batched call's multithreaded blocked algorithms synchronize their threads at every
    panel and stall while another process holds a core: on the 2-core CPU beside other jobs, 144 eighs of 424^2
    took 5-139 s batched and 5-7.5 s split; 144 QRs of 769 x 424 130 s batched, 8.5 s split; 12 eighs of 769^2
    (GPT-2 small's C) 73 s against 3.8 s in one worker thread (BENCHMARKS.md). A single matrix runs in one worker
    thread for the same reason."""
    if matrices.device.type != "cpu" or torch.get_num_threads() < 2:
        return decomposition(matrices)
    batch = matrices.flatten(0, -3) if matrices.dim() > 2 else matrices[None]
    workers = min(torch.get_num_threads(), batch.shape[0])
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(decomposition, batch.tensor_split(workers)))
    if isinstance(parts[0], Tensor):
        return _unbatch(torch.cat(parts), matrices)
    return tuple(_unbatch(torch.cat(part), matrices) for part in zip(*parts))


def _unbatch(stacked: Tensor, matrices: Tensor) -> Tensor:
    """Results stacked along one batch dimension, back to the batch shape of ``matrices`` (none for one matrix)."""
    return stacked.unflatten(0, matrices.shape[:-2]) if matrices.dim() > 2 else stacked[0]


def batched_eigh(symmetric: Tensor) -> tuple[Tensor, Tensor]:
    """`torch.linalg.eigh` of a matrix or a batch, by `per_matrix`: (eigenvalues, eigenvectors)."""
    return tuple(per_matrix(torch.linalg.eigh, symmetric))


def orthonormal_columns(block: Tensor) -> Tensor:
    """The Q of `torch.linalg.qr` (reduced) of a matrix or a batch, by `per_matrix`."""
    return per_matrix(lambda part: torch.linalg.qr(part).Q, block)
