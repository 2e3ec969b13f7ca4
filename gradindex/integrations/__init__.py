"""Capture inside training: a context manager for plain PyTorch loops and a ``transformers`` callback.

Both record each step's per-example projected gradients from the backward the loop already runs
and write the same store and manifest as ``gradindex build`` (see ``docs/training.md``). Online data
selection (:mod:`gradindex.integrations.selection`) scores each batch against a target set's gradient
and keeps, drops or reweights its examples before the update.
"""

from __future__ import annotations

from gradindex.integrations.live import ROW_KEY, CaptureOptions, LiveCapture, end_capture
from gradindex.integrations.loop import GradIndexCapture
from gradindex.integrations.rows import keep_rows, with_row_ids
from gradindex.integrations.selection import (
    KeepAll,
    OnlineSelector,
    RandomFraction,
    Reweight,
    SelectingLoader,
    Threshold,
    TopFraction,
    target_from_texts,
)

__all__ = ["ROW_KEY", "CaptureOptions", "GradIndexCallback", "GradIndexCapture", "KeepAll", "LiveCapture",
           "OnlineSelector", "RandomFraction", "Reweight", "SelectingLoader", "SelectionCallback", "Threshold",
           "TopFraction", "end_capture", "keep_rows", "target_from_texts", "with_row_ids"]


def __getattr__(name: str):
    if name in ("GradIndexCallback", "SelectionCallback"):  # import transformers' Trainer machinery: only when asked
        from gradindex.integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
