"""Texts of training rows for reports: the build's tokenizer and data file, checked row by row."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gradindex.manifest import read_manifest
from gradindex.query.texts import TrainingTexts
from gradindex.store import Store


def row_texts(index_dir: str | os.PathLike, ids, data: str | os.PathLike | None = None,
              model_dir: str | os.PathLike | None = None) -> tuple[list[str | None], str | None]:
    """``(texts, problem)``: each row's text (``None`` when unknown) and why texts are missing, if so."""
    from gradindex.model import is_gguf, load_tokenizer

    manifest = read_manifest(index_dir)
    path = Path(model_dir or manifest.get("model_id") or "")
    if not str(path) or not ((path / "config.json").exists() or (path / "tokenizer_config.json").exists()
                             or (is_gguf(path) and path.is_file())):
        return [None] * len(ids), f"the model directory {str(path)!r} is not there, so rows carry no text (--model)"
    with Store(index_dir) as store:
        texts = TrainingTexts(manifest, store, load_tokenizer(path, manifest.get("chat_template")), data)
        out = texts.texts(np.asarray(ids, dtype=np.int64))
        return out, texts.problem
