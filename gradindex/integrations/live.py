"""Per-example gradients from the backward a training loop already runs: the core of both front ends.

Per micro-batch (one forward and one backward of the user's loop):

1. a forward pre-hook on the model takes the batch's training row ids (the ``gradindex_row``
   input, removed before the model sees it, or :meth:`LiveCapture.batch`), labels and attention
   mask, and the step, epoch and learning rate in force;
2. :class:`gradindex.capture.GradientCapture` (``weight_free=False``) hooks the chosen layers'
   outputs, so their per-example projected gradients are summed while the user's
   ``loss.backward()`` runs; no gradient or parameter of the loop is touched;
3. a hook on the model's output logits measures the loss scale ``c``
   (:class:`~gradindex.integrations.loss_scale.LossScaleFit`): whatever the loop's reduction
   (HF's mean over the batch's target tokens, ``num_items_in_batch`` under gradient accumulation,
   a division by the accumulation steps, a GradScaler's factor), the gradient it sends to the
   target logit of token ``t`` is ``c · (p_t − 1)``, so ``c`` is a least-squares fit over the
   batch's target tokens. Rows are divided by ``c`` and so equal the offline build's per-example
   gradients of the summed token loss (:data:`gradindex.store.builder.LOSS_CONVENTION`). A loss that
   is not one uniformly scaled sum of token cross-entropies (label smoothing, per-example weights)
   fails the fit's check with an error at the first step. With a fused LM head (TRL's SFTTrainer
   returns per-token ``log_probs`` instead of logits) the gradient of each target log-probability
   is ``−c`` directly;
4. at the next micro-batch (or the end) the rows go to the capture log; at the end the log becomes
   the store and the manifest (:mod:`gradindex.integrations.assemble`).

In a causal LM with an attention mask, the output gradient of example ``i`` only involves example
``i``'s tokens (no layer mixes examples), so the per-example sums are exact; the tests check it
against the offline build (GPT-2, Llama, padded batches).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gradindex import distributed
from gradindex.adapter import unwrap_peft
from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import finite_rows
from gradindex.data import IGNORE, token_hash
from gradindex.fingerprint import model_fingerprint
from gradindex.integrations.assemble import assemble_store
from gradindex.integrations.capture_log import CaptureLog, rank_dir
from gradindex.integrations.loss_scale import LossScaleFit, MicroBatch
from gradindex.integrations.optimizer_state import save_second_moments
from gradindex.lock import LOCK, index_lock
from gradindex.spec.layout import CAPTURE_LOG_DIR
from gradindex.spec.manifest import manifest_path, new_manifest, write_manifest
from gradindex.store.builder import build_identity
from gradindex.store.codes import check_storage

log = logging.getLogger("gradindex")

ROW_KEY = "gradindex_row"
"""Name of the batch input that carries each example's training row id."""
MISSING_ROWS = (
    "the training batch carries no row ids, so its gradients cannot be mapped back to training rows; "
    f"add a column '{ROW_KEY}' with each example's position in the training data set "
    f"(dataset.map(lambda _, i: {{'{ROW_KEY}': i}}, with_indices=True), or "
    "gradindex.integrations.with_row_ids(dataset)) and keep it through the collator "
    "(Trainer: TrainingArguments(remove_unused_columns=False); a collator that drops columns it does not know, "
    "as TRL's does: wrap it, data_collator=keep_rows(collator); packing or padding-free batches hold no one "
    "example a row: turn them off); in a plain loop call capture.batch(row_ids) before the forward"
)


@dataclass
class CaptureOptions:
    """What :class:`LiveCapture` is told; the first six are ``gradindex build``'s options."""

    projection: str | ProjectionSpec = "16"
    """``K``, ``KAxKG`` or ``none`` (or a :class:`ProjectionSpec`)."""
    projection_kind: str = "gaussian"
    seed: int = 0
    """Projection seed."""
    layers: Sequence[str] = ()
    """Glob patterns of layers to hook; empty = every linear layer in the transformer blocks."""
    route: str = "auto"
    shard_size: int = 4096
    storage: str = "fp32"
    """Row codes in the store: ``fp32``, ``fp16``, ``int8`` or ``int4`` (:mod:`gradindex.store.codes`)."""
    max_length: int = 512
    """Recorded for queries (they truncate to it); training batches are taken as they come."""
    num_rows: int | None = None
    """Rows of the training data set (default: the Trainer's ``train_dataset``, else max id + 1)."""
    keep: str = "last"
    """Which occurrence of a row seen in several epochs the store keeps: ``last`` or ``first``."""
    loss_scale: float | None = None
    """The loss's factor on each example's summed token loss, when it cannot be measured (see module doc)."""
    record_loss: bool = False
    """Store each example's summed token loss (a softmax over every position: ~5% of a step at vocab 8192)."""
    save_optimizer_state: Sequence[int] = ()
    """Save Adam's ``exp_avg_sq`` after these optimizer steps (``optimizer/step-NNNNNNN.safetensors``)."""
    keep_log: bool = False
    """Keep ``capture/`` (every occurrence of every row, with its step) after the store is written."""
    model_id: str = ""
    """Model directory recorded in the manifest (queries and fits load it; save the trained model there)."""
    data_id: str = ""
    """Training data file recorded in the manifest (queries show its texts)."""
    text_field: str = "text"
    chat_template: str = ""
    """The chat template of ``messages`` training data (``text_field="messages"``), recorded so that queries and
    fits tokenize chats alike; the Trainer callback takes the trainer's tokenizer's when it is not given."""
    overwrite: bool = False
    """Replace a non-empty ``out_dir``."""
    extra: dict = field(default_factory=dict)

    def spec(self) -> ProjectionSpec:
        if isinstance(self.projection, ProjectionSpec):
            return self.projection
        return ProjectionSpec.parse(self.projection, kind=self.projection_kind, seed=self.seed)


LIVE_MARK = "_gradindex_live_capture"
ALREADY_CAPTURED = (
    "this model is already under another live capture (a GradIndexCapture or GradIndexCallback not yet closed); one "
    "capture a model: end the other first (a training run that raised leaves its capture open: "
    "gradindex.integrations.end_capture(model) ends it)")
"""The attribute a model carries while a live capture's hooks are on it."""
COMBINED = ("online selection scores batches with its own forward and backward, which the live capture's hooks on this "
            "model would record as training rows: do not combine GradIndexCapture / GradIndexCallback with online "
            "selection on one model in one run (capture in its own run, or build the index offline afterwards)")


def row_ids(rows) -> np.ndarray:
    """A batch's row ids as int64, refused unless they are whole numbers (0-based positions in the data set)."""
    try:
        t = torch.as_tensor(rows).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"row ids must be whole numbers, the examples' 0-based positions in the training data set "
                         f"(with_row_ids(ds) adds them), got {str(rows)[:80]}")
    return np.asarray(t, dtype=np.int64).reshape(-1)


def _tensor(x, name: str) -> torch.Tensor:
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except Exception:  # noqa: BLE001
        raise TypeError(f"batch input {name!r} of type {type(x).__name__} is not a tensor") from None


class LiveCapture:
    """Hooks on a model in training; rows to ``out_dir/capture``, then the store at :meth:`close`."""

    def __init__(self, model: nn.Module, out_dir: str | os.PathLike, options: CaptureOptions):
        if options.keep not in ("last", "first"):
            raise ValueError(f"keep={options.keep!r} is not one of ['last', 'first']")
        self.model = distributed.unwrap(model)  # hooks go on the model the wrapper calls
        self.inner = unwrap_peft(self.model)  # a PeftModel's LoRA layers are named as on the base model
        self.out = Path(out_dir)
        self.opt = options
        self.spec = options.spec()
        check_storage(options.storage)
        if live_capture(self.model) is not None:
            raise RuntimeError(ALREADY_CAPTURED)  # (before the out_dir is touched)
        self._lock = contextlib.ExitStack()  # (one writer: a second run into out_dir is refused while this one runs)
        self._released, self._locked = False, False
        self._handles: list = []
        self.closed = False
        try:
            distributed.on_rank0(self._prepare_out_dir)  # (the other ranks wait; rank 0's refusal raised on all)
            self.rows = ProjectedRows(RowSpace(self.spec), options.route)
            self.fit = LossScaleFit(options.loss_scale, options.record_loss)
            self.capture = GradientCapture(self.inner, options.layers or None, self.rows, weight_free=False)
            self.dims = {n: self.rows.space.dim(n) for n in self.capture.infos}
            self.log = CaptureLog(rank_dir(self.out, distributed.rank()), self.dims, part_rows=options.shard_size)
        except BaseException:
            self.release()
            raise
        self.step = 0
        self.epoch = 0.0
        self.optimizer = None
        self._lr = float("nan")
        self._next: dict | None = None
        self._pending: MicroBatch | None = None
        self._scales: list[float] = []
        self._max_batch = 0
        self._saved_states: list[dict] = []
        self._t0 = time.perf_counter()

    # -- set-up -------------------------------------------------------------------------------
    def _prepare_out_dir(self) -> None:
        """Take the output directory's write lock (a second process writing it is refused; so is a second capture
        into it in this process), then check it (and with ``overwrite`` clear it): rank 0, the other ranks wait."""
        self._lock.enter_context(index_lock(self.out, "live capture", reentrant=False))
        self._locked = True
        held = [p for p in self.out.iterdir() if p.name != LOCK] if self.out.exists() else []
        if held:
            if not self.opt.overwrite:
                raise FileExistsError(
                    f"output directory {str(self.out)!r} is not empty; choose another out_dir, or pass "
                    "overwrite=True to replace it"
                )
            if not manifest_path(self.out).exists() and not (self.out / CAPTURE_LOG_DIR).exists():
                raise FileExistsError(
                    f"{str(self.out)!r} holds files that are not a gradindex index; refusing to delete them"
                )
            for p in held:  # (the lock file stays: this run holds it)
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (self.out / CAPTURE_LOG_DIR).mkdir(parents=True, exist_ok=True)  # (marks a run under way, or killed)

    def release(self) -> None:
        """Give up the output directory's write lock (at the end, or when the run failed: a log that holds no row
        yet is removed, so the same out_dir takes the next run without overwrite=True)."""
        if self._released:
            return
        self._released = True
        log_dir = self.out / CAPTURE_LOG_DIR
        if self._locked and log_dir.is_dir() and not any(p.is_file() for p in log_dir.rglob("*")):
            shutil.rmtree(log_dir, ignore_errors=True)
        self._lock.close()

    def abort(self) -> None:
        """End a run that failed (a loop or a Trainer that raised): hooks off, log closed, lock given up; the rows
        written so far stay in ``out_dir/capture`` (not an index)."""
        self.closed = True
        try:
            self.detach()
            if hasattr(self, "log"):
                self.log.close()
        finally:
            self.release()

    def attach(self) -> LiveCapture:
        if not self._handles:
            if live_capture(self.model) not in (None, self):
                raise RuntimeError(ALREADY_CAPTURED)  # (its hook would take the ids first: MISSING_ROWS here)
            setattr(self.model, LIVE_MARK, weakref.ref(self))  # (online selection refuses to score here: COMBINED)
            self.capture.attach()
            self._handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            if self.opt.loss_scale is None:
                self._handles.append(self.model.register_forward_hook(self._output_hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        owner = getattr(self.model, LIVE_MARK, None)
        if owner is not None and owner() in (None, self):
            delattr(self.model, LIVE_MARK)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.capture.detach()

    def set_optimizer(self, optimizer) -> None:
        """Read the learning rate from ``optimizer``; count its steps when the front end does not."""
        self.optimizer = optimizer

    # -- per micro-batch ----------------------------------------------------------------------
    def batch(self, row_ids, labels=None, attention_mask=None) -> None:
        """Row ids (and labels/mask, when the model is not given them) of the next forward."""
        self._next = {"rows": row_ids, "labels": labels, "attention_mask": attention_mask}

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        rows = kwargs.pop(ROW_KEY, None)
        if not torch.is_grad_enabled():  # (an eval forward: capture.batch()'s ids wait for the training forward)
            return args, kwargs
        self.flush()
        self.capture.next_forward()
        given = self._next or {}
        self._next = None
        rows = given.get("rows") if rows is None else rows
        if rows is None:
            raise ValueError(MISSING_ROWS)
        ids = _tensor(kwargs.get("input_ids", args[0] if args else None), "input_ids")
        if ids is None:
            raise ValueError("the model was called without input_ids; gradindex captures token models only")
        labels = _tensor(kwargs.get("labels", given.get("labels")), "labels")
        mask = _tensor(kwargs.get("attention_mask", given.get("attention_mask")), "attention_mask")
        rows = row_ids(rows)
        B = ids.shape[0]
        if rows.shape[0] != B:
            raise ValueError(
                f"{rows.shape[0]} row ids for a batch of {B} examples; a collator that packs or splits "
                f"examples loses the mapping to training rows (keep one '{ROW_KEY}' per example)"
            )
        if labels is None and self.opt.loss_scale is None:
            raise ValueError(
                "the batch has no labels, so the loss scale cannot be measured; pass labels to the model, "
                "or to capture.batch(row_ids, labels=...)"
            )
        self._max_batch = max(self._max_batch, B)
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else self._lr
        self._pending = MicroBatch(rows, self.step, float(self.epoch), float(lr), ids, labels, mask)
        self.capture.set_mask(mask, tuple(ids.shape) if ids.ndim == 2 else None)
        return args, kwargs

    def _output_hook(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        mb = self._pending
        if mb is not None and torch.is_grad_enabled() and mb.labels is not None:
            self.fit.hook(mb, output)

    def flush(self) -> None:
        """Write the finished micro-batch's rows to the capture log."""
        mb, self._pending = self._pending, None
        if mb is None:
            return
        grads = self.capture.pop()
        self.capture.set_mask(None)
        if not grads:
            log.warning("a forward with gradients enabled had no backward through the hooked layers; "
                        "its %d rows were not captured", len(mb.rows))
            return
        missing = [n for n in self.dims if n not in grads]
        if missing:
            raise ValueError(
                f"hooked layers {missing[:3]}{'...' if len(missing) > 3 else ''} received no gradient in the "
                "backward (frozen?); leave them out with layers=[...] patterns"
            )
        c = self.fit.scale(mb)
        self._scales.append(c)
        B = len(mb.rows)
        ok_c = math.isfinite(c) and c != 0.0
        out = {n: (v / c if ok_c else v * 0.0).cpu().numpy() for n, v in grads.items()}
        finite = finite_rows(out) & ok_c
        for n in out:
            out[n][~finite] = 0.0
        loss = mb.loss.cpu().numpy() if mb.loss is not None else np.full(B, np.nan, np.float32)
        ntok = mb.num_tokens.cpu().numpy() if mb.num_tokens is not None else self._num_tokens(mb)
        self.log.append(
            out, self._hashes(mb),
            ids=mb.rows, step=np.full(B, mb.step), epoch=np.full(B, mb.epoch), lr=np.full(B, mb.lr),
            loss_scale=np.full(B, c), loss=loss, num_tokens=ntok, finite=finite,
        )

    @staticmethod
    def _num_tokens(mb: MicroBatch) -> np.ndarray:
        if mb.labels is None:
            return np.zeros(len(mb.rows), np.int32)
        return (mb.labels[:, 1:] != IGNORE).sum(1).cpu().numpy()

    @staticmethod
    def _hashes(mb: MicroBatch) -> np.ndarray:
        """Each example's :func:`gradindex.data.token_hash` of its real (unpadded) tokens and labels."""
        ids = mb.input_ids.cpu()
        labels = mb.labels.cpu() if mb.labels is not None else ids
        keep = mb.mask.cpu().bool() if mb.mask is not None else torch.ones_like(ids, dtype=torch.bool)
        out = [token_hash(ids[i][keep[i]].tolist(), labels[i][keep[i]].tolist()) for i in range(ids.shape[0])]
        return np.frombuffer(b"".join(out), np.uint8).reshape(-1, 16)

    # -- steps --------------------------------------------------------------------------------
    def optimizer_stepped(self, optimizer=None) -> None:
        """One optimizer update is done: later rows belong to the next step; save state if asked."""
        self.flush()
        self.step += 1
        if self.step in set(self.opt.save_optimizer_state):
            opt = optimizer if optimizer is not None else self.optimizer
            self._saved_states.append(save_second_moments(opt, self.model, self.out, self.step))

    # -- the end ------------------------------------------------------------------------------
    def close(self, num_rows: int | None = None) -> dict:
        """Flush, remove the hooks, write the store and the manifest; return the manifest."""
        if self.closed:
            return {}
        self.closed = True
        try:
            self.flush()
        finally:
            self.detach()
            self.log.close()
        fingerprint = model_fingerprint(self.inner)  # on every rank: FSDP2 gathers each parameter
        stats = distributed.gather((self._scales, self._max_batch, self.step))
        distributed.barrier()  # every rank's capture log is complete: rank 0 assembles them
        if distributed.rank() > 0:
            self.release()
            self.manifest = distributed.broadcast(None)
            return self.manifest
        self._scales = [c for sc, _, _ in stats for c in sc]
        self._max_batch = max(b for _, b, _ in stats)
        n = num_rows if num_rows is not None else self.opt.num_rows
        manifest: dict = {}
        try:
            res = assemble_store(self.out, self.dims, n if n is not None else self._max_id() + 1,
                                 self.opt.shard_size, self.opt.keep, self.opt.storage)
            manifest = self._manifest(res, n if n is not None else self._max_id() + 1, fingerprint)
            write_manifest(self.out, manifest)
            if not self.opt.keep_log:
                shutil.rmtree(self.out / CAPTURE_LOG_DIR, ignore_errors=True)
        finally:
            try:
                self.release()
            finally:
                self.manifest = distributed.broadcast(manifest)  # ({} to the others when this failed)
        if res.unseen:
            log.warning("%d training rows were never seen by the loop; stored as zeros and listed in "
                        "manifest.json 'training.unseen_ids'", len(res.unseen))
        return manifest

    def _max_id(self) -> int:
        from gradindex.integrations.capture_log import log_parts, read_columns

        ids = [read_columns(p, ("ids",))["ids"] for p in log_parts(self.out)]
        return int(max((x.max() for x in ids if x.size), default=-1))

    def _manifest(self, res, n: int, fingerprint: str) -> dict:
        o = self.opt
        scales = np.asarray([s for s in self._scales if math.isfinite(s)])
        build = build_identity(self.inner, fingerprint, self.rows.space, res.data_fingerprint, o.storage, o.max_length,
                               o.shard_size, self._max_batch)
        config = {"projection": self.spec.to_dict(), "layers": list(o.layers), "max_length": o.max_length,
                  "batch_size": self._max_batch, "route": o.route, "shard_size": o.shard_size, "storage": o.storage,
                  "collect_covariance": False, "precondition": "none"}
        counts = {"examples": n, "truncated": 0, "text_field": o.text_field,
                  "shards": (n + o.shard_size - 1) // o.shard_size}
        return new_manifest(
            "complete", o.model_id, o.data_id, build, config, counts, o.chat_template or None,
            nonfinite_ids=sorted(set(res.nonfinite) - set(res.unseen)) + res.unseen,
            routes=dict(self.rows.route_counts),
            training={
                "source": "in-loop capture (gradindex.integrations)",
                "loss_scale": {
                    "how": "given" if o.loss_scale is not None else "fitted on the output logits' gradient",
                    "undone": True,
                    "micro_batches": len(self._scales),
                    "min": float(scales.min()) if scales.size else None,
                    "max": float(scales.max()) if scales.size else None,
                    "per_row": "store column training/loss_scale",
                },
                "steps": self.step,
                "ranks": distributed.world_size(),
                "keep": o.keep,
                "times_seen_max": res.seen_max,
                "log_rows": res.log_rows,
                "unseen_ids": res.unseen,
                "optimizer_state": self._saved_states,
                "seconds": round(time.perf_counter() - self._t0, 3),
                **o.extra,
            },
        )


def live_capture(model: nn.Module) -> LiveCapture | None:
    """The live capture whose hooks are on ``model`` and that is not closed, if any (:data:`LIVE_MARK`)."""
    owner = getattr(distributed.unwrap(model), LIVE_MARK, None)
    live = owner() if owner is not None else None
    return None if live is None or live.closed else live


def end_capture(model: nn.Module) -> bool:
    """End the live capture left open on ``model`` by a run that raised (:meth:`LiveCapture.abort`); whether there
    was one."""
    live = live_capture(model)
    if live is None:
        return False
    live.abort()
    return True

