"""``precond/<method>.h5``: fitted factors, eigenbases, eigenvalues, self-influence, fingerprints.

Layout (one file per method; ``graddot.h5`` holds only the self-influence columns)::

    attrs   method, format_version, library_version, damping (of the self-influence), fit (JSON:
            source, examples, tokens, fit-set fingerprint), fp_<key> (JSON of the manifest's build.<key>
            for model_fingerprint, data_fingerprint, projection, layers), layer_names (JSON list)
    layers/<layer>/  A [k_a,k_a], S [k_g,k_g]      token-mean factors (float64; not in full-space files,
                                                   whose arrays are float32: ``Q diag(λ) Qᵀ`` of the two below)
                     lambda_A [k_a], Q_A [k_a,k_a]  eigenvalues (ascending) and eigenvectors of A
                     lambda_S [k_g], Q_S [k_g,k_g]  same for S
                     Lambda [k_g,k_a]               eigenvalues used: λ_S λ_Aᵀ (kfac) or Λ* (ekfac)
                     attrs tokens, examples, rows (k_g), cols (k_a)
    self_influence [N]            (not in full-space files) Σ_layers ⟨(H + δI)⁻¹ Ĝ_n, Ĝ_n⟩ at attr ``damping`` (float64)
    self_influence_layers [N, L]  the same per layer, columns in ``layer_names`` order

Files are written to ``.h5.tmp``, hashed into ``checksums.json`` (:mod:`gradindex.checksum`) and
renamed, so a killed fit leaves the previous file intact. Every read checks the whole-file hash
first (:func:`check_fingerprints`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

import gradindex
from gradindex.checksum import Damage, check_files, damage_error, record
from gradindex.methods import LEGACY_DAMPING
from gradindex.spec import layout
from gradindex.spec.manifest import IndexMismatchError, Manifest

PRECOND_DIR = layout.PRECOND_DIR
FORMAT_VERSION = 1
FINGERPRINT_KEYS = {
    "model_fingerprint": "model",
    "data_fingerprint": "data set",
    "projection": "projection",
    "layers": "layer set",
}


def precond_path(index_dir: str | os.PathLike, method: str) -> Path:
    return layout.IndexLayout.of(index_dir).precond_file(method)


def fingerprints(manifest: dict) -> dict[str, str]:
    """What a preconditioner was fitted on, as JSON strings of ``manifest['build']`` entries."""
    b = Manifest(manifest).build
    return {k: json.dumps(b.get(k), sort_keys=True) for k in FINGERPRINT_KEYS}


@dataclass
class LayerFactors:
    """One layer's fitted curvature (float64)."""

    A: np.ndarray
    S: np.ndarray
    lambda_A: np.ndarray
    Q_A: np.ndarray
    lambda_S: np.ndarray
    Q_S: np.ndarray
    Lambda: np.ndarray
    tokens: int
    examples: int


@dataclass
class SelfInfluenceBlocks:
    """``[N, L]`` self-influence handed to :func:`write_precond` as blocks of rows (``blocks()`` yields
    ``(first_row, [n, L])``), not as one array: a sampled build's N rows per method, one shard at a time."""

    shape: tuple[int, int]
    blocks: Callable[[], Iterator[tuple[int, np.ndarray]]]


def write_precond(
    path: Path,
    method: str,
    manifest: dict,
    layer_names: list[str],
    factors: dict[str, LayerFactors] | None,
    self_influence: np.ndarray | SelfInfluenceBlocks | None,
    damping: float,
    fit: dict,
    keys: tuple[str, ...] = ("A", "S", "lambda_A", "Q_A", "lambda_S", "Q_S", "Lambda"),
    dtype: type = np.float64,
    attrs: dict | None = None,
) -> None:
    """Write one method's file atomically. ``self_influence`` ``[N, L]`` per layer (full-space fits: none);
    ``keys``: the :class:`LayerFactors` arrays written per layer (full-space fits: all but ``A`` and ``S``),
    as ``dtype`` (full-space fits: float32, what their queries compute in); ``attrs``: more file attributes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["method"] = method
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["library_version"] = gradindex.__version__
        f.attrs["damping"] = float(damping)
        f.attrs["fit"] = json.dumps(fit, sort_keys=True)
        f.attrs["layer_names"] = json.dumps(layer_names)
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        for k, v in fingerprints(manifest).items():
            f.attrs[f"fp_{k}"] = v
        if factors is not None:
            g = f.create_group("layers")
            for n in layer_names:
                lf = factors[n]
                grp = g.create_group(n)
                for key in keys:
                    grp[key] = np.asarray(getattr(lf, key), dtype=dtype)
                grp.attrs["tokens"] = int(lf.tokens)
                grp.attrs["examples"] = int(lf.examples)
                grp.attrs["rows"], grp.attrs["cols"] = lf.Lambda.shape
        if isinstance(self_influence, SelfInfluenceBlocks):  # written a block at a time: memory flat in N
            layers_ds = f.create_dataset("self_influence_layers", self_influence.shape, np.float64)
            total_ds = f.create_dataset("self_influence", self_influence.shape[:1], np.float64)
            for s, block in self_influence.blocks():
                block = np.asarray(block, dtype=np.float64)
                layers_ds[s:s + len(block)] = block
                total_ds[s:s + len(block)] = block.sum(axis=1)
        elif self_influence is not None:
            f["self_influence_layers"] = np.asarray(self_influence, dtype=np.float64)
            f["self_influence"] = np.asarray(self_influence, dtype=np.float64).sum(axis=1)
    record(path.parent.parent, [tmp], [f"{PRECOND_DIR}/{path.name}"])
    os.replace(tmp, path)


def refit_command(index_dir: str | os.PathLike, manifest: dict, name: str) -> str:
    """The command that rewrites ``precond/<name>.h5`` (an EK-FAC fit rewrites all three files)."""
    if name.endswith("-full"):  # full-space curvature (gradindex.precondition.fullspace)
        method = "ekfac" if "ekfac" in manifest.get("full_space", {}) else name.removesuffix("-full")
        return f"gradindex precondition {index_dir} --method {method} --space full"
    fitted = manifest.get("preconditioners", {})
    method = name if name in fitted else ("ekfac" if "ekfac" in fitted else "kfac")
    damping = fitted.get(method, {}).get("damping", LEGACY_DAMPING)
    return f"gradindex precondition {index_dir} --method {method} --damping {damping}"


def check_precond(index_dir: str | os.PathLike, manifest: dict, full: bool = True) -> list[Damage]:
    """Damaged or missing preconditioner files (those recorded in ``checksums.json``)."""
    d = Path(index_dir)
    out = []
    for p in sorted({*d.glob(f"{PRECOND_DIR}/*.h5"), *(d / PRECOND_DIR / f"{m}.h5" for m in
                                                      manifest.get("preconditioners", {}))}):
        out += check_files(d, [f"{PRECOND_DIR}/{p.name}"], full, refit_command(d, manifest, p.stem))
    return out


def check_fingerprints(path: Path, manifest: dict, method: str) -> None:
    """Refuse a damaged file, or one fitted on another model, data set, projection or layer set."""
    index_dir = path.parent.parent
    damage = check_files(index_dir, [f"{PRECOND_DIR}/{path.name}"], True,
                         refit_command(index_dir, manifest, path.stem))
    if damage:
        raise damage_error(index_dir, damage)
    attrs = read_attrs(path)
    now = fingerprints(manifest)
    diffs = [words for k, words in FINGERPRINT_KEYS.items() if attrs.get(f"fp_{k}") != now[k]]
    if diffs:
        raise IndexMismatchError(
            f"{str(path)!r} was fitted on another {', '.join(diffs)} than this index's store; refit it "
            f"with `gradindex precondition {path.parent.parent} --method {method}"
            f"{' --space full' if path.stem.endswith('-full') else ''}`"
        )


def read_attrs(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return dict(f.attrs)


def read_layers(
    path: Path, keys: tuple[str, ...] = ("Q_S", "Q_A", "Lambda")
) -> dict[str, dict[str, np.ndarray]]:
    """layer → {key: array} for the given dataset keys."""
    with h5py.File(path, "r") as f:
        names = json.loads(f.attrs["layer_names"])
        return {n: {k: f["layers"][n][k][:] for k in keys} for n in names}


def read_layer(path: Path, layer: str, keys: tuple[str, ...] = ("Q_S", "Q_A", "Lambda")) -> dict[str, np.ndarray]:
    """{key: array} of one layer (the file opened for it alone: a streamed full-space fit reads a layer at a time)."""
    with h5py.File(path, "r") as f:
        return {k: f["layers"][layer][k][:] for k in keys}


def layer_names(path: Path) -> list[str]:
    """The layers a fit's file covers, in its order."""
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["layer_names"])


def read_factors(path: Path) -> dict[str, LayerFactors]:
    """layer → the :class:`LayerFactors` of a stored-space fit's file (what :func:`write_precond` wrote)."""
    with h5py.File(path, "r") as f:
        return {n: LayerFactors(**{k: g[k][:] for k in ("A", "S", "lambda_A", "Q_A", "lambda_S", "Q_S", "Lambda")},
                                tokens=int(g.attrs["tokens"]), examples=int(g.attrs["examples"]))
                for n, g in ((n, f["layers"][n]) for n in json.loads(f.attrs["layer_names"]))}


def read_self_influence(path: Path) -> tuple[float, list[str], np.ndarray]:
    """``(damping, layer_names, [N, L] per-layer self-influence)``."""
    with h5py.File(path, "r") as f:
        return float(f.attrs["damping"]), json.loads(f.attrs["layer_names"]), f["self_influence_layers"][:]
