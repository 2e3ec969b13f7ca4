"""The FAISS side of an index directory (``faiss/``): paths, ``index.json``, and atomic writes.

Both the index builder and the index loader use these; nothing else knows the file names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import faiss
import numpy as np

from gradindex.checksum import Damage, check_files, record, recorded
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


def write_index(index: faiss.Index, p: Path, index_dir: str | os.PathLike | None = None) -> None:
    """Write a (CPU copy of a) FAISS index to ``p`` atomically; with ``index_dir``, record its hash."""
    tmp = p.with_name(p.name + ".tmp")
    faiss.write_index(gpu.to_cpu(index), str(tmp))
    if index_dir is not None:
        record(index_dir, [tmp], [f"{FAISS_DIR}/{p.name}"])
    os.replace(tmp, p)


def write_norms(index_dir: str | os.PathLike, sq: np.ndarray) -> Path:
    """Write ``faiss/norms.npy`` atomically and record its hash."""
    p = faiss_dir(index_dir) / NORMS
    tmp = p.with_name("norms.tmp.npy")
    np.save(tmp, sq)
    record(index_dir, [tmp], [f"{FAISS_DIR}/{NORMS}"])
    os.replace(tmp, p)
    return p


def index_command(index_dir: str | os.PathLike, meta: dict | None = None) -> str:
    """The ``gradindex index`` command that rebuilds what ``faiss/index.json`` describes."""
    try:
        meta = meta if meta is not None else read_meta(index_dir)
    except ValueError:
        meta = None
    if not meta:
        return f"gradindex index {index_dir}"
    factories = sorted({e["factory"] for e in meta.get("layers", {}).values()})
    space, key = meta.get("space", {}), meta.get("key", {})
    args = ["gradindex", "index", str(index_dir), "--index-type", factories[0] if len(factories) == 1 else "auto"]
    if space.get("whiten", "none") != "none":
        args += ["--whiten", space["whiten"], "--damping", str(space.get("damping"))]
    if space.get("normalize"):
        args.append("--normalize")
    if key.get("train_size"):
        args += ["--train-size", str(key["train_size"])]
    if key.get("seed"):
        args += ["--seed", str(key["seed"])]
    return " ".join(args)


def check_faiss(index_dir: str | os.PathLike, full: bool = True, names: list[str] | None = None) -> list[Damage]:
    """Damaged or missing FAISS files (``names``: these file names only; default every recorded one)."""
    rel = [f"{FAISS_DIR}/{n}" for n in names] if names is not None else recorded(index_dir, f"{FAISS_DIR}/")
    return check_files(index_dir, rel, full, index_command(index_dir))
