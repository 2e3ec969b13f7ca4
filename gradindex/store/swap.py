"""The in-place transcode's swap: the compacted copy in ``STAGING`` replaces the raw rows under a journal.

The store owns this move of its files (the transcode itself, :mod:`gradindex.precondition.compact`,
writes the copy): :func:`swap_in` writes the journal and :func:`finish_transcode` completes it, also
after a kill (every build and transcode calls it first).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from gradindex.checksum import read_checksums, write_checksums
from gradindex.spec import layout
from gradindex.spec.manifest import Manifest, new_generation, write_manifest
from gradindex.store.basis import BASIS_FILE
from gradindex.store.shards import STORE_DIR

log = logging.getLogger("gradindex")

STAGING = layout.TRANSCODE_STAGING
"""The compacted copy an in-place transcode writes before it swaps it in."""
JOURNAL = layout.TRANSCODE_JOURNAL
"""Present while the swap runs: a re-run finishes it."""
_RAW_OLD = "raw.old"
_SWAPPED = (STORE_DIR, BASIS_FILE)
"""What moves from the staging copy into the index (its manifest and checksums are merged)."""
_STALE = (layout.FAISS_DIR, layout.DAMAGED_DIR, f"{layout.PRECOND_DIR}/graddot.h5")
"""What was computed from the raw rows and does not hold for the new ones (moved out too)."""



def swap_in(d: Path, manifest: dict, new: dict, damping: float) -> dict:
    """Swap the compacted copy in ``d / STAGING`` (manifest ``new``) into ``d``, whose manifest is ``manifest``
    (with its fits), under the journal; return the final manifest."""
    final = {**new, "preconditioners": manifest.get("preconditioners", {}),
             "transcode": {"source_build": Manifest(manifest).build, "damping": damping,
                           "storage": Manifest(new).storage,
                           "seconds": new["compact"]["seconds"]}}
    final.pop("compact", None)
    final["generation"] = new_generation()  # other rows: an engine open on the raw ones must not read these
    text = json.dumps({"manifest": final}, default=str)
    (d / JOURNAL).write_text(text)
    finish_transcode(d)
    log.info("rows of %s transcoded in place into the ekfac eigenbasis (%s)", d, final["transcode"]["storage"])
    return json.loads(text)["manifest"]  # (what finish_transcode wrote)


def finish_transcode(index_dir: str | os.PathLike) -> None:
    """Complete (or, with no journal, do nothing for) an in-place transcode's swap; idempotent."""
    d = Path(index_dir)
    journal = d / JOURNAL
    if not journal.exists():
        return
    final = json.loads(journal.read_text())["manifest"]
    staging, old = d / STAGING, d / _RAW_OLD
    if Manifest.read(d).basis_kind != "ekfac":  # the commit point (the manifest write) is not reached yet
        old.mkdir(exist_ok=True)
        for name in (*_SWAPPED, *_STALE):  # raw rows out (with what was computed from them) ...
            if (d / name).exists() and not (old / name).exists() and ((staging / name).exists() or name in _STALE):
                (old / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(d / name, old / name)
        for name in _SWAPPED:  # ... the eigenbasis rows in
            if (staging / name).exists() and not (d / name).exists():
                os.replace(staging / name, d / name)
        sums = {n: e for n, e in read_checksums(d).items() if not n.startswith((*_SWAPPED, *_STALE))}
        sums.update({n: e for n, e in read_checksums(staging).items() if n.startswith((f"{STORE_DIR}/",
                                                                                      BASIS_FILE))})
        write_checksums(d, sums)
        write_manifest(d, final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    journal.unlink(missing_ok=True)

