"""The FAISS side of an index directory (``faiss/``): paths, ``index.json``, and atomic writes.

Both the index builder and the index loader use these; nothing else knows the file names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import faiss

from gradindex.index import gpu

FAISS_DIR = "faiss"
META = "index.json"
NORMS = "norms.npy"


def faiss_dir(index_dir: str | os.PathLike) -> Path:
    return Path(index_dir) / FAISS_DIR


def layer_file(index_dir: str | os.PathLike, layer: str) -> Path:
    return faiss_dir(index_dir) / (layer.replace(os.sep, "_") + ".index")


def read_meta(index_dir: str | os.PathLike) -> dict | None:
    p = faiss_dir(index_dir) / META
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(p)!r} is corrupt ({e}); rebuild with `gradindex index {index_dir}`") from None


def write_json(p: Path, obj: dict) -> None:
    """Write ``obj`` to ``p`` atomically (a killed write leaves the previous file)."""
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, p)


def write_index(index: faiss.Index, p: Path) -> None:
    """Write a (CPU copy of a) FAISS index to ``p`` atomically."""
    tmp = p.with_name(p.name + ".tmp")
    faiss.write_index(gpu.to_cpu(index), str(tmp))
    os.replace(tmp, p)
