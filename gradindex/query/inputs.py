"""Queries in any form → records → token ids and labels, tokenized exactly as the build does.

A single query is a text (``str``), a ``(prompt, completion)`` tuple (loss on the completion
only), a sequence of token ids (loss on every next token), or a record ``dict`` with the fields
:func:`gradindex.data.tokenize_records` reads (``text``/``--text-field``, ``prompt`` +
``completion``, or ``input_ids`` with optional ``labels``). A batch is a ``list`` of these.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradindex.chat import MESSAGES, render_turns
from gradindex.data import IGNORE, Records, load_records, tokenize_records


@dataclass
class QueryTokens:
    """Tokenized queries, with what truncation did to each."""

    records: list[dict]
    input_ids: list[list[int]]
    labels: list[list[int]]
    truncated: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


def _is_ids(q) -> bool:
    if isinstance(q, torch.Tensor | np.ndarray):
        return q.ndim == 1
    return isinstance(q, Sequence) and not isinstance(q, str | tuple) and len(q) > 0 and all(
        isinstance(x, int | np.integer) for x in q)


def as_record(q, text_field: str = "text") -> dict:
    """One query as a record dict (see the module doc for the accepted forms)."""
    if isinstance(q, str):
        return {text_field: q}
    if isinstance(q, tuple) and len(q) == 2 and all(isinstance(x, str) for x in q):
        return {"prompt": q[0], "completion": q[1]}
    if isinstance(q, dict):
        return dict(q)
    if _is_ids(q):
        return {"input_ids": [int(x) for x in (q.tolist() if hasattr(q, "tolist") else q)]}
    raise TypeError(
        f"cannot read a query of type {type(q).__name__}; give a text, a (prompt, completion) tuple, "
        "a list of token ids, or a record dict"
    )


def as_records(queries, text_field: str = "text") -> list[dict]:
    """A batch (``list``; or a 2-D tensor of ids) → records."""
    if isinstance(queries, torch.Tensor | np.ndarray) and queries.ndim == 2:
        return [as_record(row, text_field) for row in queries]
    if not isinstance(queries, list):
        raise TypeError(f"a batch of queries is a list, got {type(queries).__name__}")
    if not queries:
        raise ValueError("the batch of queries is empty")
    if _is_ids(queries):
        raise TypeError("a list of ints is one token-id query; use query(), or wrap it: query_batch([ids])")
    return [as_record(q, text_field) for q in queries]


def read_queries(path: str | os.PathLike) -> list[dict]:
    """Records of a query file, in any format `gradindex build` reads; each record is typed on its own.

    A file may mix forms (``text``, ``prompt`` + ``completion``, ``input_ids``): its table gives every
    record every column, ``None`` where the record has none, so those are dropped here and each record
    keeps only its own fields (:func:`tokenize_queries` tokenizes records of one form together).
    """
    fix = 'give it one query a line, e.g. {"prompt": "...", "completion": "..."}'
    ds = load_records(path, "query file", fix)
    if len(ds) == 0:
        raise ValueError(f"query file {str(path)!r} holds no records; {fix}")
    return [{f: v for f, v in r.items() if v is not None} for r in ds.to_list()]


def tokenize_queries(records: list[dict], tokenizer, max_length: int,
                     text_field: str = "text", vocab_size: int | None = None) -> QueryTokens:
    """Token ids and labels per record, truncated to the build's ``max_length`` (flagged).

    Records with the same fields are tokenized together by :func:`tokenize_records` (the build's
    code, which also truncates and flags). Token-id records need no ``tokenizer`` (``None``).
    """
    if tokenizer is None:
        texts = [i for i, r in enumerate(records) if "input_ids" not in r]
        if texts:
            raise ValueError(f"query {texts[0]} is text ({_preview(records[texts[0]])}), and this engine has no "
                             "tokenizer; pass tokenizer=, or give token ids")
    ids: list[list[int]] = [[] for _ in records]
    labels: list[list[int]] = [[] for _ in records]
    truncated = [False] * len(records)
    groups: dict[tuple, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(tuple(sorted(rec)), []).append(i)
    for members in groups.values():
        ds = Records([records[i] for i in members])
        tok = tokenize_records(ds, tokenizer, max_length, text_field, vocab_size=vocab_size,
                               require_targets=False)
        for j, i in enumerate(members):
            ids[i], labels[i], truncated[i] = tok.input_ids[j], tok.labels[j], tok.truncated[j]
    for i, y in enumerate(labels):
        if not any(t != IGNORE for t in y[1:]):
            raise ValueError(
                f"query {i} has no target token to take a loss on ({_preview(records[i])}): a text needs at "
                "least two tokens, a completion at least one" + (" after truncation" if truncated[i] else "")
            )
    return QueryTokens(records, ids, labels, truncated)


def describe(rec: dict, text_field: str = "text", sep: str = "|") -> str:
    """A query record as one line of text: its text, ``prompt<sep>completion``, or its token count."""
    if rec.get(text_field) is not None:
        return str(rec[text_field])
    if "prompt" in rec:
        return f"{rec['prompt']}{sep}{rec.get('completion', '')}"
    if rec.get(MESSAGES) is not None:
        return render_turns(rec[MESSAGES], sep=f" {sep} ")
    return f"[{len(rec.get('input_ids', []))} token ids]"


def _preview(rec: dict, n: int = 40) -> str:
    s = repr(rec)
    return s if len(s) <= n else s[: n - 3] + "..."
