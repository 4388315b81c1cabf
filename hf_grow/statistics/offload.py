"""M's accumulators in memory-mapped safetensors files (``offload_dir``): the escape where M of even one layer does
not fit the host memory.

Each pass's M lives in one safetensors file, in a subfolder of ``offload_dir`` of its own (two runs never share one;
its name holds the machine and the process id, and the run holds a lock on it, so a later run tells the folder of a
process killed outright apart and names it). The file's header is written first and its data region mapped writable
(``MAP_SHARED``), so the collector's in-place sums write into the file and the operating system pages them out to
disk as memory runs short; the file is a valid safetensors file throughout. A pass's file is removed as soon as its
M is solved, the subfolder when the collection ends or fails. M that outlives its file (returned by
`collect_statistics`, or kept for a second solve) stays mapped from the removed file: its disk space returns when
the tensors are freed (POSIX semantics).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import struct
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from ..progress import format_bytes


#: The name of each run's subfolder of ``offload_dir`` starts so; the machine, the process id and random letters
#: follow (``hf_grow-m-<host>-<pid>-<random>``).
OFFLOAD_PREFIX = "hf_grow-m-"
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32"}
#: The killed runs' folders this process has warned of.
_NAMED_LEFT_FOLDERS: set[Path] = set()


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
    for left in killed_runs_folders(folder):
        if left in _NAMED_LEFT_FOLDERS:  # the checks of one run (the command's, the growth's, each pass's) name it once
            continue
        _NAMED_LEFT_FOLDERS.add(left)
        size = sum(entry.stat().st_size for entry in left.rglob("*") if entry.is_file())
        warnings.warn(
            f"{name} {offload_dir} holds {left.name} ({format_bytes(size)}), left by a run on this machine whose "
            f"process no longer runs (killed outright): remove it to free its disk.",
            stacklevel=2,
        )


def _subfolder_prefix() -> str:
    """This process's subfolder prefix: `OFFLOAD_PREFIX`, the machine's name (dashes kept, other characters a file
    name may not hold replaced) and the process id."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname()) or "host"
    return f"{OFFLOAD_PREFIX}{host}-{os.getpid()}-"


def killed_runs_folders(offload_dir: str | os.PathLike) -> list[Path]:
    """The subfolders of ``offload_dir`` that a run on this machine made and left: its process id no longer runs (a
    process killed outright removes nothing), and no process holds the folder's lock (a run in another PID namespace
    of a machine of the same name, a container, holds it). Another machine's (a shared disk) are not judged."""
    host_prefix = _subfolder_prefix().rsplit("-", 2)[0] + "-"
    left = []
    for folder in sorted(Path(offload_dir).glob(host_prefix + "*")):
        pid_and_random = folder.name[len(host_prefix):].split("-")
        if (folder.is_dir() and len(pid_and_random) == 2 and pid_and_random[0].isdigit()
                and not _runs(int(pid_and_random[0])) and not _locked(folder)):
            left.append(folder)
    return left


def _lock(folder: Path) -> int:
    """A descriptor of ``folder`` holding an exclusive lock on it until it is closed (or the process dies); an
    OSError where it cannot be locked (BlockingIOError: another process holds it), the descriptor closed."""
    import fcntl  # POSIX, as the rest of offloading

    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        raise
    return descriptor


def _locked(folder: Path) -> bool:
    """Whether a process holds ``folder``'s lock (`_lock`)."""
    try:
        os.close(_lock(folder))
    except OSError:  # held; or gone meanwhile, not ours to open, or no lock on this disk (NFS): not named
        return True
    return False


def _runs(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def offload_folder(offload_dir: str | os.PathLike | None) -> Iterator[Path | None]:
    """A new subfolder of ``offload_dir`` (None without one), removed with whatever is left in it on exit, also on
    error."""
    if offload_dir is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix=_subfolder_prefix(), dir=offload_dir))
    try:
        lock = _lock(folder)  # held while the run uses the folder: a later run tells it from a killed run's
    except OSError:  # a disk without directory locks (NFS refuses one on a read-only descriptor): none held
        lock = None
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


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
