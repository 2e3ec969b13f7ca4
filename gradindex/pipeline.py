"""The whole build, one stage after another: capture → store → preconditioner fit → FAISS indices.

Each stage also runs alone (:func:`gradindex.store.builder.build_store`,
:func:`gradindex.precondition.fit_preconditioner`, :func:`gradindex.index.build_indices`); this
module only chains them, and is what ``gradindex build`` calls.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

from gradindex.data import Tokenized
from gradindex.index import IndexBuildResult, IndexConfig, build_indices
from gradindex.lock import index_lock
from gradindex.manifest import read_manifest
from gradindex.precondition import FitConfig, fit_preconditioner
from gradindex.store.builder import BuildConfig, BuildResult, build_store, refuse_foreign

__all__ = ["BuildConfig", "BuildResult", "IndexConfig", "build_index"]


def build_index(
    model: nn.Module,
    tokenizer,
    data: Tokenized,
    out_dir: str | os.PathLike,
    cfg: BuildConfig = BuildConfig(),
    index: IndexConfig | None = None,
    model_id: str = "",
    data_id: str = "",
    overwrite: bool = False,
    progress: bool = True,
    repair: bool = False,
) -> tuple[BuildResult, IndexBuildResult | None]:
    """Store every example's gradient, fit ``cfg.precondition`` (if any), then index (if ``index``).

    A killed run re-run with the same arguments resumes: each stage skips what is done.
    ``repair``: check every committed shard's whole-file hash and recompute the damaged ones
    (a plain re-run does the cheap sampled check only). Holds the directory's lock throughout.
    """
    refuse_foreign(Path(out_dir))
    with index_lock(out_dir, "gradindex build"):
        t0 = time.perf_counter()
        res = build_store(model, tokenizer, data, out_dir, cfg, model_id=model_id, data_id=data_id,
                          overwrite=overwrite, progress=progress, repair=repair)
        if cfg.precondition != "none":
            fit = FitConfig(method=cfg.precondition, damping=cfg.damping, fisher=cfg.fisher, seed=cfg.fisher_seed)
            fit_preconditioner(out_dir, fit, model, tokenizer, data, progress=progress)
            res.manifest = read_manifest(out_dir)
        res.seconds = time.perf_counter() - t0
        idx = build_indices(out_dir, index, progress=progress) if index is not None else None
    return res, idx
