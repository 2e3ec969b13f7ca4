"""Per-stage seconds of the queries a server answered: a bounded window, summarised for ``/health``."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

STAGES = ("queue", "gradient", "precondition", "search", "rerank", "texts", "explain", "total")
"""The stages of a served query, in order: waiting for the engine, the query's gradient pass (shared by
the batch it was answered in), preconditioning, the index search, the exact re-rank, reading training
texts, token explanations, and the whole request."""


class StageTimes:
    """The last ``window`` values of each stage's seconds (memory bounded), thread-safe."""

    def __init__(self, window: int = 1000):
        self.window = window
        self._seen: dict[str, deque[float]] = {s: deque(maxlen=window) for s in STAGES}
        self._count = dict.fromkeys(STAGES, 0)
        self._lock = threading.Lock()

    def add(self, seconds: dict[str, float]) -> None:
        """Record one answered query's ``{stage: seconds}`` (stages it did not go through are absent)."""
        with self._lock:
            for s, v in seconds.items():
                if s in self._seen:
                    self._seen[s].append(float(v))
                    self._count[s] += 1

    def to_dict(self) -> dict:
        """``{stage: {count, p50_s, p95_s, max_s, mean_s}}`` over the window (stages seen only)."""
        with self._lock:
            out = {}
            for s in STAGES:
                v = np.asarray(self._seen[s], dtype=np.float64)
                if len(v):
                    out[s] = {"count": self._count[s], "p50_s": float(np.percentile(v, 50)),
                              "p95_s": float(np.percentile(v, 95)), "max_s": float(v.max()),
                              "mean_s": float(v.mean())}
            return out
