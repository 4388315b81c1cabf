"""Progress of long work, for a person at a terminal and for a log file alike.

On a terminal, tqdm's bars. When stderr is a file or a pipe (a job's log, ``nohup``, CI), bars would be
invisible or a mess of carriage returns, so a plain line is printed every `LOG_INTERVAL_SECONDS` instead, with
the rate and, where the total is known, the time left, and one closing line when the work ends. Lines go to
stderr, like tqdm's bars, so that stdout keeps only results.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm


#: Seconds between two progress lines in a log (the closing line is always printed).
LOG_INTERVAL_SECONDS = 30.0

T = TypeVar("T")


def known_length(items: Iterable[Any] | None) -> int | None:
    """The number of items where it is known: None for an iterable without one, such as a DataLoader over an
    IterableDataset (a DataLoader has ``__len__``, which raises TypeError there)."""
    try:
        return len(items) if isinstance(items, Sized) else None
    except TypeError:
        return None


def progress_bar(
    iterable: Iterable[T] | None = None,
    *,
    desc: str,
    unit: str,
    total: int | None = None,
    enabled: bool = True,
) -> tqdm | LogProgress[T]:
    """A tqdm bar when stderr is a terminal, `LogProgress` lines otherwise; silent when not ``enabled``.

    Both are used the same way: iterated over, or as a context manager with ``update()`` and ``set_postfix()``.
    """
    if enabled and not sys.stderr.isatty():
        return LogProgress(iterable, desc=desc, unit=unit, total=total)
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled)


class LogProgress(Generic[T]):
    """Progress as plain lines on stderr: ``statistics: 12/50 batch (24%), 0.41 batch/s, 1 min 33 s left``."""

    def __init__(self, iterable: Iterable[T] | None, *, desc: str, unit: str, total: int | None = None):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.total = known_length(iterable) if total is None else total
        self.count = 0
        self.postfix = ""
        self.started = self.last_line = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator[T]:
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> LogProgress[T]:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def update(self, count: int = 1) -> None:
        self.count += count
        now = time.monotonic()
        if now - self.last_line >= LOG_INTERVAL_SECONDS:
            self.last_line = now
            self._print(self._line(now - self.started, done=False))

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{name}={value}" for name, value in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._print(self._line(time.monotonic() - self.started, done=True))

    def _line(self, elapsed: float, done: bool) -> str:
        counted = f"{self.count}/{self.total} {self.unit}" if self.total else f"{self.count} {self.unit}"
        if self.total and not done:
            counted += f" ({100 * self.count / self.total:.0f}%)"
        rate = self.count / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {counted}"]
        if done:
            parts.append(f"done in {format_seconds(elapsed)}")
        elif rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
            if self.total:
                parts.append(f"{format_seconds((self.total - self.count) / rate)} left")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    @staticmethod
    def _print(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(desc: str, enabled: bool = True) -> Iterator[None]:
    """One step without a count (saving a model): in a log, a line when it starts and one when it ends."""
    logging = enabled and not sys.stderr.isatty()
    started = time.monotonic()
    if logging:
        LogProgress._print(f"{desc}...")
    yield
    if logging:
        LogProgress._print(f"{desc}: done in {format_seconds(time.monotonic() - started)}")


def format_seconds(seconds: float) -> str:
    """``7.4 s``, ``3 min 05 s``, ``1 h 02 min``: what a person reads at a glance."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_bytes(size: float) -> str:
    """``270 KiB``, ``512 MiB``, ``3.25 GiB``, ``31.1 GiB``: binary units, as ``free -h`` and the memory plan print
    them."""
    if size < 2**20:
        return f"{size / 2**10:.0f} KiB"
    if size < 2**30:
        return f"{size / 2**20:.0f} MiB"
    return f"{size / 2**30:.2f} GiB" if size < 10 * 2**30 else f"{size / 2**30:.1f} GiB"
