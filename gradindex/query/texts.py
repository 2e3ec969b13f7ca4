"""Training examples by store row: the text shown with a result, and its tokens for re-ranking.

Texts are not copied into the index: they are read lazily from the data file the build read
(``manifest['data_id']``, or another path given when the index moved), and every row shown is
checked against the 16-byte token hash the build stored for it, so a data file edited since the
build can never label a result with the wrong text.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from gradindex.chat import MESSAGES, render_turns
from gradindex.data import load_records, token_hash, tokenize_records
from gradindex.query.jsonl import JsonlRows
from gradindex.spec.manifest import Manifest, tokens_differ
from gradindex.store import Store

log = logging.getLogger("gradindex")


class TrainingTexts:
    """Lazy access to the training records behind store rows."""

    def __init__(self, manifest: dict, store: Store, tokenizer, data: str | os.PathLike | None = None):
        self.path = Path(data or manifest.get("data_id") or "")
        self.field = manifest.get("counts", {}).get("text_field", "text")
        self.max_length, self.n = Manifest(manifest).max_length, int(manifest["counts"]["examples"])
        self.store, self.tokenizer, self.manifest = store, tokenizer, manifest
        self._ds = None
        self._no_jsonl = False
        self._hashes: np.ndarray | None = None
        self.problem: str | None = None

    def _records(self):
        if self._ds is None and self.problem is None:
            if str(self.path) in ("", ".") or not self.path.exists():  # (Path("") is ".": no data recorded)
                where = "the build recorded no data file" if str(self.path) in ("", ".") else \
                    f"the training data {str(self.path)!r} is not there"
                self.problem = f"{where}, so results carry no text; pass the data file (data= / --data)"
            else:
                ds = (None if self._no_jsonl else self._jsonl()) or load_records(self.path)
                if len(ds) != self.n:
                    self.problem = (f"{str(self.path)!r} holds {len(ds)} records, the index {self.n}: "
                                    "not the data the index was built from, so results carry no text; "
                                    "pass the original (--data)")
                else:
                    self._ds = ds
            if self.problem:
                log.info(self.problem)  # also a note on every result
        return self._ds

    def unavailable(self) -> bool:
        """Whether the training data cannot be read (:attr:`problem` says why), checked once."""
        return self._records() is None

    def require(self, needs: str, ids: np.ndarray | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and labels of rows ``ids``, each as the build made it (``None``: only that the data reads);
        else a ValueError: ``needs``, the data the index was built from, why not, and how to pass it."""
        if ids is None:
            x, y, bad = [], [], self.unavailable()
        else:
            x, y, ok = self.tokens(ids)
            bad = len(x) != len(ids) or not ok.all()
        if bad:
            why = self.problem or "its rows changed since the build"
            raise ValueError(f"{needs} the index was built from ({why}); pass data= / --data")
        return x, y

    def _jsonl(self) -> JsonlRows | None:
        """The file's rows read without ``datasets`` (:mod:`gradindex.query.jsonl`) when it is JSONL of the
        index's length; ``None`` (read it with ``datasets``) otherwise."""
        if self.path.suffix.lower() != ".jsonl":
            return None
        try:
            rows = JsonlRows(self.path)
        except (OSError, ValueError):
            return None
        return rows if len(rows) == self.n else None

    def tokens(self, ids: np.ndarray) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
        """Token ids and labels of rows ``ids`` as the build made them, and whether each matches
        the stored hash."""
        ds = self._records()
        if ds is None or len(ids) == 0:
            return [], [], np.zeros(len(ids), dtype=bool)
        tf = self.field if self.field not in ("input_ids", "prompt+completion") else "text"
        try:
            tok = tokenize_records(ds.select([int(i) for i in ids]), self.tokenizer, self.max_length, tf)
        except ValueError:
            if not isinstance(ds, JsonlRows):
                raise
            tok = None
        hashes = self._stored_hashes(ids)
        ok = np.zeros(len(ids), dtype=bool) if tok is None else np.array(
            [token_hash(x, y) == h.tobytes() for h, x, y in zip(hashes, tok.input_ids, tok.labels, strict=True)],
            dtype=bool)
        if not ok.all() and isinstance(ds, JsonlRows):  # read differently than datasets did: read it as the build
            self._ds, self._no_jsonl = None, True
            return self.tokens(ids)
        if not ok.all():
            log.warning("training rows %s of %s differ from what was indexed, so their text is not shown: %s",
                        [int(i) for i in np.asarray(ids)[~ok]], str(self.path), tokens_differ(self.manifest))
        return tok.input_ids, tok.labels, ok

    def _stored_hashes(self, ids) -> np.ndarray:
        """The build's token hashes of rows ``ids``: a store that reads rows by id (a sharded index's parts, maybe
        on other hosts) gives them, else the whole column (read once)."""
        rows_of = getattr(self.store, "rows_of", None)
        if rows_of is not None:
            return rows_of("token_hash", ids)
        if self._hashes is None:
            self._hashes = self.store.column("token_hash")
        return self._hashes[np.asarray(ids, dtype=np.int64)]

    def texts(self, ids: np.ndarray) -> list[str | None]:
        """The text of each row (``prompt + completion`` joined; decoded ids), ``None`` if unknown."""
        ids = np.asarray(ids, dtype=np.int64)
        token_ids, _, ok = self.tokens(ids)
        if not ok.any():
            return [None] * len(ids)
        rows = self._ds.select([int(i) for i in ids])
        out: list[str | None] = []
        for j, rec in enumerate(rows):
            if not ok[j]:
                out.append(None)
            elif self.field == "prompt+completion":
                out.append(f"{rec['prompt']}{rec['completion']}")
            elif self.field == MESSAGES:
                out.append(render_turns(rec[MESSAGES]))
            elif self.field == "input_ids":
                out.append(self.tokenizer.decode(token_ids[j]))
            else:
                out.append("" if rec[self.field] is None else str(rec[self.field]))
        return out


def attach_texts(results: list, texts: TrainingTexts) -> None:
    """Each hit's training text (read once per distinct id), its time, and any note on the texts."""
    t4 = time.perf_counter()
    ids = np.unique(np.concatenate([[h.id for h in r.hits + r.lowest] for r in results]).astype(np.int64))
    by_id = dict(zip(ids.tolist(), texts.texts(ids), strict=True))
    for r in results:
        for h in r.hits + r.lowest:
            h.text = by_id.get(h.id)
        r.seconds["texts"] = time.perf_counter() - t4
        if texts.problem and texts.problem not in r.notes:
            r.notes.append(texts.problem)
