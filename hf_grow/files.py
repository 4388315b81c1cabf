"""Files written atomically: through a temporary sibling renamed into place, so that a reader (or a crash) sees the
old file or the whole new one, never half of one, and no temporary is left behind when writing fails. And the
shard size of saved models, which the memory plan counts on the host."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


#: Grown models are written in safetensors shards of at most this size (the Hub's usual 5 GB): saving a model that
#: lives on a GPU copies one shard at a time to the host (a Llama-3-8B in one shard took its whole 15 GiB there).
SHARD_BYTES = 5 * 10**9

def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` writes the file, which then replaces ``path`` in one rename (same folder, same disk).

    A symbolic link stays: the file it points to is replaced. A path that is neither a file nor a folder (a FIFO, a
    terminal, ``/dev/null``), or this process's standard output or error (``/dev/stdout``, also where it goes to a
    file), is written into as it is, from a temporary file ``write`` fills elsewhere: a rename would replace the
    device, or the file the stream goes to with what the stream wrote lost (and writers such as safetensors' rename
    their own temporaries over the path they are given).
    """
    path = Path(path)
    stream = _standard_stream(path)
    if stream is not None or (path.exists() and not path.is_file() and not path.is_dir()):
        with tempfile.TemporaryDirectory(prefix="hf-grow-") as folder:
            temporary = Path(folder) / path.name
            write(temporary)
            if stream is not None:
                stream.flush()  # what was printed before comes first
            with open(temporary, "rb") as source, open(
                os.dup(stream.fileno()) if stream is not None else path, "wb"
            ) as target:
                shutil.copyfileobj(source, target)
        return
    given, path = path, Path(os.path.realpath(path))
    if path.is_dir():  # the rename's error would name the temporary file
        raise IsADirectoryError(f"{given} is a folder: give the path of a file to write")
    if not path.parent.is_dir():  # the writer's error would name the temporary file
        raise FileNotFoundError(f"{given}: no folder {path.parent} to write it in; create it first")
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a read-only folder: the error to show is the write's
            temporary.unlink(missing_ok=True)
        raise


def _standard_stream(path: Path) -> TextIO | None:
    """``sys.stdout`` or ``sys.stderr`` where ``path`` is the file, pipe or terminal it writes to."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(os.stat(path), os.fstat(stream.fileno())):
                return stream
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no such path; a stream without a file
            continue
    return None


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """``text`` (UTF-8) as the file at ``path``, written atomically."""
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
