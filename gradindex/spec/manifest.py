"""The typed view of ``manifest.json`` (its file is read and written by :mod:`gradindex.manifest`).

A manifest is JSON with these sections (docs/formats.md lists every key):

* ``build``: the identity of the stored rows — what must match for a resume or a query
  (:data:`gradindex.manifest.IDENTITY_KEYS`), ``layers`` among them (:class:`LayerShape` per layer);
* ``config``: the build's options as given (``build_command`` regenerates the command line from it);
* ``counts``, ``preconditioners``, ``status``, ``model_id``, ``data_id``, ``dtype`` and more.

:class:`Manifest` wraps the parsed dict without changing it (``Manifest.from_dict(d).to_dict() == d``,
so old indices open as they are) and names what the stages ask of it. :func:`layer_identity` is
the one place a manifest's ``build.layers`` is made (by the build, the live capture, and the query
engine's check that a model fits an index).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import gradindex
from gradindex.manifest import (  # noqa: F401  (rows_of: re-exported)
    FORMAT_VERSION,
    IDENTITY_KEYS,
    baked_damping,
    build_command,
    rows_of,
    shape_problem,
    write_manifest,
)
from gradindex.methods import adam_rows, row_basis
from gradindex.spec.rows import RowSpec


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
        return cls(str(d["kind"]), int(d["n_in"]), int(d["n_out"]), bool(d["bias"]), int(d["rows"]), int(d["cols"]))

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

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    def write(self, index_dir: str | os.PathLike) -> None:
        write_manifest(index_dir, self._data)

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

    @property
    def basis_kind(self) -> str:
        """The basis the stored rows are in (``raw``, ``kfac`` or ``ekfac``: :func:`gradindex.methods.row_basis`)."""
        return row_basis(self._data)

    @property
    def baked_damping(self) -> float | None:
        """The damping the rows are whitened at, fixed at build (:func:`gradindex.manifest.baked_damping`)."""
        return baked_damping(self._data)

    @property
    def adam_rows(self) -> bool:
        """Whether the rows are Adam-preconditioned (built with ``--optimizer-state``)."""
        return adam_rows(self._data)

    @property
    def rows(self) -> RowSpec:
        """What a stored row holds (:mod:`gradindex.spec.rows`): the spec the build recorded, or the one an
        index built before the specs existed was made with (from its build and config)."""
        return rows_of(self._data)

    def identity(self) -> dict[str, Any]:
        """The ``build`` keys that must match for a resume or a query (:data:`IDENTITY_KEYS`)."""
        return {k: self.build[k] for k in IDENTITY_KEYS if k in self.build}

    def build_command(self, index_dir: str | os.PathLike, extra: str = "--repair") -> str:
        """The ``gradindex build`` command line that made this index, plus ``extra``."""
        return build_command(index_dir, self._data, extra)
