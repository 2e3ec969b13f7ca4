"""``gradindex build --parts P``: a build that writes a sharded index (:mod:`gradindex.index.sharded`) directly.

The build runs as one build does (under ``torchrun`` each rank captures its share of the store files; rank 0 fits
and transcodes) into ``OUT/unsplit.partial/``, without a tier; then rank 0 writes the split's plan
(``OUT/split.json``: the parts' pieces as :func:`~gradindex.index.sharded.split_index` chooses them, the whole
manifest with the tier the whole index would have had) and moves the store's files into the parts (a rename and
their ids renumbered in place: the bytes a split's copy has; only a file that a part boundary cuts is copied, where
the parts outnumber the files). Each rank then builds its own run of the parts' tiers (the whole index's kind,
as a split builds them); ``shards.json`` is written last and the staging directory removed. So the parts equal
``gradindex split`` of the same build, part for part.

A killed build resumes with the same command: before ``split.json`` the staging build resumes as any build does;
after it, the moves and tiers are finished (each step idempotent) without a model pass.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from pathlib import Path

from gradindex import distributed
from gradindex.checksum import read_checksums
from gradindex.index.config import IndexConfig
from gradindex.index.files import write_json
from gradindex.index.opened import OpenIndex
from gradindex.index.sharded import (
    FORMAT,
    SHARDS_FILE,
    VERSION,
    Part,
    Sharded,
    _build_tier,
    _fit_files,
    part_tier_config,
    piece_rows,
    read_sharded,
    write_part_rest,
)
from gradindex.lock import index_lock
from gradindex.spec.layout import MANIFEST, SPLIT_PLAN, STORE_DIR, UNSPLIT_DIR, IndexLayout
from gradindex.spec.manifest import Manifest, refuse_unfinished_transcode
from gradindex.store.relabel import move_shard, write_rows

log = logging.getLogger("gradindex")


def shard_sizes(n: int, shard_size: int) -> list[int]:
    """The rows of each store file a build of ``n`` examples writes (``shard_size`` a file, the last one less)."""
    return [min(shard_size, n - s) for s in range(0, n, shard_size)]


def parts_of(parts: int | str, n: int) -> int:
    """``--parts``: a count, or ``ranks`` (one part a ``torchrun`` rank; 1 in one process); refused outside
    ``[1, n]``."""
    if isinstance(parts, str) and parts.strip().lower() == "ranks":
        p = distributed.world_size()
    else:
        try:
            p = int(parts)
        except ValueError:
            raise ValueError(f"--parts takes a count or 'ranks', not {parts!r}") from None
    if not 1 <= p <= n:
        raise ValueError(f"--parts {p}: the data has {n} examples, so the index splits into 1 to {n} parts")
    return p


def check_part_tiers(dims: dict[str, int], cfg, n: int, parts: int, index: IndexConfig) -> None:
    """Refuse, before the capture, a tier that cannot be built over the whole index of ``n`` rows of ``dims``, or
    over the smallest of its parts (each part's tier is the whole index's kind, built over the part's rows)."""
    from gradindex.index.tiers import RowShape, make_tier

    storage = cfg.rows.storage
    tier = make_tier(index, RowShape.of(n, list(dims.values()), storage))
    entry = {"space": index.space.to_dict(), "status": "complete", "kind": tier.name,
             "factories": sorted(set(tier.layer_factories(n, dims, storage).values())),
             **({"sketch_bytes": tier.key()["sketch_bytes"]} if tier.key().get("sketch_bytes") else {})}
    m = min(sum(b - a for _, a, b in pc) for pc in piece_rows(shard_sizes(n, cfg.shard_size), parts))
    part = make_tier(part_tier_config(entry, index), RowShape.of(m, list(dims.values()), storage))
    part.layer_factories(m, dims, storage)


def build_sharded(build_index, model, tokenizer, data, out_dir: str | os.PathLike, cfg, index: IndexConfig | None,
                  parts: int, overwrite: bool = False, progress: bool = True, **build) -> tuple[object, Sharded]:
    """Build ``data``'s index as a sharded index of ``parts`` parts in ``out_dir`` (every rank calls it under
    ``torchrun``): ``build_index`` (:func:`~gradindex.pipeline.build_index`, passed in: the pipeline comes after
    this stage) builds the one directory it splits; ``build``: its other arguments. Returns the whole build's
    :class:`~gradindex.store.builder.BuildResult` (``examples_computed`` 0 where only the split was left) and the
    :class:`~gradindex.index.sharded.Sharded` index."""
    from gradindex.store.builder import BuildResult

    out, t0 = Path(out_dir), time.perf_counter()
    parts = parts_of(parts, len(data))
    with index_lock(out, "gradindex build"):
        distributed.on_rank0(lambda: _prepare(out, parts, overwrite))
        if not (out / SPLIT_PLAN).exists():
            if parts > len(shard_sizes(len(data), cfg.shard_size)) and distributed.rank() == 0:
                log.warning("note: --parts %d is more than the store's %d files (--shard-size %d): the files that a "
                            "part boundary cuts are copied, not moved (--shard-size %d or less moves every file)",
                            parts, len(shard_sizes(len(data), cfg.shard_size)), cfg.shard_size,
                            max(1, len(data) // parts))
            res, _ = build_index(model, tokenizer, data, out / UNSPLIT_DIR, cfg, index=None, progress=progress,
                                 **build)
            computed = res.examples_computed
            distributed.on_rank0(lambda: _write_plan(out, parts, index))
        else:
            computed = 0
            distributed.on_rank0(lambda: _check_plan(out, parts, model, data, cfg))
        plan = distributed.on_rank0(lambda: _move(out))
        _ranks_tiers(out, plan, index)
        sh = distributed.on_rank0(lambda: _finish(out, plan))
    return BuildResult(out, sh.manifest, time.perf_counter() - t0, computed), sh


def _prepare(out: Path, parts: int, overwrite: bool) -> None:
    """Refuse an ``out`` that holds anything but this build's own staging (``overwrite``: clear it first)."""
    from gradindex.store.builder import SHARDED_NAMES, _contents, clear_out_dir, refuse_part

    refuse_part(out)
    if overwrite and _contents(out) and not any((out / n).exists() for n in (MANIFEST, *SHARDED_NAMES)):
        raise FileExistsError(f"output directory {str(out)!r} is not empty and holds no gradindex index; --overwrite "
                              "replaces an index, not other files: choose another --out (nothing was written)")
    if overwrite:
        clear_out_dir(out)
        return
    if (out / SPLIT_PLAN).exists():
        had = json.loads((out / SPLIT_PLAN).read_text())["parts"]
        if had != parts:
            raise ValueError(f"{str(out)!r} holds a `build --parts {had}` killed while it split the store into "
                             f"parts; re-run it with --parts {had} to finish it (or --overwrite to start again)")
        return
    if (out / SHARDS_FILE).exists():
        had = len(json.loads((out / SHARDS_FILE).read_text())["parts"])
        raise FileExistsError(f"{str(out)!r} already holds a complete sharded index of {had} parts; nothing was "
                              "built: query it, or give --overwrite to build it again (or another --out)")
    if (out / "manifest.json").exists():
        raise FileExistsError(f"{str(out)!r} holds an index in one directory; `gradindex split {out} --shards "
                              f"{parts} --out NEW` splits it without a capture (or give --overwrite, or another --out)")
    foreign = [p.name for p in _contents(out) if p.name != UNSPLIT_DIR]
    if foreign:
        raise FileExistsError(f"output directory {str(out)!r} is not empty and holds no gradindex index "
                              f"({', '.join(sorted(foreign)[:3])}); choose another --out (nothing was written)")


def _whole_tier(ix: OpenIndex, index: IndexConfig) -> dict:
    """The manifest's ``index`` entry of the tier ``index`` makes over the whole index ``ix`` (what a split's parts
    take their tier from); its ``bytes`` are the parts' (summed once they are built)."""
    from gradindex.index.tiers import RowShape, make_tier

    dims = {n: ix.store.dims[n] for n in ix.store.layers}
    tier = make_tier(index, RowShape.of(ix.n, list(ix.store.dims.values()), ix.store.storage))
    factories = tier.layer_factories(ix.n, dims, ix.described.storage)
    entry = {"space": index.space.to_dict(), "status": "complete", "factories": sorted(set(factories.values())),
             "kind": tier.name, "bytes": 0}
    if tier.key().get("sketch_bytes"):
        entry["sketch_bytes"] = int(tier.key()["sketch_bytes"])
    return entry


def _write_plan(out: Path, parts: int, index: IndexConfig | None) -> None:
    """``split.json``: what the split does, from the complete staging build (written before any file moves; the
    staging store is not opened again)."""
    src = out / UNSPLIT_DIR
    with OpenIndex(src, then="split it") as ix:
        refuse_unfinished_transcode(src, ix.manifest, "split it")
        whole = copy.deepcopy(ix.manifest)
        whole.pop("index", None)
        if index is not None:
            whole["index"] = _whole_tier(ix, index)
        files = [p.name for p in ix.store.paths]
        firsts, sizes = list(ix.store.first_ids), list(ix.store.sizes)
    plan = {"parts": parts, "files": files, "firsts": firsts, "sizes": sizes, "pieces": piece_rows(sizes, parts),
            "fits": _fit_files(src), "whole": whole}
    write_json(out / SPLIT_PLAN, plan, indent=1)


def _check_plan(out: Path, parts: int, model, data, cfg) -> None:
    """Refuse to finish a killed split for another model, data set or ``--shard-size`` than the one it holds."""
    from gradindex.data import token_hash
    from gradindex.fingerprint import digest_bytes, model_fingerprint

    build = Manifest.of(json.loads((out / SPLIT_PLAN).read_text())["whole"]).build
    data_fp = digest_bytes([token_hash(i, lab) for i, lab in zip(data.input_ids, data.labels, strict=True)])
    differs = [what for what, a, b in (("model", build.get("model_fingerprint"), model_fingerprint(model)),
                                        ("data set", build.get("data_fingerprint"), data_fp),
                                        ("--shard-size", build.get("shard_size"), cfg.shard_size)) if a != b]
    if differs:
        raise ValueError(f"{str(out)!r} holds a `build --parts {parts}` of another {', '.join(differs)}, killed "
                         "while it split the store; re-run it as it was, or give --overwrite to start again")


def _plan_parts(out: Path, plan: dict) -> list[Part]:
    """The parts the plan makes, by the whole index's rows."""
    firsts = plan["firsts"]
    return [Part(out / f"part-{j:05d}", firsts[pc[0][0]] + pc[0][1], firsts[pc[-1][0]] + pc[-1][2])
            for j, pc in enumerate(plan["pieces"])]


def _move(out: Path) -> dict:
    """The store's files moved into the parts (a file a part boundary cuts: its rows copied), then each part's
    fits and manifest (:func:`~gradindex.index.sharded.write_part_rest`); every step redone or skipped on a
    resume. Returns the plan."""
    plan = json.loads((out / SPLIT_PLAN).read_text())
    src = out / UNSPLIT_DIR
    store, recorded = src / STORE_DIR, read_checksums(src)
    parts, sizes, firsts = _plan_parts(out, plan), plan["sizes"], plan["firsts"]
    for part, pieces in zip(parts, plan["pieces"], strict=True):
        for k_local, (k, a, b) in enumerate(pieces):
            dst = IndexLayout.of(part.dir).shard(k_local)
            if (a, b) == (0, sizes[k]):
                move_shard(store / plan["files"][k], dst, firsts[k] - part.first)
            elif not dst.exists():
                write_rows([(store / plan["files"][k], a, b)], dst, firsts[k] + a - part.first, {src: recorded})
    fits = [tuple(f) for f in plan["fits"]]
    for j, (part, pieces) in enumerate(zip(parts, plan["pieces"], strict=True)):
        if not IndexLayout.of(part.dir).manifest.exists():  # (written last: a part that has it is done, its tier too)
            write_part_rest(src, plan["whole"], part, j, len(parts), [tuple(p) for p in pieces], sizes, fits,
                            recorded)
    return plan


def _ranks_tiers(out: Path, plan: dict, index: IndexConfig | None) -> None:
    """Each rank builds the tiers of its run of the parts (all of them in one process); the first failed rank's
    error is raised on every rank, as it was raised (none is left waiting)."""
    parts = _plan_parts(out, plan)
    P, r, W = len(parts), distributed.rank(), distributed.world_size()

    def mine() -> None:
        for j in range(r * P // W, (r + 1) * P // W):
            _build_tier(parts[j].dir, plan["whole"], index)

    distributed.team().each(mine)


def _finish(out: Path, plan: dict) -> Sharded:
    """``shards.json`` (the whole manifest, its tier's bytes the parts' sum), then the staging and plan removed."""
    parts = _plan_parts(out, plan)
    whole = copy.deepcopy(plan["whole"])
    if whole.get("index"):
        whole["index"]["bytes"] = sum(int(Manifest.read(p.dir).get("index", {}).get("bytes", 0)) for p in parts)
    doc = {"format": FORMAT, "version": VERSION, "examples": int(whole["counts"]["examples"]),
           "parts": [{"dir": p.dir.name, "first": p.first, "stop": p.stop} for p in parts], "manifest": whole}
    write_json(out / SHARDS_FILE, doc, indent=1)
    shutil.rmtree(out / UNSPLIT_DIR)
    (out / SPLIT_PLAN).unlink()
    return read_sharded(out)
