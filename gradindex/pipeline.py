"""The whole build, one stage after another: capture → store → preconditioner fit → FAISS indices.

Each stage also runs alone (:func:`gradindex.store.builder.build_store`,
:func:`gradindex.precondition.fit_preconditioner`, :func:`gradindex.index.build_indices`); this
module only chains them, and is what ``gradindex build`` calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from torch import nn

from gradindex import distributed
from gradindex.capture import RowSpace, layer_info, select_layers
from gradindex.data import Tokenized
from gradindex.diskspace import check_space, disk_full_as_error, free_bytes, human
from gradindex.heap import CAPTURE_THRESHOLD, bound_heap
from gradindex.index import IndexBuildResult, IndexConfig, OpenIndex, build_indices
from gradindex.index.builder import row_norms
from gradindex.index.sharded import Sharded
from gradindex.index.sketch import Sketch
from gradindex.index.tiers import RowShape, make_tier
from gradindex.index.tiers.sketch_files import encode_files
from gradindex.lock import index_lock
from gradindex.plan import BuildPlan, longest_example, plan_build, rerank_fit_sizes
from gradindex.precondition import FitConfig, fit_preconditioner
from gradindex.precondition.compact import finish_transcode
from gradindex.precondition.factors import sample_rows
from gradindex.precondition.fit import FULL_SPACE_FISHER
from gradindex.precondition.fullspace import HeadGrads, keep_build_sums, stored_share
from gradindex.precondition.fused import fit_and_transcode, team_fits
from gradindex.precondition.restore import restore_basis
from gradindex.precondition.sampled import SAMPLE_DIR, EigenCoder, fit_on_sample, sampled_reason
from gradindex.spec.manifest import Manifest, manifest_path
from gradindex.store.append import RowSink
from gradindex.store.builder import (
    BuildConfig,
    BuildResult,
    build_store,
    check_resumable,
    clear_out_dir,
    refuse_foreign,
)
from gradindex.store.shards import Store

__all__ = ["BuildConfig", "BuildResult", "IndexConfig", "build_index"]
log = logging.getLogger("gradindex")


def build_index(model: nn.Module, tokenizer, data: Tokenized, out_dir: str | os.PathLike,
                cfg: BuildConfig = BuildConfig(), index: IndexConfig | None = None, model_id: str = "",
                data_id: str = "", overwrite: bool = False, progress: bool = True, repair: bool = False,
                rerank_fit: bool | None = None, parts: int | str | None = None,
                ) -> tuple[BuildResult, IndexBuildResult | Sharded | None]:
    """Store every example's gradient, fit ``cfg.precondition`` (if any), then index (if ``index``).

    A killed run re-run with the same arguments resumes: each stage skips what is done. ``cfg.rows.transcode``:
    after the fit, the rows are rewritten in place in the EK-FAC whitened eigenbasis as ``cfg.rows.storage`` codes
    (the CLI's default; see docs/math.md). ``repair``: check every committed shard's whole-file hash and recompute
    the damaged ones (a plain re-run does the cheap sampled check only). Holds the directory's lock throughout.
    ``rerank_fit``: also fit ``cfg.precondition`` in full space (:func:`rerank_fit_config`) for a query's exact
    stage (``rerank_full=C``); ``None``: ``cfg.rerank_fit`` (off by default; or ``precondition --space full``).
    An ``index.factory`` that cannot be trained on ``len(data)`` examples (or a tier that cannot hold
    ``index.space``) is refused before capturing. The manifest is passed from stage to stage, never re-read.
    ``parts``: a sharded index of that many parts (``"ranks"``: one a ``torchrun`` rank), what ``split_index``
    makes of this build (:mod:`gradindex.index.build_parts`); the tier's result is then the ``Sharded`` index.
    """
    if parts is not None:
        return _sharded(model, tokenizer, data, out_dir, cfg, index, parts, model_id=model_id, data_id=data_id,
                        overwrite=overwrite, progress=progress, repair=repair, rerank_fit=rerank_fit)
    refuse_foreign(Path(out_dir))
    bound_heap(CAPTURE_THRESHOLD)  # (gradindex.heap: peak RSS -7% on the peers workload, same time)
    if index is not None:
        _check_index_type(model, cfg, len(data), index)
    with index_lock(out_dir, "gradindex build"):
        t0 = time.perf_counter()
        if not overwrite and distributed.rank() == 0:
            finish_transcode(out_dir)  # a swap that a kill interrupted
            restore_basis(out_dir)  # a missing or damaged basis.h5 its EK-FAC fit holds: no rebuild
        distributed.barrier()
        plan_args = (index is not None, *((index.factory, index.sketch_bytes) if index is not None else ("auto", 0)))
        cfg, plan = routed_plan(model, cfg, len(data), Path(out_dir), overwrite, plan_args, longest_example(data))
        _check_disk(Path(out_dir), plan, overwrite)  # (every rank: one refusing alone would leave the others waiting)
        rows, heads = _full_fit_rows(cfg, plan, len(data), rerank_fit)
        why = sampled_reason(cfg, len(data))
        if why and cfg.rows.transcode and cfg.fit_sample > 0:
            log.info("EK-FAC fitted on every example: %s", why)
        with disk_full_as_error(out_dir, "capture", "the store shards committed so far are kept",
                                lambda: plan.remaining(out_dir)):
            if not why:  # fit on a sample, rows coded in the capture pass
                res = _sampled(model, tokenizer, data, Path(out_dir), cfg, model_id, data_id, overwrite, progress,
                               repair, rows, heads)
            else:
                res = build_store(model, tokenizer, data, out_dir, cfg, model_id=model_id, data_id=data_id,
                                  overwrite=overwrite, progress=progress, repair=repair, full_fit_rows=rows,
                                  sink=RowSink(heads))
        if distributed.rank() > 0:  # under torchrun: rank 0 runs the later stages, handing out the shared ones
            _assist(model, tokenizer, data, out_dir)
            res.seconds = time.perf_counter() - t0
            return res, None
        try:
            done = _finish(model, tokenizer, data, out_dir, cfg, index, res, progress, t0, plan, rerank_fit, heads)
        except BaseException:
            with contextlib.suppress(Exception):  # (a rank that died: the first error is the one to report)
                _dismiss()
            raise
        _dismiss()
        return done


def _assist(model, tokenizer, data: Tokenized, out_dir) -> None:
    """A rank other than 0 after its capture: its share of each per-file pass rank 0 hands out (:func:`_share`: the
    EK-FAC correction's store pass and the transcode, the tier's norms, the sketch tier's codes), over its own store
    files, until rank 0 is done."""
    while (job := distributed.broadcast(None)) is not None:
        kind, args = job
        team = distributed.team()
        try:
            if kind == "fused":
                fit, storage, manifest = args
                fit_and_transcode(out_dir, fit, storage, model, tokenizer, data, False, manifest, team=team)
            elif kind == "sketch":  # (the raw space: no preconditioner, no whole-index norms)
                spec, space, block, done = args
                with Store(out_dir) as store:
                    encode_files(store, None, space, Sketch.from_dict(spec), block, done, team)
            elif kind == "ivf":  # (the staged sketch codes: the nearest list of each, the probe rows' tops)
                from gradindex.index.tiers.ivf_sketch import assist

                assist(*args, team)
            else:  # "norms"
                with Store(out_dir) as store:
                    row_norms(store, False, team)
        except Exception as e:
            if not distributed.shared(e):
                raise  # (out of step with the other ranks: fatal)
            log.debug("rank %d: the shared %s pass failed on every rank (rank 0 reports it): %s", team.rank, kind, e)
    distributed.barrier()


def _share(kind: str, *args) -> distributed.Team:
    """Rank 0: hand the per-file pass ``kind`` (``fused``: ``(fit, storage, manifest)``; ``norms``; ``sketch``:
    ``(spec, space, block, rows done)``; ``ivf``: :func:`~gradindex.index.tiers.ivf_sketch.assist`'s) to the other
    ranks (:func:`_assist`); the :class:`~gradindex.distributed.Team` to run it with (one process: ``SOLO``)."""
    if not distributed.active():
        return distributed.SOLO
    distributed.broadcast((kind, args))
    return distributed.team()


def _dismiss() -> None:
    """Rank 0, done: the other ranks leave :func:`_assist`, then all meet at a barrier."""
    if distributed.active():
        distributed.broadcast(None)
    distributed.barrier()


def _sharded(model, tokenizer, data: Tokenized, out_dir, cfg: BuildConfig, index: IndexConfig | None,
             parts: int | str, **build) -> tuple[BuildResult, Sharded]:
    """:func:`build_index` of a sharded index: its tiers checked for the whole index and its smallest part before
    the capture, then :func:`~gradindex.index.build_parts.build_sharded`."""
    from gradindex.index.build_parts import build_sharded, check_part_tiers, parts_of

    p = parts_of(parts, len(data))
    if index is None:
        raise ValueError(NO_TIER_PARTS)
    check_part_tiers(layer_dims(model, cfg), cfg, len(data), p, index)
    return build_sharded(build_index, model, tokenizer, data, out_dir, cfg, index, p, **build)


NO_TIER_PARTS = ("--parts with --no-index: a sharded index's parts are searched through their tiers, and "
                 "`gradindex index` builds one directory's; build the parts with their tiers (drop --no-index), or "
                 "build one directory with --no-index, `gradindex index` it, then `gradindex split` it")
"""Why :func:`build_index` refuses ``parts`` without ``index``."""


def _sampled(model, tokenizer, data: Tokenized, out: Path, cfg: BuildConfig, model_id: str, data_id: str,
             overwrite: bool, progress: bool, repair: bool, rows: np.ndarray | None, heads) -> BuildResult:
    """A build that fits EK-FAC on ``cfg.fit_sample`` sampled examples first, then writes every row coded
    in its whitened eigenbasis in the capture pass (:mod:`gradindex.precondition.sampled`); resumable."""
    coder = EigenCoder(cfg, len(data), out, heads=heads)
    if overwrite:
        clear_out_dir(out)
    m = Manifest.read(out) if manifest_path(out).exists() else None
    if not (m and m.complete and "ekfac" in m.preconditioners):
        check_resumable(model, tokenizer, data, out, cfg, coder)  # another index there: refused before the sample
        coder.fitted = fit_on_sample(model, tokenizer, data, out, cfg, model_id, data_id, progress)
    res = build_store(model, tokenizer, data, out, cfg, model_id=model_id, data_id=data_id, progress=progress,
                      repair=repair, full_fit_rows=rows, sink=coder)
    if "ekfac" not in res.manifest.get("preconditioners", {}):
        res.manifest = coder.finish(res.manifest, cfg.shard_size)
    coder.discard()
    return res


def rerank_fit_config(cfg: BuildConfig, manifest: dict, n: int, asked: bool | None = None) -> FitConfig | None:
    """The full-space fit a build makes for the exact stage, or ``None``: where ``asked`` (``None``:
    ``cfg.rerank_fit``, off by default), the rows hold less than the whole gradient
    (:func:`~gradindex.precondition.fullspace.stored_share` below 1) and ``cfg.precondition`` is kfac/ekfac,
    on every example up to :data:`~gradindex.spec.build.RERANK_FIT_EXAMPLES`
    (:func:`~gradindex.plan.rerank_fit_sizes`)."""
    wanted = (cfg.rerank_fit if asked is None else asked) and stored_share(manifest) < 1
    return _rerank_fit(cfg, n, wanted, Manifest(manifest).adam_rows)


def _rerank_fit(cfg: BuildConfig, n: int, wanted: bool, optimizer: bool) -> FitConfig | None:
    examples, correction = rerank_fit_sizes(cfg, n, wanted, optimizer)
    if not examples:
        return None
    return FitConfig(method=cfg.precondition, damping=cfg.damping, fisher=cfg.fisher, seed=cfg.fisher_seed,
                     space="full", fit_examples=0 if examples == n else examples,
                     correction_examples=0 if correction == examples else correction)


def _check_index_type(model: nn.Module, cfg: BuildConfig, n: int, index: IndexConfig) -> dict[str, str]:
    """Refuse, before the capture pass, an index type that cannot work for ``n`` examples of these rows; return
    the layers' factories."""
    dims = layer_dims(model, cfg)
    tier = make_tier(index, RowShape.of(n, list(dims.values()), cfg.rows.storage))
    return tier.layer_factories(n, dims, cfg.rows.storage)


def layer_dims(model: nn.Module, cfg: BuildConfig) -> dict[str, int]:
    """Each captured layer's row length under ``cfg``'s projection (before the capture)."""
    space = RowSpace(cfg.projection).bind({name: layer_info(m) for name, m in select_layers(model, cfg.layers).items()})
    return {name: space.dim(name) for name in space.infos}


def _full_fit_rows(cfg: BuildConfig, plan: BuildPlan, n: int, asked: bool | None) -> tuple[np.ndarray | None,
                                                                                          HeadGrads | None]:
    """``(rows, heads)``: the examples whose full-space ``A`` and ``S`` the capture pass sums, and where that is every
    example and the correction takes them all, the head gradients it keeps for the correction pass to replay.

    The rows: those of the full-space fit the build will make (:func:`rerank_fit_config`, whether the rows are a
    projection judged from the plan's row sizes); None where it makes none (the default), or where the shards'
    copies of the sums would take too much disk (:data:`FACTOR_SUMS_NOTE`); every example with ``full_factors``."""
    if (cfg.rerank_fit if asked is None else asked) and cfg.fisher != "empirical":
        raise ValueError(FULL_SPACE_FISHER)  # (before the capture; the full-space fit would refuse it after)
    rows = None
    wanted = (cfg.rerank_fit if asked is None else asked) and plan.budget_bound
    full = None if plan.approximate else _rerank_fit(cfg, n, wanted, bool(cfg.optimizer_state))
    if full is not None:
        rows = sample_rows(n, full.fit_examples, full.seed)
        sums = 8 * sum(lp.n_in ** 2 + lp.n_out ** 2 for lp in plan.layers)  # one shard's float64 A and S
        copies = len(np.unique(rows // cfg.shard_size))
        rows = rows if copies * sums <= max(2 * sums, plan.capture_bytes // 2) else None
    if cfg.full_factors and rows is not None and len(rows) < n:
        rows = None  # (--full-factors: the sums over every example, as asked)
    every = rows is not None and len(rows) == n and not 0 < cfg.rerank_correction < n
    return rows, HeadGrads() if every else None  # (heads: replayed by a correction pass over the capture's batches)


FACTOR_SUMS_NOTE = """Each capture shard holding fit examples stores its own float64 sums (``N_i² + N_o²`` per
layer): the capture sums them only while those copies stay within twice one copy (what the fit's own
checkpoint holds) or half the captured rows' bytes; else the fit makes its own factor pass."""


def _finish(model, tokenizer, data, out_dir, cfg: BuildConfig, index: IndexConfig | None, res: BuildResult,
            progress: bool, t0: float, plan: BuildPlan, rerank_fit: bool | None = None,
            heads: HeadGrads | None = None) -> tuple[BuildResult, IndexBuildResult | None]:
    """The stages after the capture: fit, transcode, the full-space fit (its factor sums from the capture
    pass kept as its checkpoint first: the transcoded shards do not hold them), FAISS indices (one
    process), each checked for disk space."""
    full = rerank_fit_config(cfg, res.manifest, len(data), rerank_fit)

    def need() -> int:  # (what the plan says the build still adds: named in a full disk's error)
        return plan.remaining(out_dir)

    if full is not None and cfg.rows.transcode and full.method not in res.manifest.get("full_space", {}) \
            and not res.manifest.get("transcode"):  # the fit's checkpoint: the transcode drops the shards' sums
        with disk_full_as_error(out_dir, "full-space fit", "the store is complete and kept", need):
            keep_build_sums(out_dir, full, tokenizer, data, res.manifest)
    fit = None if cfg.precondition == "none" else \
        FitConfig(method=cfg.precondition, damping=cfg.damping, fisher=cfg.fisher, seed=cfg.fisher_seed)
    kept = "the captured rows are kept (and the transcode's finished shards)"
    with disk_full_as_error(out_dir, "fit and transcode", kept, need):
        if cfg.rows.transcode and not res.manifest.get("transcode"):  # the default: fit and transcode fused
            team = _share("fused", fit, cfg.rows.storage, res.manifest) if team_fits(fit) else distributed.SOLO
            res.manifest = fit_and_transcode(out_dir, fit, cfg.rows.storage, model, tokenizer, data, progress,
                                             res.manifest, team=team)
        elif cfg.precondition != "none" and not res.manifest.get("transcode"):  # updates res.manifest in place
            fit_preconditioner(out_dir, fit, model, tokenizer, data, progress=progress, manifest=res.manifest)
    if full is not None and full.method not in res.manifest.get("full_space", {}):  # (updated in place)
        with disk_full_as_error(out_dir, "full-space fit", "the store and its stored-space fit are complete and kept",
                                need):
            fit_preconditioner(out_dir, full, model, tokenizer, data, progress=progress, heads=heads,
                               manifest=res.manifest)
    res.seconds = time.perf_counter() - t0
    if index is None:
        return res, None
    if not (Path(out_dir) / "faiss").exists() and not plan.approximate:
        check_space(out_dir, plan.index_bytes, "FAISS stage", "its indices")
    with disk_full_as_error(out_dir, "FAISS stage", "the store and its fits are complete and kept",
                            lambda: plan.index_bytes), \
            OpenIndex(out_dir, res.manifest, then="build the indices") as ix:
        return res, build_indices(ix, index, progress=progress, share=_share)


def routed_plan(model, cfg: BuildConfig, n: int, out: Path, overwrite: bool, plan_args: tuple = (),
                longest: int | None = None) -> tuple[BuildConfig, BuildPlan]:
    """``(cfg, its plan)``: ``cfg`` with ``sample_above`` set to ``fit_sample`` where its auto would fit on every
    example but ``out``'s free disk cannot hold that build's peak (a fresh build: a resumed one keeps the route it
    started on). Each plan is made once."""
    def plan(c: BuildConfig) -> BuildPlan:
        return plan_build(model, c, n, *plan_args, longest=longest)

    sampled = replace(cfg, sample_above=cfg.fit_sample)
    if cfg.sample_above or not sampled_reason(cfg, n) or sampled_reason(sampled, n):
        return cfg, plan(cfg)  # (asked for, or the route does not depend on the auto threshold)
    if not overwrite and (out / SAMPLE_DIR).exists():
        return sampled, plan(sampled)
    if not overwrite and manifest_path(out).exists():
        return cfg, plan(cfg)
    every, free = plan(cfg), free_bytes(out)
    if every.peak_disk <= free:
        return cfg, every
    log.info("EK-FAC fitted on a sample of %d: the fit on every example of %d would take %s of disk at its peak, "
             "%s is free", cfg.fit_sample, n, human(every.peak_disk), human(free))
    return sampled, plan(sampled)


def _check_disk(out: Path, plan: BuildPlan, overwrite: bool) -> None:
    """Refuse a build whose remaining stages cannot fit on ``out``'s disk (before any is written)."""
    m = Manifest.read(out) if manifest_path(out).exists() and not overwrite else None
    if plan.approximate or m and m.complete and (m.transcoded or not plan.transcode):
        return  # only the FAISS stage (if any) is left: checked before it
    parts = [f"{human(plan.capture_bytes)} of {plan.capture_storage} rows"]
    if plan.sample_examples:  # (the sample's rows, deleted before the coded rows are written)
        parts = [f"{human(plan.capture_bytes)} of the fit sample's {plan.capture_storage} rows, then the "
                 f"{plan.storage} rows coded in the capture pass {human(plan.store_bytes)}"]
    elif plan.transcode:
        parts.append(f"their {plan.storage} copy in the eigenbasis {human(plan.store_bytes)}")
    if plan.precond_bytes:
        parts.append(f"fits {human(plan.precond_bytes)}")
    if plan.index_bytes:
        parts.append(f"FAISS {human(plan.index_bytes)}")
    check_space(out, plan.remaining(out) if not overwrite else plan.least_disk, "build",
                f"at its peak: {', '.join(parts)}")
