"""``manifest.json``, the description of an index: read, checked, made, written, and its typed view.

A manifest is JSON with these sections (docs/formats.md lists every key):

* ``build``: the identity of the stored rows — what must match for a resume or a query
  (:data:`IDENTITY_KEYS`), ``layers`` among them (:class:`LayerShape` per layer);
* ``config``: the build's options as given (:func:`build_command` regenerates the command line from it);
* ``counts``, ``preconditioners``, ``status``, ``model_id``, ``data_id``, ``dtype`` and more.

The file is read once per process per index: :func:`read_manifest` keeps what it parsed, keyed by
the file's inode, size and modification time, and hands out copies; :func:`write_manifest` (the
only writer; it checks the shape first) replaces the file atomically and keeps what it wrote, so
re-reading an index this process wrote, or one no other process changed, costs no file read.
:func:`manifest_reads` counts the file reads (tests/test_manifest_reads.py).

:class:`Manifest` wraps the parsed dict without changing it (``Manifest.from_dict(d).to_dict() == d``,
so old indices open as they are) and names what the stages ask of it; the stages below the CLI read a
manifest through it (:meth:`Manifest.read` opens one at an entry point that takes a path).
:func:`layer_identity` is the one place a manifest's ``build.layers`` is made (by the build, the live
capture, and the query engine's check that a model fits an index); :func:`new_manifest` the one place a
manifest is made.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gradindex
from gradindex.errors import IndexMismatchError  # noqa: F401  (re-exported)
from gradindex.spec.build import DEFAULT_BATCH_SIZE, default
from gradindex.spec.layout import CAPTURE_LOG_DIR, MANIFEST, SHARDS_FILE, TRAJECTORY
from gradindex.spec.rows import DEFAULT_DAMPING, LEGACY_DAMPING, RowSpec

FORMAT_VERSION = 1
SHARD_KEY = "shard"
"""A part's manifest entry (a part of a sharded index, :mod:`gradindex.index.sharded`): ``{"part", "parts", "first",
"stop", "examples", "files"}``."""

# Keys of the manifest's "build" section that must match for a resume or a query to be valid,
# with the words used when they differ.
IDENTITY_KEYS = {
    "dtype": "model dtype",
    "adapter_fingerprint": "adapter (--adapter)",
    "base_quantization": "base quantization (--base-quantization)",
    "model_fingerprint": "model",
    "tokenizer": "tokenizer",
    "storage": "storage",
    "max_length": "max length",
    "data_fingerprint": "data set",
    "layers": "layer set",
    "projection": "projection",
    "basis": "row basis",
    "loss": "loss convention",
    "shard_size": "shard size",
    "batch_size": "batch size",
    "optimizer": "optimizer preconditioning (--optimizer-state)",
    "transcode": "row transcode (--transcode, with its --storage and --damping)",
}


def manifest_path(index_dir: str | os.PathLike) -> Path:
    return Path(index_dir) / MANIFEST


_READ: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
"""Resolved manifest path → (inode, size, mtime_ns) of the file and what it held."""
_FILE_READS = 0
_CALLS = 0


def manifest_reads(calls: bool = False) -> int:
    """How many times this process has read a ``manifest.json`` file (cached re-reads do not count);
    with ``calls``, how many times :func:`read_manifest` was called (cached or not)."""
    return _CALLS if calls else _FILE_READS


def forget_manifests() -> None:
    """Drop what :func:`read_manifest` keeps (the next read of each index reads its file again)."""
    _READ.clear()


def manifest_stamp(index_dir: str | os.PathLike) -> tuple[int, int, int] | None:
    """``(inode, size, mtime_ns)`` of ``index_dir``'s manifest file (``None``: there is none): it changed when
    this did (what :func:`read_manifest` keys its copies by, and an open index checks it is current by)."""
    try:
        st = manifest_path(index_dir).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def sharded_parent(part_dir: str | os.PathLike) -> Path | None:
    """The folder holding ``part_dir`` when it is the sharded index that lists ``part_dir`` as one of its parts
    (a part copied elsewhere: ``None``, so that no command names a folder that is not its index)."""
    part_dir = Path(part_dir)
    try:
        doc = json.loads((part_dir.parent / SHARDS_FILE).read_text())
        names = [p["dir"] for p in doc["parts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return part_dir.parent if part_dir.name in names else None


def sharded_name(part_dir: str | os.PathLike) -> str:
    """How a message names the sharded index ``part_dir`` belongs to: its folder where that lists it."""
    parent = sharded_parent(part_dir)
    return f"the sharded index {str(parent)!r}" if parent else "a sharded index (the one it was split from or built)"


def part_of(index_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(manifest, its part entry)`` when ``index_dir`` is a part of a sharded index; ``None`` for anything else
    (a whole index, no manifest or an unreadable one: the command's own open names those)."""
    try:
        m = read_manifest(index_dir)
    except (OSError, ValueError):
        return None
    return (m, m[SHARD_KEY]) if m.get(SHARD_KEY) else None


def no_manifest(d: Path) -> str:
    """Why ``d`` holds no manifest, in words: a trajectory index (its own ``trajectory.json``), a part of a sharded
    index that is gone (its folder's ``shards.json`` lists it), or no index at all."""
    if (d / TRAJECTORY).is_file():
        return (f"{str(d)!r} is a trajectory (TracIn) index, a folder of one index per checkpoint: query it with "
                f"`gradindex query {d} --method tracin`; each checkpoint's index ({d / 'ckpt-00'}, ...) is an "
                "ordinary index for the other commands")
    if (d / SHARDS_FILE).is_file():
        return (f"{str(d)!r} is a sharded index (its {SHARDS_FILE} names parts, each a complete index); `query`, "
                "`serve`, `audit`, `info`, `verify` and `merge` take it, and this command takes one index: merge it "
                f"first (`gradindex merge {d} --out INDEX_DIR`)")
    if sharded_parent(d) is not None and not d.is_dir():
        return (f"{str(d)!r}, a part of the sharded index {str(d.parent)!r}, is not in this folder: copy it here "
                "from where the index was split or built (a host that runs only some torchrun ranks needs only "
                f"their parts; `gradindex verify {d.parent} --here` checks the parts it holds)")
    if sharded_parent(d) is not None:
        return (f"{str(d)!r}, a part of the sharded index {str(d.parent)!r}, has no {MANIFEST} (a copy not "
                "finished, or damage): copy the part again from where the index was split or built, or split the "
                "index again")
    if (d / CAPTURE_LOG_DIR).is_dir():
        return (f"{str(d)!r} holds an unfinished live capture (its {CAPTURE_LOG_DIR}/ log, no {MANIFEST}): the "
                "training run stopped before the capture's end wrote the index; a live capture is not resumed, so "
                "train again with overwrite=True, or build the final model's index offline into another folder "
                "(`gradindex build MODEL_DIR DATA --out INDEX_DIR`)")
    return (f"{str(d)!r} is not a gradindex index (no {MANIFEST}); build one with "
            "`gradindex build MODEL_DIR DATA --out INDEX_DIR`")


def tokens_differ(manifest: dict) -> str:
    """Why a data file's tokens differ from an index's, and the fix: a live capture's loop may have tokenized it
    otherwise than ``gradindex build`` does; else the file changed since the build."""
    if manifest.get("training"):
        return ("the training loop tokenized the data otherwise than `gradindex build` does (TRL appends an "
                "end-of-sequence token to text, and trains chats on every token unless assistant_only_loss=True), "
                "or the file changed since; capture with the loop tokenizing as the build does (docs/training.md), "
                "or build the index offline")
    return "the file changed since the build; restore it, or rebuild the index"


def read_manifest(index_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of ``index_dir`` (a copy the caller may change); read from disk only when the file
    changed since this process last read or wrote it."""
    global _FILE_READS, _CALLS
    _CALLS += 1
    p, stamp = manifest_path(index_dir), manifest_stamp(index_dir)
    if stamp is None:
        raise FileNotFoundError(no_manifest(Path(index_dir)))
    key = str(p.resolve())
    kept = _READ.get(key)
    if kept is not None and kept[0] == stamp:
        return copy.deepcopy(kept[1])
    _FILE_READS += 1
    try:
        manifest = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{str(p)!r} is corrupt ({e}); replace the index: re-run the `gradindex build` that made it "
            "with --overwrite"
        ) from None
    problem = shape_problem(manifest)
    if problem:
        raise ValueError(
            f"{str(p)!r} is not a gradindex manifest ({problem}); replace the index: re-run the "
            "`gradindex build` that made it with --overwrite"
        )
    _READ[key] = (stamp, copy.deepcopy(manifest))
    return manifest


def shape_problem(manifest: Any) -> str:
    """What is wrong with the shape of a parsed manifest ('' when nothing is)."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    build = manifest.get("build")
    if not isinstance(build, dict):
        return "no 'build' object"
    layers = build.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        return "no 'build.layers' object of layer objects"
    for key, kind in (("status", str), ("counts", dict), ("preconditioners", dict), ("nonfinite_ids", list)):
        if key in manifest and not isinstance(manifest[key], kind):
            return f"'{key}' is a {type(manifest[key]).__name__}, not a {kind.__name__}"
    return ""


def basis_of(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``build.basis`` of a manifest dict, partial ones included (empty: raw rows); :attr:`Manifest.basis` of a
    whole one."""
    return (manifest.get("build") or {}).get("basis") or {}


def baked_damping(manifest: dict[str, Any]) -> float | None:
    """The relative damping the stored rows are whitened at, fixed when they were written (``build.basis.damping``:
    ``(Λ* + δ)^{-1/2}`` of an ``ekfac`` basis, each side's ``(F + δ)^{-1/2}`` of a ``kfac`` one); ``None`` for raw rows.

    Not a query's ``damping``: that one applies a fitted curvature to the rows and cannot change these numbers, so
    on such rows it only matters to the methods fitted on them (``ekfac`` on ``kfac`` rows). Every reader of the
    field reads it here."""
    basis = basis_of(manifest)
    kind = basis.get("kind", "raw")
    if kind == "raw":
        return None
    return float(basis.get("damping", 1.0 if kind == "kfac" else LEGACY_DAMPING))


def new_generation() -> str:
    """A fresh ``manifest["generation"]``: written when a build starts a new index (a resume keeps it, a
    transcode changes it), so that an open engine sees that ``build --overwrite`` replaced its index."""
    return uuid.uuid4().hex


def transcode_unfinished(manifest: dict) -> bool:
    """Whether the build asked for the EK-FAC transcode (``--transcode ekfac``, the default) and its rows
    are not transcoded yet (a kill during the transcode, or before it)."""
    asked = (manifest.get("build", {}).get("transcode") or {}).get("basis") == "ekfac" or \
        str(manifest.get("config", {}).get("transcode", "none")) == "ekfac"
    return asked and not manifest.get("transcode") and row_basis(manifest) == "raw"


def refuse_unfinished_transcode(index_dir: str | os.PathLike, manifest: dict, then: str) -> None:
    """Raise, naming the build command that finishes the transcode, when it is unfinished."""
    if transcode_unfinished(manifest):
        raise ValueError(
            f"the build of {str(index_dir)!r} stopped before its transcode into the EK-FAC eigenbasis finished: its "
            "rows are still the raw capture, not the final codes, and its FAISS indices were never built; "
            f"finish it with the build command `{build_command(index_dir, manifest, extra='', index=True)}` (it "
            f"resumes where it stopped), then {then}")


def write_manifest(index_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write atomically (a killed write leaves the previous manifest intact); refuse a malformed one."""
    text = json.dumps(manifest, indent=2, sort_keys=True, default=str)
    written = json.loads(text)
    problem = shape_problem(written)
    if problem:
        raise ValueError(f"refusing to write a malformed manifest to {str(index_dir)!r}: {problem}")
    p = manifest_path(index_dir)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)
    _READ[str(p.resolve())] = (manifest_stamp(index_dir), written)


def identity_differences(stored: dict[str, Any], given: dict[str, Any], keys=IDENTITY_KEYS) -> list[str]:
    """Human-readable list of identity keys whose values differ.

    The model fingerprint hashes values in their loaded dtype, so when the dtype differs only
    that is named (the fingerprint differs because of it).
    """
    diffs = []
    dtype_differs = "dtype" in stored and "dtype" in given and stored["dtype"] != given["dtype"]
    key = "adapter_fingerprint"  # the model's fingerprint covers the adapter's weights too: name the adapter
    adapter_differs = key in stored and key in given and stored[key] != given[key]
    key = "base_quantization"  # (so does the base's quantization: the quantized weights are hashed)
    quant_differs = key in stored and key in given and stored[key] != given[key]
    for key, words in keys.items():
        if key == "model_fingerprint" and (dtype_differs or adapter_differs or quant_differs):
            continue
        if key == "tokenizer" and key in stored and key in given:  # (its parts, named)
            from gradindex.fingerprint import tokenizer_differences

            diffs += [f"tokenizer differs: {d}" for d in tokenizer_differences(stored[key] or {}, given[key] or {})]
        elif key in stored and key in given and stored[key] != given[key]:
            diffs.append(_difference(words, stored[key], given[key]))
            if key == "data_fingerprint" and any(d.startswith("max length differs") for d in diffs):
                diffs[-1] += " (at least in part because the max length differs: tokens are cut there)"
    return diffs


OPTIONS = {"storage": "--storage", "damping": "--damping", "basis": "--transcode"}
"""Parts of an identity section a build option sets: a difference there names the option first."""


def _difference(words: str, stored: Any, given: Any) -> str:
    """``words differs (index: ..., now: ...)``; in a section (a dict), the parts that differ, each named (a
    resume with another ``--storage`` named only the transcode section, never "storage"); the sections of
    :data:`OPTIONS` only (the layer set and the projection follow from them)."""
    if isinstance(stored, list | dict) and isinstance(given, type(stored)) and not set(stored) & set(OPTIONS):
        return f"{words} differs ({_members(stored, given)})"
    if not (isinstance(stored, dict) and isinstance(given, dict) and set(stored) & set(OPTIONS)):
        return f"{words} differs (index: {_short(stored)}, now: {_short(given)})"
    parts = [k for k in sorted(set(stored) | set(given)) if stored.get(k) != given.get(k)]
    named = ", ".join(f"{OPTIONS.get(k, k)} (index: {_short(stored.get(k))}, now: {_short(given.get(k))})"
                      for k in parts[:3])
    return f"{words} differs in {named}{' ...' if len(parts) > 3 else ''}"


def _members(stored: list | dict, given: list | dict) -> str:
    """What differs between two collections, members named: those only in the index, those only now, and (of a dict)
    those whose values differ; both in full where members are not names (a long pair cut at the same prefix showed
    no difference)."""
    try:
        a, b = {str(k): k for k in stored}, {str(k): k for k in given}
    except TypeError:  # (unhashable members: the two in full)
        return f"index: {_short(stored)}, now: {_short(given)}"
    parts = []
    only = (("only in the index", [k for k in a if k not in b]), ("only now", [k for k in b if k not in a]))
    for what, names in only:
        if names:
            parts.append(f"{what}: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}")
    if isinstance(stored, dict):
        changed = [k for k in a if k in b and stored[a[k]] != given[b[k]]]
        parts += [f"{k} (index: {_short(stored[a[k]])}, now: {_short(given[b[k]])})" for k in changed[:3]]
    if not parts:  # (the same members in another order)
        return f"the same members in another order; index: {_short(stored)}, now: {_short(given)}"
    return "; ".join(parts)


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 120 else s[:117] + "..."


def build_command(index_dir: str | os.PathLike, manifest: dict, extra: str = "--repair", index: bool = True) -> str:
    """The ``gradindex build`` command line that made this index (from its manifest: its rows as one ``--rows``
    spec, :func:`rows_of`), plus ``extra``. With ``index`` (the default) it ends with the index stage the index
    recorded (:func:`index_args`), so the index it leaves answers queries (with ``--no-index`` it did not: issue
    33 item 9); else ``--no-index``. For a part of a sharded index: the ``build --parts P --overwrite`` of the whole
    sharded index (a build into the part would capture the data set's first rows as the part's; ``--repair`` becomes
    ``--overwrite``), its ``--out`` the folder holding the part where that is the part's sharded index."""
    m = manifest
    if m.get(SHARD_KEY):
        part = m[SHARD_KEY]
        whole = {k: v for k, v in m.items() if k != SHARD_KEY}
        whole["counts"] = {**m.get("counts", {}), "examples": part["examples"]}
        rebuild = "--overwrite" if extra in ("--repair", "--overwrite") else extra
        return build_command(sharded_parent(index_dir) or "SHARDED_DIR", whole, f"--parts {part['parts']} {rebuild}",
                             index)
    c, proj = m.get("config", {}), m.get("build", {}).get("projection", {})
    args = ["gradindex", "build", m.get("model_id") or "MODEL_DIR", m.get("data_id") or "DATA",
            "--out", str(index_dir), "--rows", str(rows_of(m))]
    basis = basis_of(m)
    if basis.get("kind", "raw") == "kfac":
        args += ["--fit-examples", str(basis.get("examples", 0)), "--fit-seed", str(c.get("basis_seed", 0))]
    if proj.get("kind", "none") != "none":
        args += ["--projection-kind", proj["kind"]]
    args += ["--seed", str(proj.get("seed", 0))]
    for pattern in c.get("layers", []):
        args += ["--layers", pattern]
    if m.get("adapter_id") and m.get("adapter_id") != m.get("model_id"):
        args += ["--adapter", m["adapter_id"]]
    if m.get("build", {}).get("base_quantization"):
        args += ["--base-quantization", m["build"]["base_quantization"]]
    text_field = m.get("counts", {}).get("text_field")
    if text_field and text_field not in ("text", "input_ids", "prompt+completion", "messages"):
        args += ["--text-field", text_field]
    batch = c.get("batch_size", DEFAULT_BATCH_SIZE)
    args += ["--max-length", str(c.get("max_length", 512)), "--batch-size", str(batch),
             "--dtype", m.get("dtype", "float32"), "--route", c.get("route", "auto"),
             "--shard-size", str(c.get("shard_size", 4096))]
    precondition = c.get("precondition", "none")  # (the CLI's is auto)
    args += ["--precondition", precondition]
    if precondition != "none":
        args += ["--damping", str(c.get("damping", LEGACY_DAMPING))]
        if c.get("fisher", "empirical") != "empirical":
            args += ["--fisher", c["fisher"], "--fisher-seed", str(c.get("fisher_seed", 0))]
    args += [f"--{flag.replace('_', '-')}" for flag in ("collect_covariance", "full_factors", "rerank_fit")
             if c.get(flag)]
    sample = (m.get("transcode") or {}).get("fit_sample")  # (rows coded after a fit on a sample)
    every = int(m.get("counts", {}).get("examples", 0)) > c.get("fit_sample", 0)  # else: fitted on every example
    fit_sample = sample["size"] if sample else 0 if every else c.get("fit_sample", 0)
    if fit_sample != default("fit_sample"):
        args += ["--fit-sample", str(fit_sample)]
    if sample and c.get("sample_above"):  # (a sample chosen below the auto threshold: the disk's, or asked)
        args += ["--sample-above", str(c["sample_above"])]
    if sample and sample.get("seed") and c.get("fisher", "empirical") == "empirical":  # (the sample's seed)
        args += ["--fisher-seed", str(sample["seed"])]
    correction = int(c.get("rerank_correction", 0))  # (builds before it corrected on every example)
    if correction != default("rerank_correction"):
        args += ["--rerank-correction", str(correction)]
    if c.get("optimizer_state"):
        args += ["--optimizer-state", c["optimizer_state"]]
    return shlex.join(args + (index_args(m) if index else ["--no-index"])) + (f" {extra}" if extra else "")


def rows_of(m: dict[str, Any]) -> RowSpec:
    """The row spec of a manifest dict: its ``rows`` key, or (an index built before it) its build and config."""
    if m.get("rows"):
        return RowSpec.parse(m["rows"])
    c, b = m.get("config", {}), m.get("build", {})
    proj, basis, done = b.get("projection", {}), b.get("basis") or {}, m.get("transcode") or {}
    eigen = basis.get("space") == "full-eigen" or c.get("basis") == "eigen"
    if proj.get("kind") == "none" and not eigen:
        kw: dict[str, Any] = {"projection": "none"}
    elif proj.get("sizes") or eigen:
        kw = {"projection": "auto", "budget": str(c.get("budget") or "auto"),
              "allocation": c.get("allocation", "ratio")}
    else:
        kw = {"projection": "fixed", "k_a": int(proj.get("k_a", 0)), "k_g": int(proj.get("k_g", 0))}
    transcoded = bool(done) or str(c.get("transcode", "none")) == "ekfac"
    storage = (b.get("transcode") or {}).get("storage") or c.get("storage") or b.get("storage", "fp32")
    return RowSpec(**kw, basis="eigen" if eigen else "kfac" if basis.get("kind") == "kfac" else "raw",
                   basis_damping=float(c.get("basis_damping", (baked_damping(m) or 1.0) if not eigen else 1.0)),
                   adam=str(c.get("adam_mode", "exact")) if b.get("optimizer") else "", transcode=transcoded,
                   damping=float(done.get("damping") or c.get("damping", DEFAULT_DAMPING)), storage=storage)


def index_args(manifest: dict) -> list[str]:
    """The build options that make the index stage ``manifest`` recorded (none: the default one)."""
    ix = manifest.get("index") or {}
    factories = ix.get("factories") or []  # (one string: the tier's, as `store`, `sketch`, or a FAISS type's)
    args = ["--index-type", factories[0]] if len(factories) == 1 else []
    if ix.get("sketch_bytes"):  # (recorded by a sketch tier's build)
        args += ["--sketch-bytes", str(ix["sketch_bytes"])]
    space = ix.get("space") or {}
    if space.get("whiten", "none") != "none":
        args += ["--whiten", space["whiten"]]
    if space.get("normalize"):
        args += ["--normalize"]
    return args


def adam_rows(manifest: dict) -> bool:
    """Whether an index's rows are Adam-preconditioned (built with ``--optimizer-state``)."""
    return bool(manifest.get("build", {}).get("optimizer"))


def row_basis(manifest: dict) -> str:
    """The basis an index's stored rows are in (``raw``, ``kfac`` or ``ekfac``; :mod:`gradindex.store.basis`): the
    one reading of ``build.basis.kind``."""
    return str((manifest.get("build", {}).get("basis") or {}).get("kind", "raw"))


@dataclass(frozen=True)
class LayerShape:
    """One hooked layer in ``build.layers``."""

    kind: str
    """Module type (``Linear``, ``Conv1D``, ...)."""
    n_in: int
    """Input features ``N_i``."""
    n_out: int
    """Output features ``N_o``."""
    bias: bool
    rows: int
    """Rows of the stored matrix (``k_g``, or ``N_o`` unprojected)."""
    cols: int
    """Columns of the stored matrix (``k_a``, or ``N_i(+1)`` unprojected)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerShape:
        return cls(str(d["kind"]), int(d["n_in"]), int(d["n_out"]), bool(d.get("bias", False)), int(d["rows"]),
                   int(d["cols"]))  # (no "bias": a layer recorded without one has none)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "n_in": self.n_in, "n_out": self.n_out, "bias": self.bias,
                "rows": self.rows, "cols": self.cols}

    @property
    def dim(self) -> int:
        """Numbers per stored row of this layer."""
        return self.rows * self.cols


class _Captures(Protocol):
    infos: Mapping[str, Any]

    def dims(self, name: str) -> tuple[int, int]: ...


def layer_identity(capture: _Captures) -> dict[str, dict[str, Any]]:
    """``build.layers`` of a gradient capture: layer → :class:`LayerShape` as a dict, model order."""
    return {n: LayerShape(i.kind, i.n_in, i.n_out, i.bias, *capture.dims(n)).to_dict()
            for n, i in capture.infos.items()}


def new_manifest(status: str, model_id: str, data_id: str, build: dict[str, Any], config: dict[str, Any],
                 counts: dict[str, Any], chat_template: str | None = None, **sections: Any) -> dict[str, Any]:
    """A new ``manifest.json``: the one place one is made (the offline build's, the in-loop capture's). ``build``:
    the identity (``build_identity`` of :mod:`gradindex.store.builder`); ``sections``: the rest of what the maker
    records (``rows``, ``model_file``, ``training``, ...)."""
    return {
        "format_version": FORMAT_VERSION,
        "library_version": gradindex.__version__,
        "status": status,
        "model_id": model_id,
        "data_id": data_id,
        **({"chat_template": chat_template} if chat_template else {}),
        "build": build,
        "config": config,
        "dtype": build["dtype"],
        "counts": counts,
        **sections,
    }


class Manifest:
    """A parsed ``manifest.json`` (validated), with typed accessors; the dict itself is kept as is."""

    def __init__(self, data: dict[str, Any]):
        problem = shape_problem(data)
        if problem:
            raise ValueError(f"not a gradindex manifest ({problem})")
        self._data = data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        return cls(copy.deepcopy(dict(data)))

    @classmethod
    def read(cls, index_dir: str | os.PathLike) -> Manifest:
        """The manifest of ``index_dir`` (:func:`read_manifest`: its own copy, read once per process), for an
        entry point that takes a path; the stages below take it (or an open store) instead of re-reading."""
        return cls(read_manifest(index_dir))

    @classmethod
    def read_complete(cls, index_dir: str | os.PathLike, then: str) -> Manifest:
        """:meth:`read` of a finished build; an error saying how to finish it (before ``then``) otherwise."""
        m = cls.read(index_dir)
        if not m.complete:
            raise ValueError(
                f"the build of {str(index_dir)!r} is not complete (status {m.status!r}); "
                f"finish it with `{m.build_command(index_dir, extra='')}` (it resumes), then {then}"
            )
        return m

    @classmethod
    def of(cls, manifest: Manifest | dict[str, Any]) -> Manifest:
        """``manifest`` as is, or a manifest dict wrapped (not copied: it stays the caller's)."""
        return manifest if isinstance(manifest, Manifest) else cls(manifest)

    @property
    def data(self) -> dict[str, Any]:
        """The dict itself (not a copy): for a stage that records in it and writes it back."""
        return self._data

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key outside the ``build`` and ``config`` sections (``shard``, ``index``, ``compact``, ...)."""
        return self._data.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    # -- what the stages ask ----------------------------------------------------------------------
    @property
    def build(self) -> dict[str, Any]:
        return self._data["build"]

    @property
    def config(self) -> dict[str, Any]:
        return self._data.get("config", {})

    @property
    def status(self) -> str | None:
        return self._data.get("status")

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def layers(self) -> dict[str, LayerShape]:
        """Every stored layer, model order."""
        return {n: LayerShape.from_dict(v) for n, v in self.build["layers"].items()}

    @property
    def examples(self) -> int:
        return int(self._data.get("counts", {}).get("examples", 0))

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """layer → ``(rows, cols)`` of its stored matrix (``k_g, k_a`` or ``N_o, N_i+1``), model order."""
        return {n: (s.rows, s.cols) for n, s in self.layers.items()}

    @property
    def full_shapes(self) -> dict[str, tuple[int, int]]:
        """layer → ``(N_o, N_i + bias)``: its unprojected gradient's shape, model order."""
        return {n: (s.n_out, s.n_in + int(s.bias)) for n, s in self.layers.items()}

    model_id = property(lambda self: self._data.get("model_id"), doc="the model the index was built from")
    adapter_id = property(lambda self: self._data.get("adapter_id") or None, doc="the adapter it was built under")
    chat_template = property(lambda self: self._data.get("chat_template") or None, doc="the chat template recorded")
    dtype = property(lambda self: self._data.get("dtype", "float32"), doc="the model's dtype at build")
    generation = property(lambda self: self._data.get("generation"), doc="the build's id (a new build changes it)")
    transcoded = property(lambda self: self._data.get("transcode") or {}, doc="the in-place transcode's record")
    tokenizer = property(lambda self: self.build.get("tokenizer") or None, doc="the tokenizer's fingerprint")
    base_quantization = property(lambda self: self.build.get("base_quantization"), doc="the base's quantization")
    basis = property(lambda self: self.build.get("basis") or {}, doc="``build.basis`` (a dict; empty: raw rows)")
    projection = property(lambda self: self.build.get("projection", {}), doc="``build.projection`` (a dict)")
    max_length = property(lambda self: int(self.build["max_length"]), doc="the build's (and queries') max tokens")
    optimizer = property(lambda self: self.build.get("optimizer"), doc="the Adam record of Adam-preconditioned rows")
    optimizer_state = property(lambda self: self.config.get("optimizer_state", ""), doc="that Adam state's file")
    route = property(lambda self: self.config.get("route", "auto"), doc="the capture's route")
    shard_size = property(lambda self: int(self.config["shard_size"]), doc="examples per store file")
    storage = property(lambda self: str(self.build.get("storage", "fp32")), doc="the rows' codec")
    data_fingerprint = property(lambda self: self.build["data_fingerprint"])
    model_fingerprint = property(lambda self: self.build["model_fingerprint"])
    preconditioners = property(lambda self: self._data.get("preconditioners", {}), doc="each stored-space fit")
    full_space = property(lambda self: self._data.get("full_space", {}), doc="each full-space fit")

    basis_kind = property(lambda self: row_basis(self._data), doc="the rows' basis (:func:`row_basis`)")
    baked_damping = property(lambda self: baked_damping(self._data), doc="the rows' whitening (:func:`baked_damping`)")
    adam_rows = property(lambda self: adam_rows(self._data), doc="whether the rows are Adam-preconditioned")
    rows = property(lambda self: rows_of(self._data), doc="what a stored row holds (:func:`rows_of`)")

    @property
    def source_build(self) -> dict[str, Any]:
        """The ``build`` that made the stored rows: the transcode's source where the rows were rewritten in place
        after the build (a resume compares against it), else ``build``."""
        return self.transcoded["source_build"] if self.transcoded else self.build

    def identity(self) -> dict[str, Any]:
        """The ``build`` keys that must match for a resume or a query (:data:`IDENTITY_KEYS`)."""
        return {k: self.build[k] for k in IDENTITY_KEYS if k in self.build}

    def build_command(self, index_dir: str | os.PathLike, extra: str = "--repair") -> str:
        """The ``gradindex build`` command line that made this index, plus ``extra``."""
        return build_command(index_dir, self._data, extra)
