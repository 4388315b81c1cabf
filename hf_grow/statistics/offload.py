"""M's accumulators in memory-mapped safetensors files (``offload_dir``): the escape where M of even one layer does
not fit the host memory.

Each pass's M lives in one safetensors file, in a subfolder of ``offload_dir`` of its own (two runs never share
one). The file's header is written first and its data region mapped writable (``MAP_SHARED``), so the collector's
in-place sums write into the file and the operating system pages them out to disk as memory runs short; the file
is a valid safetensors file throughout. A pass's file is removed as soon as its M is solved, the subfolder when the
collection ends or fails. M that outlives its file (returned by `collect_statistics`, or kept for a second solve)
stays mapped from the removed file: its disk space returns when the tensors are freed (POSIX semantics).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from ..progress import format_bytes


#: The name of each run's subfolder of ``offload_dir`` starts so (the rest is random).
OFFLOAD_PREFIX = "hf_grow-m-"
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32"}


def check_offload_dir(offload_dir: str | os.PathLike, device: torch.device, name: str = "offload_dir") -> None:
    """A ValueError, before any work, for an ``offload_dir`` the accumulators cannot live in: not a folder, not
    writable, or a model not on the CPU (``name``: the option, for the error)."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"{name} maps M's accumulators into host memory, but the model is on {device}, where M accumulates in "
            "device memory: leave it out and bound M with memory_budget (fewer layers per pass), or run on the CPU."
        )
    folder = Path(offload_dir)
    if not folder.is_dir():
        raise ValueError(
            f"{name} {offload_dir} is not a folder: create it (on a disk with room for M) or name another."
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=OFFLOAD_PREFIX, dir=folder))
    except OSError as error:
        raise ValueError(
            f"{name} {offload_dir}: cannot create files there ({error.strerror}): name another folder."
        ) from None


@contextlib.contextmanager
def offload_folder(offload_dir: str | os.PathLike | None) -> Iterator[Path | None]:
    """A new subfolder of ``offload_dir`` (None without one), removed with whatever is left in it on exit, also on
    error."""
    if offload_dir is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix=OFFLOAD_PREFIX, dir=offload_dir))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def mapped_zeros(path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, Tensor]:
    """Zero tensors of ``shapes`` in a new safetensors file at ``path``, mapped writable: writing into a tensor
    writes into the file.

    The file's disk blocks are reserved up front (``posix_fallocate`` where there is one), so that a full disk is an
    error here rather than a SIGBUS on a later write into the mapping.
    """
    offsets, end = {}, 0
    for name, shape in shapes.items():
        offsets[name] = (end, end + math.prod(shape) * dtype.itemsize)
        end = offsets[name][1]
    header = json.dumps({
        name: {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shapes[name]), "data_offsets": list(offsets[name])}
        for name in shapes
    }).encode()
    header += b" " * (-len(header) % 8)  # the data region starts 8-byte aligned, as safetensors writes it
    start = 8 + len(header)
    size = start + end
    free = shutil.disk_usage(path.parent).free
    if size > free:
        raise ValueError(
            f"M's accumulators need {format_bytes(size)} of disk in {path.parent}, {format_bytes(free)} is free: "
            "free disk there, name another offload_dir, or collect fewer layers per pass (memory_budget)."
        )
    with open(path, "xb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.flush()
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(handle.fileno(), 0, size)
        else:
            os.ftruncate(handle.fileno(), size)
    mapped = torch.from_file(os.fspath(path), shared=True, size=size, dtype=torch.uint8)
    return {
        name: mapped[start + begin : start + stop].view(dtype).view(shapes[name])
        for name, (begin, stop) in offsets.items()
    }
