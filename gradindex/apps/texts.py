"""Texts of training rows for reports: the build's tokenizer and data file, checked row by row; results' texts
capped alike in ``gradindex query --json`` and the server (:func:`capped`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gradindex.query.texts import TrainingTexts
from gradindex.store.opened import OpenStore

RESULT_TEXT_CHARS = 2000
"""Characters of a training text in a result (``query --json``, the server's ``/query``); the whole text is at
the server's ``GET /example/ID``. A result says ``text_chars`` (the whole length) and ``truncated``."""


def capped(hit: dict, limit: int = RESULT_TEXT_CHARS) -> dict:
    """A result's dict with its ``text`` cut to ``limit`` characters, ``text_chars`` (the whole text's length,
    ``None`` without a text) and ``truncated``."""
    text = hit.get("text")
    n = None if text is None else len(text)
    cut = n is not None and n > limit
    return {**hit, "text": text[:limit] if cut else text, "text_chars": n, "truncated": cut}


def capped_result(result: dict) -> dict:
    """A query's answer (``QueryResult.to_dict()``) with every hit's text :func:`capped`."""
    return {**result, **{key: [capped(h) for h in result[key]] for key in ("hits", "lowest") if key in result}}


def row_texts(ix: OpenStore, ids, data: str | os.PathLike | None = None,
              model_dir: str | os.PathLike | None = None) -> tuple[list[str | None], str | None]:
    """``(texts, problem)``: each row's text (``None`` when unknown) and why texts are missing, if so."""
    from gradindex.model import is_gguf, load_tokenizer

    manifest = ix.manifest
    path = Path(model_dir or manifest.get("model_id") or "")
    if not str(path) or not ((path / "config.json").exists() or (path / "tokenizer_config.json").exists()
                             or (is_gguf(path) and path.is_file())):
        return [None] * len(ids), f"the model directory {str(path)!r} is not there, so rows carry no text (--model)"
    texts = TrainingTexts(manifest, ix.store, load_tokenizer(path, manifest.get("chat_template")), data)
    return texts.texts(np.asarray(ids, dtype=np.int64)), texts.problem
