"""The plain-PyTorch-loop form: a context manager around the user's unchanged loop."""

from __future__ import annotations

import dataclasses
import os
import warnings

from torch import nn

from gradindex.integrations.live import CaptureOptions, LiveCapture


def capture_options(options: dict) -> CaptureOptions:
    """:class:`CaptureOptions` from keyword arguments, naming any that is not one."""
    known = {f.name for f in dataclasses.fields(CaptureOptions)}
    bad = sorted(set(options) - known)
    if bad:
        raise TypeError(f"unknown capture option(s) {bad}; options are {sorted(known - {'extra'})}")
    return CaptureOptions(**options)


class GradIndexCapture:
    """Capture per-example projected gradients inside a plain training loop::

        with GradIndexCapture(model, "my-index", optimizer=opt, projection="16") as cap:
            for epoch in range(E):
                cap.epoch = epoch
                for batch in loader:                        # each batch carries "gradindex_row"
                    loss = model(**batch).loss / accum      # the model drops "gradindex_row"
                    loss.backward()
                    ...opt.step(); opt.zero_grad()

    Row ids come with the batch (the ``gradindex_row`` input, removed before the model's forward
    runs) or from :meth:`batch` called before the forward. With ``optimizer`` given, steps and the
    learning rate are read from it (a step post-hook). The store and manifest are written when the
    block exits normally; after an exception the rows so far stay in ``out_dir/capture``.
    Options: :class:`gradindex.integrations.live.CaptureOptions`.
    """

    def __init__(self, model: nn.Module, out_dir: str | os.PathLike, optimizer=None, **options):
        self.live = LiveCapture(model, out_dir, capture_options(options))
        self.optimizer = optimizer
        self.manifest: dict = {}
        self._opt_handle = None
        self._entered = False
        if optimizer is not None:
            self.live.set_optimizer(optimizer)

    def __del__(self) -> None:
        if getattr(self, "_entered", True):  # (entered: its `with` block ended it)
            return
        try:  # (a capture never entered has hooked nothing: its loop was lost)
            self.live.release()
            warnings.warn(f"a GradIndexCapture for {str(self.live.out)!r} was never entered, so it captured nothing: "
                          "run the training loop inside `with GradIndexCapture(...) as cap:`", stacklevel=1)
        except Exception:  # noqa: BLE001 -- at interpreter exit the modules it needs may be gone
            pass

    @property
    def epoch(self) -> float:
        return self.live.epoch

    @epoch.setter
    def epoch(self, value: float) -> None:
        self.live.epoch = value

    @property
    def step(self) -> int:
        """Optimizer updates done so far (the ``step`` of the rows being captured)."""
        return self.live.step

    def batch(self, row_ids, labels=None, attention_mask=None) -> None:
        """Row ids of the next forward's examples (and its labels/mask if the model is not given them)."""
        if not self._entered or self.live.closed:
            raise RuntimeError(f"cap.batch() was called {'after' if self._entered else 'before'} the capture's "
                               "`with` block: nothing is hooked, so the forward would not be captured; call it inside "
                               "`with GradIndexCapture(...) as cap:`, around the training loop")
        self.live.batch(row_ids, labels, attention_mask)

    def __enter__(self) -> GradIndexCapture:
        if self.live.closed:  # (a second block lost its rows and left two hooks on the model)
            raise RuntimeError("this GradIndexCapture wrote its index when its `with` block ended; a capture is "
                               "entered once: put one `with` around every epoch (set cap.epoch inside it), or make "
                               "a new GradIndexCapture with another out_dir")
        self._entered = True
        self.live.attach()
        if self.optimizer is not None:
            self._opt_handle = self.optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self.live.optimizer_stepped(opt))
        elif self.live.opt.save_optimizer_state:
            raise ValueError("save_optimizer_state needs the optimizer: pass optimizer= to GradIndexCapture")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._opt_handle is not None:
            self._opt_handle.remove()
        if exc_type is not None:
            self.live.abort()
            return
        self.manifest = self.live.close() or getattr(self.live, "manifest", {})  # (closed inside the block: kept)
