"""Capture inside training: a context manager for plain PyTorch loops and a ``transformers`` callback.

Both record each step's per-example projected gradients from the backward the loop already runs
and write the same store and manifest as ``gradindex build`` (see ``docs/training.md``).
"""

from __future__ import annotations

from gradindex.integrations.live import ROW_KEY, CaptureOptions, LiveCapture
from gradindex.integrations.loop import GradIndexCapture

__all__ = ["ROW_KEY", "CaptureOptions", "GradIndexCallback", "GradIndexCapture", "LiveCapture", "with_row_ids"]


def with_row_ids(dataset):
    """``dataset`` (a ``datasets.Dataset``) with a ``gradindex_row`` column: each row's 0-based position."""
    if ROW_KEY in dataset.column_names:
        return dataset
    return dataset.add_column(ROW_KEY, list(range(len(dataset))))


def __getattr__(name: str):
    if name == "GradIndexCallback":  # imports transformers' Trainer machinery: only when asked
        from gradindex.integrations.trainer import GradIndexCallback

        return GradIndexCallback
    raise AttributeError(name)
