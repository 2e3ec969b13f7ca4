"""Chosen rows of a JSONL training file, read without ``datasets`` (a one-off query shows a few texts).

``datasets`` costs a query about 1 s of CPU to import and 1.5 s to load even a small file
(benchmarks/results/startup.json); a query needs only its hits' rows. :class:`JsonlRows` finds
the start of every non-empty line in one pass over the file (numpy, in 64 MiB blocks) and parses
only the rows asked for. It is a shortcut, not a second reader: :class:`gradindex.query.texts.TrainingTexts`
checks each row's tokens against the build's stored hash and goes back to ``datasets`` for the
whole file when the count or any hash differs (a file that ``datasets`` reads differently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from gradindex.data import Records

BLOCK = 64 << 20
"""Bytes of the file scanned per numpy pass."""


def line_starts(path: str | os.PathLike) -> np.ndarray:
    """``[n + 1]`` byte offsets: the start of each non-empty line, then the file's size."""
    starts, size = [np.zeros(1, dtype=np.int64)], os.path.getsize(path)
    with open(path, "rb") as f:
        base = 0
        while block := f.read(BLOCK):
            starts.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + base + 1)
            base += len(block)
    s = np.concatenate(starts + [np.array([size], dtype=np.int64)])
    s = np.unique(s[s <= size])  # [lines + 1]: every line's start, the end
    short = np.flatnonzero(np.diff(s) <= 2)  # only a line of "\n" or "\r\n" (or nothing) can be blank
    keep = np.ones(len(s) - 1, dtype=bool)
    with open(path, "rb") as f:
        for i in short:
            f.seek(int(s[i]))
            keep[i] = bool(f.read(int(s[i + 1] - s[i])).strip())
    return np.concatenate([s[:-1][keep], s[-1:]])


class JsonlRows:
    """``len`` and :meth:`select` of a JSONL file's records (one JSON object per non-empty line)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._starts = line_starts(self.path)  # [n + 1]

    def __len__(self) -> int:
        return len(self._starts) - 1

    def select(self, ids) -> Records:
        """The records at ``ids`` (in that order), parsed; a ``ValueError`` if one is not a JSON object."""
        rows = []
        with open(self.path, "rb") as f:
            for i in ids:
                f.seek(int(self._starts[i]))
                rec = json.loads(f.read(int(self._starts[i + 1] - self._starts[i])))
                if not isinstance(rec, dict):
                    raise ValueError(f"line {i} of {str(self.path)!r} is not a JSON object")
                rows.append(rec)
        return Records(rows)
