"""Progress bars: tqdm on a terminal (or in a notebook); a plain line now and then anywhere else.

Redrawn bars are carriage returns and cursor moves: in ``gradindex build ... > log.txt 2>&1`` they
leave one long garbled line per bar. When stderr is not a terminal, :func:`progress_bar` prints
instead one line every :data:`INTERVAL` seconds while work goes on (done, total, rate, time left)
and one when it ends, so a long job in a log still shows where it is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import tqdm.auto
import tqdm.autonotebook
import tqdm.std

INTERVAL = 30.0
"""Seconds between two progress lines when stderr is not a terminal."""


def progress_bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
                 unit: str = "it", disable: bool = False, leave: bool = True, initial: int = 0) -> Any:
    """A tqdm-like bar (``update``, ``set_postfix_str``, ``close``, iteration, ``with``): tqdm on a terminal
    or in a notebook, else a :class:`LineProgress`; a silent tqdm when ``disable``."""
    if disable:
        return tqdm.std.tqdm(iterable, total=total, disable=True)
    if _interactive():
        return tqdm.auto.tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial,
                              dynamic_ncols=True)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial)


def skip(bar: Any, n: float) -> None:
    """Count ``n`` items done before this run (a resumed job's): in the total, not in the rate (a resumed capture
    said 10 million examples a second)."""
    if hasattr(bar, "initial"):
        bar.initial += n
    bar.update(n)


def _interactive() -> bool:
    if tqdm.autonotebook.tqdm is not tqdm.std.tqdm:  # in a notebook: its widget bar
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stderr
        return False


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class LineProgress:
    """Progress as whole lines on stderr: one every ``interval`` seconds of work, one at the end (``leave``)."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
                 unit: str = "it", leave: bool = True, initial: int = 0, interval: float = INTERVAL):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.leave, self.n, self.initial, self.interval = leave, initial, initial, interval
        self.postfix = ""
        self.t0 = self.last = time.monotonic()
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write(self._line(now, final=False))

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.leave:
                self._write(self._line(time.monotonic(), final=True))

    def __iter__(self) -> Iterator:
        try:
            for x in self.iterable:
                yield x
                self.update()
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, now: float, final: bool) -> str:
        done, spent = self.n - self.initial, now - self.t0
        count = f"{self.n:,.0f}/{self.total:,.0f}" if self.total is not None else f"{self.n:,.0f}"
        parts = [f"{self.desc + ': ' if self.desc else ''}{count} {self.unit}"]
        if self.total and not final:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        rate = done / spent if spent > 0 else 0.0
        speed = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
        parts[0] += f" {'in' if final else 'after'} {_duration(spent)}"
        if rate:
            parts.append(f"{speed} {self.unit}/s")
        if not final and rate and self.total is not None and self.total > self.n:
            parts.append(f"about {_duration((self.total - self.n) / rate)} left")
        if self.postfix and not final:
            parts.append(self.postfix)
        return ", ".join(parts)

    @staticmethod
    def _write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
