"""Capture inside training: a context manager for plain PyTorch loops and a ``transformers`` callback.

Both record each step's per-example projected gradients from the backward the loop already runs
and write the same store and manifest as ``gradindex build`` (see ``docs/training.md``).
"""

from __future__ import annotations

from gradindex.integrations.live import ROW_KEY, CaptureOptions, LiveCapture
from gradindex.integrations.loop import GradIndexCapture
from gradindex.integrations.rows import keep_rows, with_row_ids

__all__ = ["ROW_KEY", "CaptureOptions", "GradIndexCallback", "GradIndexCapture", "LiveCapture", "keep_rows",
           "with_row_ids"]


def __getattr__(name: str):
    if name == "GradIndexCallback":  # imports transformers' Trainer machinery: only when asked
        from gradindex.integrations.trainer import GradIndexCallback

        return GradIndexCallback
    raise AttributeError(name)
