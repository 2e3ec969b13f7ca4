"""Is the store intact? Damaged shards name their repair, ``gradindex build ... --repair``."""

from __future__ import annotations

import os
from pathlib import Path

from gradindex.checksum import Damage, check_files, recorded
from gradindex.manifest import build_command, read_manifest
from gradindex.store.shards import STORE_DIR, shard_name


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
