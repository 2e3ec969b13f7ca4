"""Fit on a sample, code in the capture pass: the default build of more than ``fit_sample`` examples.

The fused path (:mod:`gradindex.precondition.fused`) captures every row as float16, then reads them all
again for ``Λ*`` and codes them: the stages after the capture cost about as much as the capture, and the
raw store and its rotated copy sit on disk together (8x the final int4 store). Here:

1. :func:`fit_on_sample`: a seeded sample of ``S`` examples (:func:`~gradindex.precondition.factors.sample_rows`)
   is built as an index of its own in ``INDEX_DIR/fit-sample.partial/`` (float16 rows with their K-FAC
   factor sums, :func:`~gradindex.store.builder.build_store`) and fitted as the fused stage fits
   (:func:`~gradindex.precondition.fit.store_fit`: factors, eigenbases, one pass for ``Λ*``). Its fit files and
   ``fit.json`` are the checkpoint a killed build resumes from; the sample's rows are deleted then.
2. The main capture pass writes every shard already coded (:class:`EigenCoder`, through the store's own
   writer): each captured row is rounded as the float16 capture would store it, rotated and scaled by
   :func:`~gradindex.store.basis.stored_rows` (the compact's coding of a block) and coded as ``storage``; the
   K-FAC and EK-FAC self-influence of each row come from the row it codes, ``‖W‖²`` and ``Σ W² (Λ*+δ)/(λ_S λ_A+δ')``,
   kept per shard (before the shard is sealed) until :meth:`EigenCoder.finish` writes the fit files.

The manifest is the transcoded one (row basis ``ekfac``, a ``transcode`` record) plus ``fit_sample``
(size, seed), so queries, ``info``, checksums, resume and ``--repair`` read it as any transcoded index.
The rows equal those of the fused build whose fit takes the same sample (``fit_and_transcode(...,
sample_correction=True)`` with ``fit_examples=S``) up to float round-off.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gradindex import distributed
from gradindex.data import Tokenized
from gradindex.precondition.apply import absolute_damping, damped
from gradindex.precondition.compact import eigen_basis, eigen_manifest
from gradindex.precondition.factors import data_fingerprint, sample_rows
from gradindex.precondition.files import (
    LayerFactors,
    SelfInfluenceBlocks,
    precond_path,
    read_factors,
    write_precond,
)
from gradindex.precondition.fit import FitConfig, StoreFit, register_fits, store_fit
from gradindex.spec import layout
from gradindex.spec.build import FIT_EVERY_UP_TO
from gradindex.spec.manifest import IndexMismatchError, Manifest
from gradindex.store.append import RowSink
from gradindex.store.basis import RowBasis, stored_rows, write_basis
from gradindex.store.opened import OpenStore
from gradindex.store.repair import as_captured

log = logging.getLogger("gradindex")
SAMPLE_DIR = layout.FIT_SAMPLE_DIR
CHECKPOINT = "fit.json"
"""In ``SAMPLE_DIR``: written last by the sample's fit (its record); present = the fit is done."""
SELF_INFLUENCE = "self-influence"
"""In ``SAMPLE_DIR``: ``shard-NNNNN.npy``, ``[2, n, L]`` K-FAC and EK-FAC self-influence of one coded shard."""


def sampled_reason(cfg, n: int) -> str:
    """Why a build of ``n`` examples under ``cfg`` fits on every example; ``""`` where it fits on a sample."""
    if cfg.fit_sample <= 0:
        return "--fit-sample 0"
    if n <= cfg.fit_sample:
        return f"{n} examples, not more than --fit-sample {cfg.fit_sample}"
    if n <= sample_threshold(cfg):
        said = f"--sample-above {cfg.sample_above}" if cfg.sample_above else \
            f"{FIT_EVERY_UP_TO} x --fit-sample (where the fit on every example costs less time)"
        return f"{n} examples, not more than {said}"
    if distributed.world_size() > 1:
        return "under torchrun (each rank captures its shards; the fit reads the store)"
    if not cfg.rows.transcode or cfg.precondition != "ekfac" or cfg.rows.basis != "raw":
        return "the rows are not transcoded into the EK-FAC eigenbasis"
    if cfg.fisher != "empirical" or cfg.collect_covariance or cfg.full_factors or cfg.optimizer_state:
        return "--fisher true, --collect-covariance, --full-factors or --optimizer-state"
    return ""


def sample_threshold(cfg) -> int:
    """The most examples a default build fits on every example (``cfg.sample_above``, or its auto)."""
    return max(cfg.fit_sample, cfg.sample_above or FIT_EVERY_UP_TO * cfg.fit_sample)


@dataclass
class SampleFit:
    """The sample's fit: K-FAC and EK-FAC factors per layer, the fit's record, its seconds."""

    kfac: dict[str, LayerFactors]
    ekfac: dict[str, LayerFactors]
    fit: dict
    seconds: float


def subset(data: Tokenized, rows: np.ndarray) -> Tokenized:
    """The examples ``rows`` of ``data``, in that order."""
    cut = tuple(data.truncated[i] for i in rows) if data.truncated else ()
    return Tokenized([data.input_ids[i] for i in rows], [data.labels[i] for i in rows], sum(cut), data.field, cut)


def fit_on_sample(model, tokenizer, data: Tokenized, out_dir, cfg, model_id: str = "", data_id: str = "",
                  progress: bool = False) -> SampleFit:
    """Capture ``cfg.fit_sample`` sampled examples into ``out_dir/fit-sample.partial`` and fit EK-FAC on them
    (resuming: a finished fit is read back; a partial capture resumes); the sample's rows are then deleted."""
    from gradindex.store.builder import build_store

    sub = Path(out_dir) / SAMPLE_DIR
    done = read_checkpoint(sub)
    if done is not None:
        return done
    t0 = time.perf_counter()
    seed = cfg.fisher_seed
    rows = sample_rows(len(data), cfg.fit_sample, seed)
    sample = subset(data, rows)
    scfg = replace(cfg, fit_sample=0)  # (its rows captured as the fused build captures them; nothing transcoded)
    try:
        res = build_store(model, tokenizer, sample, sub, scfg, model_id, data_id, progress=progress)
    except IndexMismatchError:  # another build's sample (another --fit-sample or seed): start over
        shutil.rmtree(sub)
        res = build_store(model, tokenizer, sample, sub, scfg, model_id, data_id, progress=progress)
    fcfg = FitConfig(method="ekfac", damping=cfg.damping, fisher=cfg.fisher, seed=seed)
    with OpenStore(sub, res.manifest, "fit") as ix:
        fitted = store_fit(ix, fcfg, model, tokenizer, sample, progress, ekfac_self_influence=False)
    fit = {**fitted.fit, "source": "fit sample", "data": data_id, "data_fingerprint": data_fingerprint(data),
           "sample": {"size": len(rows), "seed": seed}, "sample_fingerprint": fitted.fit["data_fingerprint"]}
    ek = fitted.written["ekfac"][0]
    write_precond(precond_path(sub, "ekfac"), "ekfac", res.manifest, fitted.layers, ek, None, cfg.damping, fit)
    seconds = round(time.perf_counter() - t0, 3)
    tmp = sub / (CHECKPOINT + ".tmp")
    tmp.write_text(json.dumps({"fit": fit, "seconds": seconds}, default=str))
    os.replace(tmp, sub / CHECKPOINT)
    shutil.rmtree(sub / layout.STORE_DIR, ignore_errors=True)  # the sample's rows: not needed any more
    log.info("fitted EK-FAC on a sample of %d of %d examples in %.1f s", len(rows), len(data), seconds)
    return read_checkpoint(sub)


def read_checkpoint(sub: Path) -> SampleFit | None:
    """The sample's finished fit in ``sub``, or None."""
    if not (sub / CHECKPOINT).exists():
        return None
    j = json.loads((sub / CHECKPOINT).read_text())
    return SampleFit(read_factors(precond_path(sub, "kfac")), read_factors(precond_path(sub, "ekfac")), j["fit"],
                     float(j["seconds"]))


class EigenCoder(RowSink):
    """The main pass's rows, coded in the sample fit's whitened eigenbasis (the store loop's row sink)."""

    coded = True

    def __init__(self, cfg, examples: int, out_dir, fitted: SampleFit | None = None, heads=None):
        super().__init__(heads)
        self.storage, self.captured, self.damping = cfg.rows.storage, cfg.rows.capture_storage, cfg.damping
        self.sample = {"size": int(cfg.fit_sample), "seed": int(cfg.fisher_seed)}
        self.examples = examples
        self.out = Path(out_dir)
        self.sub = self.out / SAMPLE_DIR
        self.fitted = fitted
        self.shard_size = int(cfg.shard_size)
        self.si: np.ndarray | None = None  # the current shard's self-influence [2, shard_size, layers]
        self.si_start = -1

    def identity(self, identity: dict) -> dict:
        """The build's identity with the fit sample (a resume with another one is refused)."""
        return {**identity, "fit_sample": self.sample}

    def start(self, out: Path, manifest: dict) -> dict:
        """Write the rows' ``basis.h5`` (rank 0); return the transcoded manifest of the build ``manifest``."""
        f, m = self.fitted, Manifest(manifest)
        self.basis = eigen_basis(RowBasis(), {n: (x.Q_S, x.Q_A, x.Lambda) for n, x in f.ekfac.items()}, self.damping)
        if distributed.rank() == 0:
            write_basis(out, self.basis, {"source": m.data_fingerprint, "damping": self.damping})
        self.shapes = m.shapes
        self.weights = {}  # K-FAC's (λ_S λ_A + δ')⁻¹ over EK-FAC's scale², per number of a coded row
        for n in self.shapes:
            kf = f.kfac[n].Lambda
            w = damped(torch.as_tensor(kf), absolute_damping(self.damping, kf), -1.0).numpy()
            self.weights[n] = (w / np.square(self.basis.scale[n])).reshape(-1)
        (self.sub / SELF_INFLUENCE).mkdir(parents=True, exist_ok=True)
        new = eigen_manifest(manifest, self.storage, self.damping, f.fit)
        new["transcode"] = {"source_build": m.build, "damping": self.damping, "storage": self.storage,
                            "seconds": f.seconds, "fit_sample": self.sample}
        return new

    def rows(self, s: int, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Captured rows of examples ``s, s+1, ...`` → their whitened rows (recording their self-influence)."""
        start = s - s % self.shard_size
        if start != self.si_start:  # (a shard's rows come in order, one shard at a time)
            self.si, self.si_start = np.zeros((2, self.shard_size, len(self.shapes))), start
        out = {}
        for j, n in enumerate(self.shapes):
            W = stored_rows(self.basis, n, as_captured(grads[n], self.captured), self.shapes[n])
            W2 = np.square(W, dtype=np.float64)
            self.si[1, s - start:s - start + len(W), j] = W2.sum(1)
            self.si[0, s - start:s - start + len(W), j] = W2 @ self.weights[n]
            out[n] = W
        return out

    def _file(self, k: int) -> Path:
        return self.sub / SELF_INFLUENCE / layout.shard_name(k).replace(".h5", ".npy")

    def shard_done(self, k: int, start: int, end: int) -> None:
        """Keep shard ``k``'s self-influence (before the shard is sealed: a shard without it is redone)."""
        tmp = self._file(k).with_suffix(".tmp.npy")
        if self.si_start != start:
            raise RuntimeError(f"self-influence of shard {k} (examples {start}:{end}) was not computed")
        np.save(tmp, self.si[:, :end - start])
        os.replace(tmp, self._file(k))

    def finish(self, manifest: dict, shard_size: int) -> dict:
        """Write the K-FAC and EK-FAC fit files with every example's self-influence; register them."""
        f = self.fitted
        layers = list(Manifest(manifest).layers)
        starts = range(0, self.examples, shard_size)
        for k in range(len(starts)):
            if not self._file(k).exists():
                raise FileNotFoundError(f"{str(self._file(k))!r} (the self-influence of a coded shard) is missing; "
                                        "rebuild the index with --overwrite")

        def method(i: int) -> SelfInfluenceBlocks:  # (0: K-FAC's, 1: EK-FAC's; one shard's rows at a time)
            return SelfInfluenceBlocks((self.examples, len(layers)),
                                       lambda: ((s, np.load(self._file(k))[i]) for k, s in enumerate(starts)))

        fcfg = FitConfig(method="ekfac", damping=self.damping, seed=self.sample["seed"])
        written = {"kfac": (f.kfac, method(0)), "ekfac": (f.ekfac, method(1))}
        for m, (fac, s) in written.items():
            write_precond(precond_path(self.out, m), m, manifest, layers, fac, s, self.damping, f.fit)
        register_fits(self.out, fcfg, manifest, StoreFit(written, f.fit, layers), f.seconds)
        return manifest

    def discard(self) -> None:
        """The sample's fit and the kept self-influence: not needed once the fit files are written."""
        shutil.rmtree(self.sub, ignore_errors=True)
