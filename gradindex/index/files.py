"""The FAISS side of an index directory (``faiss/``): paths, ``index.json``, atomic writes and swaps.

Both the index builder and the index loader use these; nothing else knows the file names.

A build writes a complete new set of files into ``faiss.new/`` and then swaps it in:
``faiss/ → faiss.old/``, ``faiss.new/ → faiss/``, remove ``faiss.old/``. A crash at any point
leaves a complete set that :func:`live_dir` finds (``faiss/``, else a complete ``faiss.new/``,
else ``faiss.old/``), and the next build finishes or undoes the swap (:func:`settle_swap`).

Each file's hash is recorded in ``checksums.json`` under the folder it was written in
(``faiss.new/<file>``) and moved to ``faiss/<file>`` after the swap; until then a file passes its
check when it matches the record of either folder (every recorded hash is of a complete file
this library wrote, and ``index.json`` ties the set together).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import faiss
import numpy as np

from gradindex.checksum import Damage, file_digest, read_checksums, record, rename_records, sample_digest
from gradindex.index import gpu
from gradindex.spec import layout

FAISS_DIR = layout.FAISS_DIR
STAGING_DIR = FAISS_DIR + ".new"
RETIRED_DIR = FAISS_DIR + ".old"
META = layout.FAISS_META
NORMS = layout.FAISS_NORMS


def faiss_dir(index_dir: str | os.PathLike) -> Path:
    """``faiss/``: the indices queries use."""
    return Path(index_dir) / FAISS_DIR


def staging_dir(index_dir: str | os.PathLike) -> Path:
    """``faiss.new/``: where a build writes until it is complete and swapped in."""
    return Path(index_dir) / STAGING_DIR


def layer_path(folder: Path, layer: str) -> Path:
    return Path(folder) / layout.faiss_name(layer)


def read_meta_at(folder: Path) -> dict | None:
    """``index.json`` of one folder (``None`` when absent); a corrupt file is an error naming it."""
    p = Path(folder) / META
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        index_dir = Path(folder).parent
        raise ValueError(f"{str(p)!r} is corrupt ({e}); rebuild with `gradindex index {index_dir}`") from None


def _complete(folder: Path) -> bool:
    try:
        meta = read_meta_at(folder)
    except ValueError:
        return False
    return meta is not None and meta.get("status") == "complete"


def live_dir(index_dir: str | os.PathLike) -> Path:
    """The folder whose indices answer queries: ``faiss/``, or the complete set a swap left behind."""
    live = faiss_dir(index_dir)
    if live.exists():
        return live
    new, old = staging_dir(index_dir), Path(index_dir) / RETIRED_DIR
    if _complete(new):
        return new
    if old.exists():
        return old
    return live


def layer_file(index_dir: str | os.PathLike, layer: str) -> Path:
    """A layer's index file in the live folder."""
    return layer_path(live_dir(index_dir), layer)


def read_meta(index_dir: str | os.PathLike) -> dict | None:
    """``index.json`` of the live folder (``None`` when there are no indices)."""
    return read_meta_at(live_dir(index_dir))


def settle_swap(index_dir: str | os.PathLike) -> None:
    """Finish a swap a crash interrupted (a complete ``faiss.new/`` goes live), or undo it."""
    live, new, old = faiss_dir(index_dir), staging_dir(index_dir), Path(index_dir) / RETIRED_DIR
    if _complete(new):
        swap_in(index_dir)
        return
    if not live.exists() and old.exists():
        os.replace(old, live)
    if live.exists() and old.exists():
        shutil.rmtree(old)
    if not new.exists():  # the swap's renames happened, its records did not move yet
        _settle_records(index_dir)


def swap_in(index_dir: str | os.PathLike) -> None:
    """Make the complete ``faiss.new/`` the live ``faiss/``, each step a rename (module doc)."""
    live, new, old = faiss_dir(index_dir), staging_dir(index_dir), Path(index_dir) / RETIRED_DIR
    if old.exists() and live.exists():
        shutil.rmtree(old)
    if live.exists():
        os.replace(live, old)
    os.replace(new, live)
    _settle_records(index_dir)
    if old.exists():
        shutil.rmtree(old)


def _settle_records(index_dir: str | os.PathLike) -> None:
    """The staged files' hashes become the live folder's (the old set's records go)."""
    names = read_checksums(index_dir)
    staged = [n for n in names if n.startswith(f"{STAGING_DIR}/")]
    if staged:
        rename_records(index_dir, {n: f"{FAISS_DIR}/{n.split('/', 1)[1]}" for n in staged},
                       drop_prefix=f"{FAISS_DIR}/")


def write_json(p: Path, obj: dict, indent: int = 2) -> None:
    """Write ``obj`` to ``p`` atomically (a killed write leaves the previous file)."""
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent, sort_keys=True, default=str))
    os.replace(tmp, p)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst``, else (another file system) copy it."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_index(index: faiss.Index, p: Path, index_dir: str | os.PathLike | None = None) -> None:
    """Write a (CPU copy of a) FAISS index to ``p`` atomically; with ``index_dir``, record its hash
    (under ``<folder>/<file>``, the folder ``p`` is in)."""
    tmp = p.with_name(p.name + ".tmp")
    faiss.write_index(gpu.to_cpu(index), str(tmp))
    if index_dir is not None:
        record(index_dir, [tmp], [f"{p.parent.name}/{p.name}"])
    os.replace(tmp, p)


def write_norms(folder: Path, sq: np.ndarray) -> Path:
    """Write ``<folder>/norms.npy`` atomically and record its hash."""
    p = Path(folder) / NORMS
    tmp = p.with_name("norms.tmp.npy")
    np.save(tmp, sq)
    record(Path(folder).parent, [tmp], [f"{Path(folder).name}/{NORMS}"])
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
    if key.get("sketch_bytes"):
        args += ["--sketch-bytes", str(key["sketch_bytes"])]
    if key.get("train_size"):
        args += ["--train-size", str(key["train_size"])]
    if key.get("seed"):
        args += ["--seed", str(key["seed"])]
    return " ".join(args)


def check_faiss(index_dir: str | os.PathLike, full: bool = True, names: list[str] | None = None) -> list[Damage]:
    """Damaged or missing files of the live FAISS folder (``names``: these file names only; default
    every recorded one). A file passes when it matches the hash recorded for it in its own folder
    or in ``faiss/`` / ``faiss.new/`` (module doc: a swap moves the records after the renames)."""
    folder = live_dir(index_dir)
    files = read_checksums(index_dir)
    prefixes = list(dict.fromkeys([f"{folder.name}/", f"{FAISS_DIR}/", f"{STAGING_DIR}/"]))
    if names is None:
        names = sorted({k.split("/", 1)[1] for k in files if k.startswith(f"{folder.name}/")})
    repair = index_command(index_dir)
    out = []
    for n in names:
        entries = [files[p + n] for p in prefixes if p + n in files]
        if not entries:
            continue
        path, rel = folder / n, f"{folder.name}/{n}"
        if not path.exists():
            out.append(Damage(rel, "missing", repair))
            continue
        size = path.stat().st_size
        same = [e for e in entries if e["bytes"] == size]
        if not same:
            out.append(Damage(rel, f"{size} bytes, {entries[0]['bytes']} were written", repair))
        elif not any(sample_digest(path) == e["sample"] and (not full or file_digest(path) == e["blake2b"])
                     for e in same):
            out.append(Damage(rel, "content differs from the hash recorded when it was written", repair))
    return out
