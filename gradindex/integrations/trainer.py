"""The ``transformers.Trainer`` form (TRL's ``SFTTrainer`` is a Trainer too): a callback."""

from __future__ import annotations

import logging
import os

import numpy as np
from transformers import TrainerCallback

from gradindex.chat import MESSAGES, template_of
from gradindex.integrations.live import MISSING_ROWS, ROW_KEY, LiveCapture
from gradindex.integrations.loop import capture_options
from gradindex.integrations.tokens_check import loop_tokens_differ

log = logging.getLogger("gradindex")


class GradIndexCallback(TrainerCallback):
    """Capture every training example's projected gradient from the Trainer's own backward::

        train = with_row_ids(train)          # a 'gradindex_row' column: each row's position
        args = TrainingArguments(..., remove_unused_columns=False)
        trainer = Trainer(model, args, train_dataset=train, data_collator=collator,
                          callbacks=[GradIndexCallback("my-index", projection="16")])
        trainer.train()                      # the store and manifest are written at the end

    Options are ``gradindex build``'s (``projection``, ``layers``, ``seed``, ...) and those of
    :class:`gradindex.integrations.live.CaptureOptions`. Rows carry the step (``state.global_step``
    before the update), the epoch (``state.epoch``) and the learning rate of their update.
    """

    def __init__(self, out_dir: str | os.PathLike, **options):
        self.out_dir = out_dir
        self.options = capture_options(options)
        self.live: LiveCapture | None = None
        self.manifest: dict = {}
        self._num_rows: int | None = None
        self.tokens_note: str | None = None
        """Set at the end when the trainer's tokens of the examples differ from the data file's (also logged)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kw):
        dataset = getattr(train_dataloader, "dataset", None)
        cols = getattr(dataset, "column_names", None)
        if cols is not None and ROW_KEY not in cols:
            raise ValueError(MISSING_ROWS)
        if cols is not None and args.remove_unused_columns:
            raise ValueError(
                f"TrainingArguments(remove_unused_columns=True) drops the '{ROW_KEY}' column before the "
                "collator, so gradients cannot be mapped to training rows; set remove_unused_columns=False "
                "(and give the data set only the columns the collator takes)"
            )
        if getattr(args, "label_smoothing_factor", 0.0):  # (the Trainer then takes the labels out of the batch)
            raise ValueError(
                f"TrainingArguments(label_smoothing_factor={args.label_smoothing_factor}): a label-smoothed loss is "
                "not a sum of token cross-entropies, so its per-example gradients are not the ones gradindex "
                "attributes; train with label_smoothing_factor=0 while capturing")
        if (self.options.text_field == MESSAGES and getattr(args, "assistant_only_loss", None) is False
                and cols is not None and "labels" not in cols):  # (TRL makes the labels; a set may bring its own)
            raise ValueError(  # (TRL's SFTConfig: every token of a chat trained, where the index's chats are not)
                "SFTConfig(assistant_only_loss=False) trains each chat on every token, while an index of 'messages' "
                "data takes the loss on the assistant turns only (as `gradindex build` tokenizes chats), so its "
                "rows would not be its conversations' gradients; set assistant_only_loss=True (the chat template "
                "must mark the assistant turns with {% generation %}), or render the chats to text and capture "
                "with text_field='text'")
        if state.global_step > 0:  # (the killed run's log holds rows of steps past the checkpoint)
            raise ValueError(
                f"this run resumes from a checkpoint at step {state.global_step}: a live capture records whole runs "
                "only, and the rows of the steps before it are not in this one; build the index of the final model "
                "offline (`gradindex build MODEL_DIR DATA --out INDEX_DIR`), or train from the start with the "
                "callback")
        if self.options.num_rows is None and dataset is not None and hasattr(dataset, "__len__"):
            self._num_rows = len(dataset)
        check_row_ids(dataset, self.options.num_rows or self._num_rows)
        if not self.options.model_id:
            self.options.model_id = str(args.output_dir)
        tok = kw.get("processing_class") or kw.get("tokenizer")
        if self.options.text_field == MESSAGES and not self.options.chat_template and tok is not None:
            self.options.chat_template = template_of(tok) or ""
        if self.live is not None and not self.live.closed:  # (a run of this callback that raised: ended first)
            self.live.abort()
        self.live = LiveCapture(model, self.out_dir, self.options)
        self.live.set_optimizer(optimizer)
        self.live.step = state.global_step
        self.live.epoch = state.epoch or 0.0
        self.live.attach()

    def on_step_begin(self, args, state, control, **kw):
        self.live.step = state.global_step
        self.live.epoch = state.epoch or 0.0

    def on_substep_end(self, args, state, control, **kw):
        self.live.flush()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.live.flush()

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.live.optimizer_stepped(optimizer)
        self.live.step = state.global_step

    def on_train_end(self, args, state, control, **kw):
        if self.live is not None and not self.live.closed:
            self.manifest = self.live.close(self._num_rows)
            if self.manifest:  # (rank 0: the store is written)
                self.tokens_note = loop_tokens_differ(self.out_dir, self.manifest,
                                                      kw.get("processing_class") or kw.get("tokenizer"))
                if self.tokens_note:
                    log.warning(self.tokens_note)


class SelectionCallback(TrainerCallback):
    """Online data selection inside the Trainer (:mod:`gradindex.integrations.selection`)::

        trainer = Trainer(model, args, train_dataset=train, data_collator=collator,
                          callbacks=[SelectionCallback(target, TopFraction(0.25))])

    ``target`` and ``policy`` as :class:`gradindex.integrations.selection.OnlineSelector` takes them, and
    its keyword options. Each training forward is scored in a pre-hook of the model, at the parameters
    of that forward; dropped examples get weight 0 on the logits' gradient (the batch keeps its shape,
    so no training compute is saved; the logged loss is the unweighted one). ``refresh_every`` counts
    the Trainer's optimizer steps; ``precondition="adam"`` reads the Trainer's optimizer. The selector is
    :attr:`selector` (its ``stats``, ``last_scores``).
    """

    def __init__(self, target, policy, **options):
        from gradindex.integrations.selection import OnlineSelector

        if "optimizer" in options or "count_steps" in options:
            raise TypeError("SelectionCallback takes the Trainer's optimizer and counts its steps itself; "
                            "do not pass optimizer= or count_steps=")
        self._make = lambda model, opt: OnlineSelector(model, target, policy, optimizer=opt, count_steps=False,
                                                       **options)
        self.selector = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.selector = self._make(model, optimizer)
        self.selector.step = state.global_step
        self.selector.attach()

    def on_step_end(self, args, state, control, **kw):
        self.selector.step = state.global_step

    def on_train_end(self, args, state, control, **kw):
        if self.selector is not None:
            self.selector.close()


def check_row_ids(dataset, n: int | None) -> None:
    """Refuse, before training, a row-id column outside ``[0, n)`` (``n``: ``num_rows``, else the data set's length):
    the store is assembled after the run, and such ids would be refused only then."""
    if dataset is None or n is None or ROW_KEY not in (getattr(dataset, "column_names", None) or ()):
        return
    ids = np.asarray(dataset[ROW_KEY])
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= n):
        what = f"run {ids.min()}..{ids.max()}" if np.issubdtype(ids.dtype, np.number) else f"are {ids.dtype}"
        raise ValueError(
            f"the data set's '{ROW_KEY}' ids {what}, outside a data set of {n} rows: they are the 0-based positions "
            "of the examples in the data set the index is built over (with_row_ids(ds) before any shuffle or "
            "select), or pass num_rows= that data set's length (where the trainer dropped rows itself, as TRL "
            "drops examples left with no loss token, num_rows= the original length keeps the ids)")
