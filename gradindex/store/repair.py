"""Is the store intact, and which command repairs it (``gradindex build ... --repair``)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from gradindex.checksum import Damage, check_files, recorded
from gradindex.manifest import read_manifest
from gradindex.store.shards import STORE_DIR, shard_name


def build_command(index_dir: str | os.PathLike, manifest: dict | None = None, extra: str = "--repair") -> str:
    """The ``gradindex build`` command line that made this index (from its manifest), plus ``extra``."""
    m = manifest if manifest is not None else read_manifest(index_dir)
    c, proj = m.get("config", {}), m.get("build", {}).get("projection", {})
    kind = proj.get("kind", "gaussian")
    args = ["gradindex", "build", m.get("model_id") or "MODEL_DIR", m.get("data_id") or "DATA",
            "--out", str(index_dir),
            "--projection", "none" if kind == "none" else f"{proj.get('k_a')}x{proj.get('k_g')}"]
    if kind != "none":
        args += ["--projection-kind", kind]
    args += ["--seed", str(proj.get("seed", 0))]
    for pattern in c.get("layers", []):
        args += ["--layers", pattern]
    text_field = m.get("counts", {}).get("text_field")
    if text_field and text_field not in ("input_ids", "prompt+completion"):
        args += ["--text-field", text_field]
    args += ["--max-length", str(c.get("max_length", 512)), "--batch-size", str(c.get("batch_size", 8)),
             "--dtype", m.get("dtype", "float32"), "--route", c.get("route", "auto"),
             "--storage", c.get("storage", "fp32"), "--shard-size", str(c.get("shard_size", 4096))]
    if c.get("precondition", "none") != "none":
        args += ["--precondition", c["precondition"], "--damping", str(c.get("damping", 0.1))]
    return shlex.join(args + ["--no-index"]) + (f" {extra}" if extra else "")


def check_store(index_dir: str | os.PathLike, full: bool = True, manifest: dict | None = None) -> list[Damage]:
    """Damaged or missing shards of a complete store (``full``: whole-file hashes, else the cheap check)."""
    m = manifest if manifest is not None else read_manifest(index_dir)
    repair = build_command(index_dir, m)
    names = set(recorded(index_dir, f"{STORE_DIR}/"))
    if m.get("status") == "complete":
        names |= {f"{STORE_DIR}/{shard_name(k)}" for k in range(int(m.get("counts", {}).get("shards", 0)))}
    d = Path(index_dir)
    missing = [Damage(n, "missing", repair) for n in sorted(names) if not (d / n).exists()]
    return missing + check_files(d, sorted(n for n in names if (d / n).exists()), full, repair)
