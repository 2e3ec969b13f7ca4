"""The store writer: data + model → store shards and manifest, resumable (fit and index: `pipeline`)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn

from gradindex import distributed
from gradindex.adapter import adapter_fingerprint, adapter_path
from gradindex.capture import FullSums, GradientCapture, KfacSums, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.adam import adam_capture_transforms
from gradindex.capture.allocation import ALLOCATIONS
from gradindex.capture.head import plain_head
from gradindex.capture.hooks import select_layers
from gradindex.capture.layers import layer_info
from gradindex.capture.sampling import FISHERS
from gradindex.chat import MESSAGES, template_of
from gradindex.checksum import check_files, move_aside, recorded, shard_of
from gradindex.data import Tokenized, token_hash
from gradindex.fingerprint import digest_bytes, model_fingerprint, tokenizer_fingerprint
from gradindex.lock import LOCK, index_lock
from gradindex.model import check_tokenizer_fits, model_file, resolve_pad_id
from gradindex.progress import progress_bar, skip
from gradindex.quantize import base_quantization
from gradindex.spec import layout
from gradindex.spec.build import BuildOptions
from gradindex.spec.manifest import (
    IndexMismatchError,
    Manifest,
    build_command,
    identity_differences,
    layer_identity,
    manifest_path,
    new_generation,
    new_manifest,
    part_of,
    sharded_name,
    write_manifest,
)
from gradindex.spec.rows import DEFAULT_SPEC, RowSpec
from gradindex.store import STORE_DIR, ShardWriter, shard_name
from gradindex.store.append import RowSink, append_batch
from gradindex.store.basis import RowBasis, capture_transforms, index_basis
from gradindex.store.covariance import rows_digest, write_covariance
from gradindex.store.repair import repair_eigenbasis_store
from gradindex.store.sizing import basis_identity, full_space_basis, sized_projection

log = logging.getLogger("gradindex")

LOSS_CONVENTION = "sum of next-token cross-entropy over each example's target tokens (offline)"
ROW_KEYWORDS = ("projection", "budget", "allocation", "basis", "basis_damping", "storage", "transcode", "adam_mode")
"""``BuildConfig``'s sugar for ``rows`` (``gradindex build``'s row options): each keyword sets part of the spec."""


@dataclass(frozen=True, init=False)
class BuildConfig(BuildOptions):
    """Settings of a store build; serialized into the manifest. ``BuildConfig()`` builds what ``gradindex build``
    builds with no options (capture and fit settings: :class:`gradindex.spec.build.BuildOptions`).

    ``rows`` (a :class:`~gradindex.spec.rows.RowSpec` or its string) is the one record of what a stored row
    holds. The keywords of :data:`ROW_KEYWORDS` are sugar that set part of it, each ``auto`` resolved from the
    others (:func:`_row_spec`): ``projection`` (a :class:`ProjectionSpec`: its sizes unless a ``budget`` sizes
    the layers, and its kind and seed), ``budget`` (bytes per example; 0: the projection as given), ``storage``,
    ``transcode`` (``ekfac``/``none``), ``basis``, ``basis_damping``, ``allocation`` and ``adam_mode``."""

    rows: RowSpec = RowSpec.parse(DEFAULT_SPEC)
    projection_kind: str = "gaussian"
    """The projection's random stream (``gaussian`` or ``rademacher``), which a row spec does not name."""
    seed: int = 0

    def __init__(self, rows: RowSpec | str | None = None, **kw) -> None:
        sugar = {k: kw.pop(k) for k in ROW_KEYWORDS if k in kw}
        names = {f.name for f in fields(self)} - {"rows"}
        if set(kw) - names:
            raise TypeError(f"BuildConfig got unexpected keyword arguments {sorted(set(kw) - names)}")
        for f in fields(self):
            object.__setattr__(self, f.name, kw.get(f.name, f.default))
        object.__setattr__(self, "rows", _row_spec(self, rows, sugar, "damping" in kw))
        object.__setattr__(self, "damping", self.rows.damping)
        if self.batch_size < 1 or self.shard_size < 1 or self.max_length < 2:
            raise ValueError(f"batch size and shard size must be >= 1 and max length >= 2 (got {self.batch_size}, "
                             f"{self.shard_size}, {self.max_length}): --batch-size, --shard-size, --max-length")
        for name, value, allowed in (("precondition", self.precondition, ("none", "kfac", "ekfac")),
                                     ("allocation", self.rows.allocation, ALLOCATIONS),
                                     ("fisher", self.fisher, FISHERS),
                                     ("projection kind", self.projection_kind, ("gaussian", "rademacher"))):
            if value not in allowed:
                raise ValueError(f"{name.replace('_', ' ')} {value!r} is not one of {list(allowed)}")
        self.rows.check_fit(self.precondition, self.collect_covariance, self.full_factors)  # (rows: checked made)

    @classmethod
    def raw(cls, **fields) -> BuildConfig:
        """Rows as captured (``fields`` override): a fixed 16x16 projection unless given, float32 codes, no
        fit and no transcode (``gradindex build --rows P16,fp32 --precondition none``)."""
        return cls(**{"budget": 0, "precondition": "none", "transcode": "none", "storage": "fp32", **fields})

    @property
    def projection(self) -> ProjectionSpec:
        """The projection ``rows`` names, with its random stream (an ``auto`` one's sizes: ``sized_projection``)."""
        r = self.rows
        if r.projection == "none":
            return ProjectionSpec(kind="none", k_a=0, k_g=0, seed=self.seed)
        sizes = {"k_a": r.k_a, "k_g": r.k_g} if r.projection == "fixed" else {}
        return ProjectionSpec(kind=self.projection_kind, seed=self.seed, **sizes)


def _row_spec(cfg: BuildConfig, rows: RowSpec | str | None, kw: dict, damping_given: bool) -> RowSpec:
    """``rows`` (``None``: the default's) with the sugar keywords ``kw`` applied, each ``auto`` resolved, and
    ``cfg.precondition``'s ``auto`` with them (``ekfac``, or ``none`` with ``optimizer_state`` or an ``eigen``
    basis); keywords left out keep what ``rows`` says (as ``dataclasses.replace`` of a config expects)."""
    parsed = isinstance(rows, str)
    if parsed:
        rows = RowSpec.parse(rows, cfg.damping)
        if bool(rows.adam) != bool(cfg.optimizer_state):
            raise ValueError(f"row spec {str(rows)!r}: ADAM rows are made from --optimizer-state, and only ADAM rows "
                             "are: " + ("add --optimizer-state" if rows.adam else "add ADAM to the spec, or drop "
                                        "--optimizer-state"))
    r = {**asdict(rows)} if rows is not None else {"transcode": "auto", "storage": "auto"}
    p = kw.get("projection")
    if p is not None:
        object.__setattr__(cfg, "seed", p.seed)
        if not p.is_identity:
            object.__setattr__(cfg, "projection_kind", p.kind)
    budget = kw.get("budget", "auto" if rows is None and p is None else None)
    if budget:
        r.update(projection="auto", budget=str(budget or "auto"))
    elif budget is not None or (p is not None and r.get("projection") != "auto"):
        p = p or ProjectionSpec()
        if p.sizes:
            raise ValueError("a projection with per-layer sizes is made by a budget: give BuildConfig a budget "
                             "(and the projection's kind and seed) instead of the sizes")
        r.update({"projection": "none"} if p.is_identity else {"projection": "fixed", "k_a": p.k_a, "k_g": p.k_g})
    r.update({k: kw[k] for k in ("allocation", "basis", "basis_damping", "storage") if k in kw})
    if rows is None or damping_given and not parsed:  # (a spec's own EKFAC@d or EIGEN@d wins)
        r["damping"] = cfg.damping
    r["adam"] = (kw.get("adam_mode") or r.get("adam") or "exact") if cfg.optimizer_state else ""
    eigen = r.get("basis") == "eigen"
    if cfg.precondition == "auto":
        object.__setattr__(cfg, "precondition", "none" if cfg.optimizer_state or eigen else "ekfac")
    transcode = kw.get("transcode", r["transcode"])
    if transcode not in ("auto", "ekfac", "none", True, False):
        raise ValueError(f"transcode {transcode!r} is not one of ['none', 'ekfac']")
    if transcode == "auto":
        transcode = "ekfac" if cfg.precondition == "ekfac" and r.get("basis", "raw") == "raw" else "none"
    r["transcode"] = transcode in ("ekfac", True)
    return RowSpec(**r)


@dataclass
class BuildResult:
    index_dir: Path
    manifest: dict
    seconds: float
    examples_computed: int


def model_dtype(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def build_identity(model: nn.Module, model_fp: str, space: RowSpace, data_fp: str, storage: str, max_length: int,
                   shard_size: int, batch_size: int, tokenizer_fp: dict | None = None, **more) -> dict:
    """The manifest's ``build`` section, what a resume or a query must match (:data:`IDENTITY_KEYS`): the one place
    it is made, for the offline build and the in-loop capture. ``more``: the sections only a build has (``basis``,
    ``optimizer``, ``transcode``)."""
    adapter, quant = adapter_fingerprint(model), base_quantization(model)
    return {
        "model_fingerprint": model_fp,
        **({"tokenizer": tokenizer_fp} if tokenizer_fp else {}),
        **({"adapter_fingerprint": adapter} if adapter else {}),
        **({"base_quantization": quant} if quant else {}),  # (the query loads the base so again)
        "dtype": model_dtype(model),
        "storage": storage,
        "data_fingerprint": data_fp,
        "layers": layer_identity(space),
        "projection": space.projection.to_dict(),
        "max_length": max_length,
        "loss": LOSS_CONVENTION,
        "shard_size": shard_size,
        "batch_size": batch_size,
        **more,
    }


def _contents(out: Path) -> list[Path]:
    """What an output directory holds, besides its lock file and a sampled build's fit sample (written first)."""
    skip = (LOCK, ".checksums.lock", layout.FIT_SAMPLE_DIR)
    return [p for p in out.iterdir() if p.name not in skip] if out.is_dir() else []


SHARDED_NAMES = (layout.SHARDS_FILE, layout.UNSPLIT_DIR, layout.SPLIT_PLAN)
"""What a sharded index, or a `build --parts` under way, holds at its top (instead of a manifest)."""


def refuse_foreign(out: Path) -> None:
    """Refuse (writing nothing) a non-empty directory that holds no gradindex index, or a part of a sharded index
    (:func:`refuse_part`; rank 0 checks for all)."""
    refuse_part(out)
    if distributed.rank() == 0 and _contents(out) and not manifest_path(out).exists():
        if any((out / n).exists() for n in SHARDED_NAMES):
            raise FileExistsError(f"output directory {str(out)!r} holds a sharded index (or a `build --parts` "
                                  "under way): a killed `build --parts` resumes with its --parts; else choose another "
                                  "--out (nothing was written)")
        raise FileExistsError(
            f"output directory {str(out)!r} is not empty and holds no gradindex index; "
            "choose another --out (nothing was written)"
        )


def refuse_part(out: Path, why: str = "a build into it would store the data set's first rows as the part's") -> None:
    """Refuse (writing nothing) a build (or, saying ``why``, a compact) into a part of a sharded index, even with
    ``--overwrite``: it would capture the data set's first rows as the part's (``--repair`` would recompute a damaged
    file from the wrong rows and record their hashes) or replace the part by a whole index; the repair is the whole
    sharded index's build."""
    found = part_of(out) if distributed.rank() == 0 else None
    if found:
        m, part = found
        raise FileExistsError(f"{str(out)!r} is part {part['part']} of {sharded_name(out)} (rows "
                              f"{part['first']}-{part['stop'] - 1}): {why}; nothing was written. Rebuild the "
                              f"sharded index with `{build_command(out, m)}`, split it again from the index it came "
                              "from, or give another --out")


def prepare_out_dir(out: Path, identity: dict, overwrite: bool, hashes: list[bytes] | None = None) -> dict | None:
    """Check an output directory (under its lock); return its manifest when the build resumes it.

    ``overwrite`` replaces whatever index is there (even one with a corrupt manifest), whatever
    its settings; without it, a build resumes only an index of the same identity. ``hashes``: the data's
    per-example token hashes, to name the first row that differs when the data set does.
    """
    refuse_foreign(out)
    if not _contents(out):
        return None
    if overwrite:
        clear_out_dir(out)
        return None
    old = Manifest.read(out)
    transcoded = old.transcoded  # rows rewritten in place after the build: compare the build that made them
    built = old.source_build
    diffs = identity_differences(built, identity)
    if hashes is not None and built.get("data_fingerprint") not in (None, identity.get("data_fingerprint")):
        diffs = [d + first_differing_row(out, hashes) if d.startswith("data set differs") else d for d in diffs]
    if built.get("fit_sample") != identity.get("fit_sample"):
        said = {k: f"a fit on a sample of {v['size']} (--fit-sample {v['size']})" if v else
                "a fit on every example (--fit-sample 0, or not more examples than --fit-sample)"
                for k, v in (("index", built.get("fit_sample")), ("now", identity.get("fit_sample")))}
        diffs.append(f"its rows were coded after {said['index']} and this build asks for {said['now']}")
    if transcoded and "transcode" not in identity:
        diffs.append(f"its rows were transcoded into the {old.basis.get('kind')} eigenbasis "
                     "after the build (the default) and this build asks for raw rows (--transcode none)")
    lost = _lost_basis(out, built.get("basis") or {}, identity.get("basis") or {})
    if lost and len(diffs) == 1:
        raise IndexMismatchError(lost)
    if diffs:  # (what the options set first: the layer set and the projection follow from them)
        diffs.sort(key=lambda d: not d.startswith(("storage", "data set", "row transcode", "max length", "model")))
        raise IndexMismatchError(
            f"{str(out)!r} holds another index, so it cannot be resumed: " + "; ".join(diffs)
            + ". Use another --out, or --overwrite to replace it."
        )
    return old.data


def _lost_basis(out: Path, built: dict, now: dict) -> str:
    """The error of a resume whose ``basis.h5`` (a ``kfac``/``eigen`` projection basis) is lost and whose factor pass
    now makes other maps than the rows were written in (the same settings, another digest); ``""`` otherwise."""
    def settings(b: dict) -> dict:
        return {k: v for k, v in b.items() if k not in ("digest", "kept_share")}

    same = built.get("digest") == now.get("digest")
    if (out / layout.BASIS_FILE).exists() or same or settings(built) != settings(now):
        return ""
    return (f"{layout.BASIS_FILE} of {str(out)!r} is missing and its factor pass now makes other maps than the rows "
            f"were written in (digest {built.get('digest')}, now {now.get('digest')}: another device or thread count "
            "sums in another order); the rows are kept: put back a copy of basis.h5, or run this build where the "
            "index was built, or build into another --out")


def first_differing_row(out: Path, hashes: list[bytes]) -> str:
    """``" (first at row R ...)"``: the first example whose tokens differ from those ``out``'s shards recorded
    (0-based, the data file's record order), or where the counts differ; empty when no shard tells."""
    paths = sorted((out / STORE_DIR).glob("shard-*.h5*"))
    stored = 0
    for p in paths:
        try:
            with h5py.File(p, "r") as f:
                first, rows = int(f.attrs.get("first_id", 0)), f["token_hash"][:]
        except (OSError, KeyError):
            continue
        stored = max(stored, first + len(rows))
        for i, h in enumerate(rows):
            if first + i >= len(hashes) or bytes(h) != hashes[first + i]:
                return f" (first at row {first + i}, 0-based, of the data: its tokens differ from the index's)"
    if stored and stored != len(hashes):
        return f" (the index's rows so far end at row {stored} and the data has {len(hashes)} examples)"
    return ""


def clear_out_dir(out: Path) -> None:
    """Delete what an output directory holds (``--overwrite``), besides its lock file."""
    for p in _contents(out):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    shutil.rmtree(out / layout.FIT_SAMPLE_DIR, ignore_errors=True)


def check_resumable(model: nn.Module, tokenizer, data: Tokenized, out: Path, cfg: BuildConfig, sink: RowSink) -> None:
    """Refuse (writing nothing) an output directory holding another index than the one ``cfg`` and ``sink``
    build, before a sampled build's sample pass (the main pass checks again)."""
    if manifest_path(out).exists():
        st = _setup(model, tokenizer, data, out, cfg, False, sink=sink)
        prepare_out_dir(out, st.identity, False, st.hashes)


def build_store(
    model: nn.Module,
    tokenizer,
    data: Tokenized,
    out_dir: str | os.PathLike,
    cfg: BuildConfig = BuildConfig(),
    model_id: str = "",
    data_id: str = "",
    overwrite: bool = False,
    progress: bool = True,
    repair: bool = False,
    full_fit_rows: np.ndarray | None = None,
    sink: RowSink | None = None,
) -> BuildResult:
    """Capture every example's projected gradient into ``out_dir/store`` (resuming if present).

    Holds ``out_dir``'s write lock (:mod:`gradindex.lock`) throughout. Committed shards are
    checked against their recorded hashes first (``repair``: whole files, else the cheap sampled
    check); a damaged one is moved to ``out_dir/damaged/`` and recomputed.
    ``full_fit_rows``: also sum the full-space ``A`` and ``S`` over these examples (sorted data indices:
    the full-space fit's set, which then skips its factor pass). ``sink`` (:class:`RowSink`, the default:
    rows as captured) receives each batch: a :class:`~gradindex.precondition.sampled.EigenCoder` writes every
    row already coded in its whitened eigenbasis (a sampled build's main pass; the manifest is the transcoded
    one from the start), and a sink's ``heads`` keep each batch's gradient w.r.t. the final hidden states.
    """
    out = Path(out_dir)
    refuse_foreign(out)
    with index_lock(out, "gradindex build"):
        st = _setup(model, tokenizer, data, out, cfg, progress, full_fit_rows, sink or RowSink())
        return _build_store(model, tokenizer, data, out, cfg, st, model_id, data_id, overwrite, progress, repair)


@dataclass
class _Setup:
    """What a store build settles before it writes: fingerprints, the capture (its rows and factor sums, where
    summed), the identity it records and where its rows go."""

    hashes: list
    data_fp: str
    pad_id: int
    spec: ProjectionSpec
    capture: GradientCapture
    rows: ProjectedRows
    kfac: KfacSums | None
    full: FullSums | None
    identity: dict
    write_basis: object
    sink: RowSink
    select: np.ndarray | None = None  # [N] membership of the examples whose full-space sums are kept; None: all
    digest: str = ""  # the digest of those examples, stored with the sums


def _setup(model: nn.Module, tokenizer, data: Tokenized, out: Path, cfg: BuildConfig, progress: bool,
           full_rows: np.ndarray | None = None, sink: RowSink | None = None) -> _Setup:
    """Fingerprints, the whitened basis (its factor pass, if any), the projection sizes and the capture."""
    sink = sink or RowSink()
    check_tokenizer_fits(model, tokenizer)  # (ids past the embedding: an IndexError in the capture)
    hashes = [token_hash(i, lab) for i, lab in zip(data.input_ids, data.labels)]
    data_fp = digest_bytes(hashes)
    model_fp = model_fingerprint(model)
    tokenizer_fp = tokenizer_fingerprint(tokenizer, chat=data.field == MESSAGES) \
        if hasattr(tokenizer, "get_vocab") else None  # (none, or a stand-in for pre-tokenized data: nothing to record)
    pad_id = resolve_pad_id(model, tokenizer)
    infos = {n: layer_info(m) for n, m in select_layers(model, cfg.layers).items()}
    basis, write = RowBasis(), None
    if cfg.rows.basis != "raw":
        basis, write = full_space_basis(model, data, pad_id, out, cfg, model_fp, data_fp, progress)
    spec = sized_projection(cfg, infos, basis)
    transforms, optimizer = capture_transforms(basis), None
    if cfg.optimizer_state:  # (the kfac basis is refused with it: one transform per layer)
        transforms, optimizer = adam_capture_transforms(cfg.optimizer_state, cfg.rows.adam, model, cfg.layers)
    space = RowSpace(spec, transforms)
    rows = ProjectedRows(space, cfg.route)
    kfac = KfacSums(space) if cfg.collect_covariance or (  # (coded rows are fitted already)
        cfg.precondition != "none" and cfg.fisher == "empirical" and not sink.coded) else None
    full = FullSums() if cfg.full_factors or full_rows is not None else None
    capture = GradientCapture(model, cfg.layers, *[v for v in (rows, kfac, full) if v is not None])
    r = cfg.rows
    identity = sink.identity(build_identity(
        model, model_fp, space, data_fp, r.capture_storage, cfg.max_length, cfg.shard_size, cfg.batch_size,
        tokenizer_fp, basis=basis_identity(cfg, basis, model_fp, data_fp), optimizer=optimizer,
        **({"transcode": {"basis": "ekfac", "storage": r.storage, "damping": cfg.damping}} if r.transcode else {})))
    return _Setup(hashes, data_fp, pad_id, spec, capture, rows, kfac, full, identity, write, sink,
                  *_full_selection(full_rows, len(data)))


def _start_manifest(model: nn.Module, tokenizer, data: Tokenized, cfg: BuildConfig, identity: dict, model_id: str,
                    data_id: str, old: dict | None) -> dict:
    """The manifest a build writes first (``status: building``); a resume keeps the old one's other keys."""
    manifest = new_manifest(
        "building", model_id, data_id, identity,
        {**{k: v for k, v in asdict(cfg).items()  # (the rows: "rows"; the stream: build.projection)
            if k not in ("rows", "projection_kind", "seed")},
         "optimizer_state": str(Path(cfg.optimizer_state).resolve()) if cfg.optimizer_state else ""},
        {"examples": len(data), "truncated": data.n_truncated, "text_field": data.field},
        template_of(tokenizer) if data.field == MESSAGES else None,
        **({"model_file": model_file(model)} if model_file(model) else {}),  # (a GGUF: its path and hash)
        **({"adapter_id": adapter_path(model)} if adapter_path(model) else {}),
        rows=str(cfg.rows))
    if old is not None:
        manifest = {**old, **{k: v for k, v in manifest.items() if k not in ("counts",)},
                    "counts": {**old.get("counts", {}), **manifest["counts"]}}
        manifest["status"] = "building"
    manifest["generation"] = (old or {}).get("generation") or new_generation()  # kept by a resume
    return manifest


def _build_store(model: nn.Module, tokenizer, data: Tokenized, out: Path, cfg: BuildConfig, st: _Setup,
                 model_id: str, data_id: str, overwrite: bool, progress: bool, repair: bool) -> BuildResult:
    t0 = time.perf_counter()
    old = distributed.on_rank0(lambda: prepare_out_dir(out, st.identity, overwrite, st.hashes))  # (one rank: deletes)
    if old is not None and old.get("transcode") and old.get("status") == "complete":  # built and transcoded already:
        computed = distributed.on_rank0(lambda: repair_eigenbasis_store(  # recompute damaged shards (no raw rows)
            model, GradientCapture(model, cfg.layers, ProjectedRows(RowSpace(st.spec, capture_transforms(
                index_basis(out, old))), cfg.route)),
            data, out, old, st.pad_id, st.hashes, full=repair, progress=progress))
        return BuildResult(out, old, time.perf_counter() - t0, computed or 0)
    lead = distributed.rank() == 0
    if lead:
        (out / STORE_DIR).mkdir(parents=True, exist_ok=True)
        if old is not None:
            _move_damaged_aside(out, repair)
        if st.write_basis is not None:
            st.write_basis()
    manifest = _start_manifest(model, tokenizer, data, cfg, st.identity, model_id, data_id, old)
    manifest = st.sink.start(out, manifest)  # (a coder: the rows' basis file, then the manifest of rows in it)
    if lead:
        write_manifest(out, manifest)
    distributed.barrier()  # the other ranks write their shards once rank 0 has set the directory up
    nonfinite, computed = write_shards(out, model, st, data, cfg, set(manifest.get("nonfinite_ids", [])), progress)
    parts = distributed.gather((sorted(nonfinite), dict(st.rows.route_counts), computed))
    seconds = time.perf_counter() - t0
    routes: dict[str, int] = {}
    for _, r, _ in parts:
        for key, v in r.items():
            routes[key] = routes.get(key, 0) + v
    manifest["status"] = "complete"
    manifest["nonfinite_ids"] = sorted({i for ids, _, _ in parts for i in ids})
    manifest["routes"] = routes
    manifest["counts"]["shards"] = -(-len(data) // cfg.shard_size)
    if distributed.world_size() > 1:
        manifest["counts"]["ranks"] = distributed.world_size()
    if lead:
        write_manifest(out, manifest)
    distributed.barrier()
    return BuildResult(out, manifest, seconds, sum(c for _, _, c in parts))


def write_shards(out: Path, model: nn.Module, st: _Setup, data: Tokenized, cfg: BuildConfig, nonfinite: set[int],
                 progress: bool) -> tuple[set[int], int]:
    """The store's one shard-writing loop: each shard this rank owns and has not committed is captured
    (:func:`_write_shard`), sealed and committed (hashed in a thread, overlapping the next capture); returns
    the examples with non-finite gradients and how many examples were computed now."""
    N, S = len(data), cfg.shard_size
    computed = 0
    model.requires_grad_(False)
    bar = progress_bar(total=N, unit="ex", desc="capture", disable=not progress or distributed.rank() > 0)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="gradindex-hash")  # commits overlap the next capture
    commits: list[Future] = []
    if distributed.world_size() > 1 or plain_head(model, set(st.capture.modules.values())) is None:
        st.sink.heads = None  # (none kept under torchrun, or without a plain LM head)
    ranks = distributed.team()
    try:
        with st.capture:
            for k in range((N + S - 1) // S):
                start, end = k * S, min((k + 1) * S, N)
                path = out / STORE_DIR / shard_name(k)
                if path.exists() or not ranks.owns(k):  # done, or another rank's (round-robin)
                    skip(bar, end - start)
                    continue
                w, n = _write_shard(path, k, start, end, model, st, data, cfg, nonfinite, bar)
                computed += n
                commits.append(hashing.submit(w.commit))
                for f in commits:
                    if f.done():
                        f.result()  # raise a failed commit now
        for f in commits:
            f.result()
    finally:
        if st.full is not None:
            st.full.select = None
        hashing.shutdown(wait=True)
        bar.close()
    return nonfinite, computed


def _write_shard(path: Path, k: int, start: int, end: int, model: nn.Module, st: _Setup, data: Tokenized,
                 cfg: BuildConfig, nonfinite: set[int], bar) -> tuple[ShardWriter, int]:
    """Capture shard ``k`` (examples ``start:end``, resuming a partial file unless per-shard sums or a coder's
    results are kept: those need the whole shard) and seal it; the sealed writer, to commit, and the examples
    computed."""
    w = ShardWriter(path, start, end - start, {n: st.rows.space.dim(n) for n in st.capture.infos}, st.data_fp,
                    st.sink.storage or cfg.rows.capture_storage)
    done = w.open()
    if (st.kfac is not None or st.full is not None or st.sink.coded) and done:  # redo it whole
        w.close()
        w.partial.unlink()
        done = w.open()
    skip(bar, done)
    try:
        for s in range(start + done, end, cfg.batch_size):
            e = min(s + cfg.batch_size, end)
            if st.select is not None:
                st.full.select = torch.from_numpy(np.nonzero(st.select[s:e])[0])
            ok = append_batch(w, model, st.capture, data, s, e, st.pad_id, st.hashes, st.sink)
            if not ok.all():
                bad = [int(s + i) for i in np.nonzero(~ok)[0]]
                nonfinite.update(bad)
                log.warning("examples %s have non-finite gradients; stored as zeros and flagged", bad)
            bar.update(e - s)
        if st.kfac is not None or st.full is not None:
            if st.full is not None:
                st.full.ensure()
            write_covariance(w.file, st.kfac, st.full, st.digest)
        st.sink.shard_done(k, start, end)
        w.seal()
    except BaseException:
        w.abort()  # (a full disk: no HDF5 handle left to fail again, or crash, at exit)
        raise
    return w, end - start - done


def _full_selection(rows: np.ndarray | None, n: int) -> tuple[np.ndarray | None, str]:
    """``([n]`` membership mask or None for all, the digest the shards record``)`` of full sums over ``rows``."""
    if rows is None or len(rows) == n:
        return None, ""
    mask = np.zeros(n, bool)
    mask[np.asarray(rows, np.int64)] = True
    return mask, rows_digest(rows)


def _move_damaged_aside(out: Path, full: bool) -> None:
    """Move committed shards that fail their hash check aside, so that this build recomputes them."""
    found = check_files(out, recorded(out, f"{STORE_DIR}/"), full)
    damaged = [x.file for x in found if x.problem != "missing"]
    damaged += [shard_of(x.file) for x in found  # a shard whose row hashes are damaged or gone: recomputed
                if shard_of(x.file) != x.file and shard_of(x.file) not in damaged]
    for p in move_aside(out, damaged):
        log.warning("%s is damaged; moved to %s and recomputed", p.name, p.parent)
