"""The store writer: data + model → store shards and manifest, resumable (fit and index: `pipeline`)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

import gradindex
from gradindex import distributed
from gradindex.adapter import adapter_fingerprint, adapter_path
from gradindex.capture import GradientCapture, ProjectionSpec
from gradindex.capture.adam import ADAM_MODES, adam_capture_transforms
from gradindex.capture.gram import upper_to_symmetric
from gradindex.capture.hooks import select_layers
from gradindex.capture.layers import layer_info
from gradindex.capture.sampling import FISHERS
from gradindex.chat import MESSAGES, template_of
from gradindex.checksum import check_files, move_aside, recorded, shard_of
from gradindex.data import Tokenized, token_hash
from gradindex.fingerprint import digest_bytes, model_fingerprint
from gradindex.lock import LOCK, index_lock
from gradindex.manifest import (
    FORMAT_VERSION,
    IndexMismatchError,
    identity_differences,
    manifest_path,
    new_generation,
    read_manifest,
    write_manifest,
)
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import resolve_pad_id
from gradindex.progress import progress_bar
from gradindex.spec.manifest import layer_identity
from gradindex.store import STORE_DIR, ShardWriter, shard_name
from gradindex.store.append import append_batch
from gradindex.store.basis import BASES, RowBasis, capture_transforms, index_basis
from gradindex.store.codes import check_storage
from gradindex.store.repair import repair_eigenbasis_store
from gradindex.store.sizing import basis_identity, full_space_basis, sized_projection

log = logging.getLogger("gradindex")

LOSS_CONVENTION = "sum of next-token cross-entropy over each example's target tokens (offline)"


@dataclass(frozen=True)
class BuildConfig:
    """Settings of a store build; serialized into the manifest."""

    projection: ProjectionSpec = field(default_factory=ProjectionSpec)
    """Factored projection (kind, k_a, k_g, seed)."""
    layers: tuple[str, ...] = ()
    """Glob patterns of layers to hook; empty = every linear layer in the transformer blocks."""
    max_length: int = 512
    """Examples longer than this many tokens are truncated (and counted in the manifest)."""
    batch_size: int = 8
    """Examples per forward/backward."""
    route: str = "auto"
    """``auto`` (cost model), ``factorized`` or ``materialized``."""
    shard_size: int = 4096
    """Examples per store file; also the most a torn file can cost on resume."""
    collect_covariance: bool = False
    """Accumulate K-FAC factors (A, S) per shard in the same pass."""
    full_factors: bool = False
    """Also sum the full-space (unprojected) ``A`` and ``S`` per shard in this pass, so that
    ``gradindex precondition --space full`` needs only its correction pass."""
    precondition: str = "none"
    """``none``, ``kfac`` or ``ekfac``: fit it after the capture (factors from this same pass); ``auto``:
    ``ekfac``, or ``none`` with ``optimizer_state`` (:meth:`defaults`)."""
    damping: float = DEFAULT_DAMPING
    """Relative damping of the self-influence written with ``precondition``."""
    storage: str = "fp32"
    """Row codes on disk: ``fp32``, ``fp16``, ``int8`` or ``int4`` (per-row scale; :mod:`gradindex.store.codes`);
    ``auto``: ``int4`` for rows transcoded into the EK-FAC eigenbasis, else ``int8``."""
    budget: int | str = 0
    """Bytes per example for per-layer projection sizes (``--projection auto``): an integer, or a
    fraction of the full gradient's float32 bytes such as ``"1/8"``; 0 = ``projection`` as given."""
    allocation: str = "cost"
    """How the budget is spread over layers: ``cost`` (``ratio``'s numbers per layer, split between its
    sides for the cheapest capture), ``ratio``, ``equal`` or ``spectrum`` (capture.allocation)."""
    basis: str = "raw"
    """``raw``; ``kfac``: whiten each side by its damped full-space factor before projection; ``eigen``:
    store the eigen-coordinates of full-space EK-FAC that ``budget`` buys, chosen over all layers by
    their K-FAC eigenvalue against the damping and whitened at capture (``precondition`` and
    ``transcode`` ``none``: the rows already answer ``ekfac``; docs/math.md, "What a row holds")."""
    basis_damping: float = 1.0
    """Relative damping of the ``kfac`` whitening (a fraction of each factor's mean eigenvalue); 1.0 kept
    the most of full-space EK-FAC's top-10 in benchmarks/rowspace.py (0.01, 0.1, 0.3, 3, 10 measured)."""
    basis_examples: int = 0
    """Examples sampled for the factor pass of a ``kfac`` basis (0 = all)."""
    basis_seed: int = 0
    """Seed of that sample."""
    fisher: str = "empirical"
    """Factors of ``precondition`` from the observed labels (``empirical``, collected in this pass) or
    from labels sampled from the model (``true``: a model pass of its own; stored rows keep the observed)."""
    fisher_seed: int = 0
    """Seed of the true Fisher's sampled labels."""
    optimizer_state: str = ""
    """Adam state of the training run (safetensors or torch ``state_dict``): store ``G ⊘ (√v + ε)``,
    the rows of ``--method adam`` (:mod:`gradindex.capture.adam`); empty = plain gradients."""
    adam_mode: str = "exact"
    """``exact`` (entrywise, materialized route) or ``factored`` (rank-1 ``v``, per-side scales)."""
    transcode: str = "none"
    """``ekfac``: after the EK-FAC fit (``precondition="ekfac"``), rewrite the rows in its whitened
    eigenbasis at ``damping``, coded as ``storage`` (captured as ``fp16`` first; the pipeline's last
    store step, :func:`gradindex.precondition.compact.transcode_in_place`). ``none``: rows stay raw.
    ``auto``: ``ekfac`` after an EK-FAC fit of raw rows, else ``none``."""

    @classmethod
    def defaults(cls, **settings) -> BuildConfig:
        """What ``gradindex build`` builds with no options (``settings`` override fields): per-layer
        projection sizes for the default byte budget, EK-FAC fitted, rows transcoded into its whitened
        eigenbasis as int4 (each ``auto`` resolved here, from the other settings)."""
        return cls(**{"budget": "auto", "precondition": "auto", "transcode": "auto", "storage": "auto", **settings})

    def _resolve_auto(self) -> None:
        """Each ``auto`` setting resolved from the others (the one place these defaults live)."""
        if self.basis == "eigen":  # whitened EK-FAC coordinates at capture: nothing to fit or transcode
            for name in ("precondition", "transcode"):
                if getattr(self, name) == "auto":
                    object.__setattr__(self, name, "none")
            if self.storage == "auto":
                object.__setattr__(self, "storage", "int4")
        if self.precondition == "auto":
            object.__setattr__(self, "precondition", "none" if self.optimizer_state else "ekfac")
        if self.transcode == "auto":
            object.__setattr__(self, "transcode",
                               "ekfac" if self.precondition == "ekfac" and self.basis == "raw" else "none")
        if self.storage == "auto":
            object.__setattr__(self, "storage", "int4" if self.transcode == "ekfac" else "int8")

    @property
    def capture_storage(self) -> str:
        """Codes of the captured rows: ``storage``, or float16 when they are transcoded afterwards."""
        return "fp16" if self.transcode == "ekfac" else self.storage

    def __post_init__(self) -> None:
        self._resolve_auto()
        check_storage(self.storage)
        if self.batch_size < 1 or self.shard_size < 1 or self.max_length < 2:
            raise ValueError(f"batch size and shard size must be >= 1 and max length >= 2 (got {self.batch_size}, "
                             f"{self.shard_size}, {self.max_length}): --batch-size, --shard-size, --max-length")
        if self.precondition not in ("none", "kfac", "ekfac"):
            raise ValueError(f"precondition {self.precondition!r} is not one of ['none', 'kfac', 'ekfac']")
        if self.basis not in (*BASES[:2], "eigen"):
            raise ValueError(f"build basis {self.basis!r} is not one of {[*BASES[:2], 'eigen']} "
                             "(the ekfac basis is a transcode after a fit: `gradindex compact`)")
        if self.basis == "eigen" and (self.precondition != "none" or self.transcode != "none"
                                      or self.collect_covariance or self.full_factors):
            raise ValueError("--projection-basis eigen stores whitened full-space EK-FAC coordinates, which answer "
                             "--method ekfac as they are: use it with --precondition none --transcode none "
                             "(and without --full-factors)")
        if self.basis == "eigen" and not self.budget:
            raise ValueError("--projection-basis eigen chooses what to store from --budget: use --projection auto")
        if self.allocation == "spectrum" and self.basis != "kfac":
            raise ValueError("allocation by spectrum needs the full-space factors: add --projection-basis kfac")
        if self.fisher not in FISHERS:
            raise ValueError(f"fisher {self.fisher!r} is not one of {list(FISHERS)}")
        if self.adam_mode not in ADAM_MODES:
            raise ValueError(f"adam mode {self.adam_mode!r} is not one of {list(ADAM_MODES)}")
        if self.optimizer_state and (self.precondition != "none" or self.collect_covariance):
            raise ValueError("--optimizer-state builds an index of Adam-preconditioned rows (method adam); "
                             "K-FAC/EK-FAC are fitted on plain gradients: build those without it")
        if self.transcode not in ("none", "ekfac"):
            raise ValueError(f"transcode {self.transcode!r} is not one of ['none', 'ekfac']")
        if self.transcode == "ekfac" and self.precondition != "ekfac":
            raise ValueError("rows are transcoded into the EK-FAC eigenbasis after an EK-FAC fit: add "
                             "--precondition ekfac, or --transcode none")
        if self.transcode == "ekfac" and self.basis != "raw":
            raise ValueError("--transcode ekfac rotates raw rows; with --projection-basis kfac use --transcode none")
        if self.optimizer_state and self.basis != "raw":
            raise ValueError("--optimizer-state builds an index of Adam-preconditioned rows (method adam); "
                             "the kfac basis whitens plain gradients: use --projection-basis raw with it")


@dataclass
class BuildResult:
    index_dir: Path
    manifest: dict
    seconds: float
    examples_computed: int


def model_dtype(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def _identity(model: nn.Module, model_fp: str, capture: GradientCapture, cfg: BuildConfig, data_fp: str,
              basis: dict, optimizer: dict | None) -> dict:
    adapter = adapter_fingerprint(model)
    return {
        "model_fingerprint": model_fp,
        **({"adapter_fingerprint": adapter} if adapter else {}),
        "dtype": model_dtype(model),
        "storage": cfg.capture_storage,
        "data_fingerprint": data_fp,
        "layers": layer_identity(capture),
        "projection": capture.projection.to_dict(),
        "basis": basis,
        "max_length": cfg.max_length,
        "loss": LOSS_CONVENTION,
        "shard_size": cfg.shard_size,
        "batch_size": cfg.batch_size,
        "optimizer": optimizer,
        **({"transcode": {"basis": cfg.transcode, "storage": cfg.storage, "damping": cfg.damping}}
           if cfg.transcode != "none" else {}),
    }


def _contents(out: Path) -> list[Path]:
    """What an output directory holds, besides its lock file."""
    return [p for p in out.iterdir() if p.name not in (LOCK, ".checksums.lock")] if out.is_dir() else []


def refuse_foreign(out: Path) -> None:
    """Refuse (writing nothing) a non-empty directory that holds no gradindex index (rank 0 checks for all)."""
    if distributed.rank() == 0 and _contents(out) and not manifest_path(out).exists():
        raise FileExistsError(
            f"output directory {str(out)!r} is not empty and holds no gradindex index; "
            "choose another --out (nothing was written)"
        )


def prepare_out_dir(out: Path, identity: dict, overwrite: bool) -> dict | None:
    """Check an output directory (under its lock); return its manifest when the build resumes it.

    ``overwrite`` replaces whatever index is there (even one with a corrupt manifest), whatever
    its settings; without it, a build resumes only an index of the same identity.
    """
    refuse_foreign(out)
    if not _contents(out):
        return None
    if overwrite:
        for p in _contents(out):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return None
    old = read_manifest(out)
    transcoded = old.get("transcode")  # rows rewritten in place after the build: compare the build that made them
    diffs = identity_differences(transcoded["source_build"] if transcoded else old.get("build", {}), identity)
    if transcoded and "transcode" not in identity:
        diffs.append(f"its rows were transcoded into the {old['build'].get('basis', {}).get('kind')} eigenbasis "
                     "after the build (the default) and this build asks for raw rows (--transcode none)")
    if diffs:
        raise IndexMismatchError(
            f"{str(out)!r} holds another index, so it cannot be resumed: " + "; ".join(diffs)
            + ". Use another --out, or --overwrite to replace it."
        )
    return old


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
) -> BuildResult:
    """Capture every example's projected gradient into ``out_dir/store`` (resuming if present).

    Holds ``out_dir``'s write lock (:mod:`gradindex.lock`) throughout. Committed shards are
    checked against their recorded hashes first (``repair``: whole files, else the cheap sampled
    check); a damaged one is moved to ``out_dir/damaged/`` and recomputed.
    """
    out = Path(out_dir)
    refuse_foreign(out)
    with index_lock(out, "gradindex build"):
        return _build_store(model, tokenizer, data, out, cfg, model_id, data_id, overwrite, progress, repair)


def _build_store(model: nn.Module, tokenizer, data: Tokenized, out: Path, cfg: BuildConfig, model_id: str,
                 data_id: str, overwrite: bool, progress: bool, repair: bool) -> BuildResult:
    t0 = time.perf_counter()
    hashes = [token_hash(i, lab) for i, lab in zip(data.input_ids, data.labels)]
    data_fp = digest_bytes(hashes)
    model_fp = model_fingerprint(model)
    pad_id = resolve_pad_id(model, tokenizer)
    infos = {n: layer_info(m) for n, m in select_layers(model, cfg.layers).items()}
    basis, write = RowBasis(), None
    if cfg.basis in ("kfac", "eigen"):
        basis, write = full_space_basis(model, data, pad_id, out, cfg, model_fp, data_fp, progress)
    spec = sized_projection(cfg, infos, basis)
    transforms, optimizer = capture_transforms(basis), None
    if cfg.optimizer_state:  # (the kfac basis is refused with it: one transform per layer)
        transforms, optimizer = adam_capture_transforms(cfg.optimizer_state, cfg.adam_mode, model, cfg.layers)
    capture = GradientCapture(model, cfg.layers, spec, cfg.route, weight_free=True,
                              collect_covariance=cfg.collect_covariance
                              or (cfg.precondition != "none" and cfg.fisher == "empirical"),
                              collect_full_covariance=cfg.full_factors, transforms=transforms)
    identity = _identity(model, model_fp, capture, cfg, data_fp, basis_identity(cfg, basis, model_fp, data_fp),
                         optimizer)
    old = distributed.on_rank0(lambda: prepare_out_dir(out, identity, overwrite))  # (it may delete: one rank does it)
    if old is not None and old.get("transcode") and old.get("status") == "complete":  # built and transcoded already:
        computed = distributed.on_rank0(lambda: repair_eigenbasis_store(  # recompute damaged shards (no raw rows)
            model, GradientCapture(model, cfg.layers, spec, cfg.route, weight_free=True,
                                   transforms=capture_transforms(index_basis(out, old))),
            data, out, old, pad_id, hashes, full=repair, progress=progress))
        return BuildResult(out, old, time.perf_counter() - t0, computed or 0)
    lead = distributed.rank() == 0
    if lead:
        (out / STORE_DIR).mkdir(parents=True, exist_ok=True)
        if old is not None:
            _move_damaged_aside(out, repair)
        if write is not None:
            write()
    manifest = {
        "format_version": FORMAT_VERSION,
        "library_version": gradindex.__version__,
        "status": "building",
        "model_id": model_id,
        **({"adapter_id": adapter_path(model)} if adapter_path(model) else {}),
        "data_id": data_id,
        **({"chat_template": template_of(tokenizer)} if data.field == MESSAGES else {}),
        "build": identity,
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "projection"},  # it is build.projection
                   "budget": str(cfg.budget),
                   "optimizer_state": str(Path(cfg.optimizer_state).resolve()) if cfg.optimizer_state else ""},
        "dtype": identity["dtype"],
        "counts": {"examples": len(data), "truncated": data.n_truncated, "text_field": data.field},
    }
    if old is not None:
        manifest = {**old, **{k: v for k, v in manifest.items() if k not in ("counts",)},
                    "counts": {**old.get("counts", {}), **manifest["counts"]}}
        manifest["status"] = "building"
    manifest["generation"] = (old or {}).get("generation") or new_generation()  # kept by a resume
    if lead:
        write_manifest(out, manifest)
    distributed.barrier()  # the other ranks write their shards once rank 0 has set the directory up

    N, S, B = len(data), cfg.shard_size, cfg.batch_size
    dims = {n: capture.dim(n) for n in capture.infos}
    nonfinite: set[int] = set(manifest.get("nonfinite_ids", []))
    computed = 0
    model.requires_grad_(False)
    shards = [(k, k * S, min((k + 1) * S, N)) for k in range((N + S - 1) // S)]
    bar = progress_bar(total=N, unit="ex", desc="capture", disable=not progress or distributed.rank() > 0)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="gradindex-hash")  # commits overlap the next capture
    commits: list[Future] = []
    try:
        with capture:
            for k, start, end in shards:
                path = out / STORE_DIR / shard_name(k)
                if path.exists() or not distributed.owned(k):  # done, or another rank's (round-robin)
                    bar.update(end - start)
                    continue
                w = ShardWriter(path, start, end - start, dims, data_fp, cfg.capture_storage)
                done = w.open()
                if (capture.collect_covariance or capture.collect_full_covariance) and done:  # factors need
                    # the whole shard: redo it
                    w.close()
                    w.partial.unlink()
                    done = w.open()
                bar.update(done)
                try:
                    for s in range(start + done, end, B):
                        e = min(s + B, end)
                        ok = append_batch(w, model, capture, data, s, e, pad_id, hashes)
                        if not ok.all():
                            bad = [int(s + i) for i in np.nonzero(~ok)[0]]
                            nonfinite.update(bad)
                            log.warning("examples %s have non-finite gradients; stored as zeros and flagged", bad)
                        computed += e - s
                        bar.update(e - s)
                    if capture.collect_covariance or capture.collect_full_covariance:
                        _write_covariance(w, capture)
                    w.seal()
                except BaseException:
                    w.abort()  # (a full disk: no HDF5 handle left to fail again, or crash, at exit)
                    raise
                commits.append(hashing.submit(w.commit))
                for f in commits:
                    if f.done():
                        f.result()  # raise a failed commit now
        for f in commits:
            f.result()
    finally:
        hashing.shutdown(wait=True)
        bar.close()
    parts = distributed.gather((sorted(nonfinite), dict(capture.route_counts), computed))
    seconds = time.perf_counter() - t0
    routes: dict[str, int] = {}
    for _, r, _ in parts:
        for key, v in r.items():
            routes[key] = routes.get(key, 0) + v
    manifest["status"] = "complete"
    manifest["nonfinite_ids"] = sorted({i for ids, _, _ in parts for i in ids})
    manifest["routes"] = routes
    manifest["counts"]["shards"] = len(shards)
    if distributed.world_size() > 1:
        manifest["counts"]["ranks"] = distributed.world_size()
    if lead:
        write_manifest(out, manifest)
    distributed.barrier()
    return BuildResult(out, manifest, seconds, sum(c for _, _, c in parts))



def _move_damaged_aside(out: Path, full: bool) -> None:
    """Move committed shards that fail their hash check aside, so that this build recomputes them."""
    found = check_files(out, recorded(out, f"{STORE_DIR}/"), full)
    damaged = [x.file for x in found if x.problem != "missing"]
    damaged += [shard_of(x.file) for x in found  # a shard whose row hashes are damaged or gone: recomputed
                if shard_of(x.file) != x.file and shard_of(x.file) not in damaged]
    for p in move_aside(out, damaged):
        log.warning("%s is damaged; moved to %s and recomputed", p.name, p.parent)


def _write_covariance(w: ShardWriter, capture: GradientCapture) -> None:
    """Store the shard's Σ ā āᵀ, Σ ḡ ḡᵀ and token counts (``covariance``; unprojected:
    ``covariance_full``), then reset the accumulators."""
    for group, (A, S, T) in (("covariance", (capture.cov_a, capture.cov_g, capture.cov_tokens)),
                             ("covariance_full", (capture.full_a, capture.full_g, capture.full_tokens))):
        if not A:
            continue
        g = w.file.create_group(group)
        read = upper_to_symmetric if group == "covariance_full" else np.asarray  # full: upper triangles summed
        for n in capture.infos:
            if n in A:
                grp = g.create_group(n)
                grp["A"] = read(A[n].cpu().numpy())
                grp["S"] = read(S[n].cpu().numpy())
                grp.attrs["tokens"] = T[n]
        A.clear()
        S.clear()
        T.clear()

