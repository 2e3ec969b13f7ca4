"""An index directory opened once: its manifest, store, preconditioners and FAISS indices.

Everything that reads an index (the query engine, exact scores, self-influence, the index
builder) takes an :class:`OpenIndex` instead of a path, so ``manifest.json`` is read once per
open, each preconditioner file once, and the FAISS files once, not once per call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradindex.capture import ProjectionSpec
from gradindex.checksum import damage_error
from gradindex.index.load import IndexSet
from gradindex.index.rows import RowReader
from gradindex.index.space import Preconditioners
from gradindex.manifest import MANIFEST, IndexMismatchError, read_complete_manifest, read_manifest
from gradindex.methods import methods_of
from gradindex.precondition import Preconditioner, self_influence
from gradindex.precondition.preconditioner import layer_shapes, selected_layers
from gradindex.store import Store
from gradindex.store.basis import RowBasis, index_basis
from gradindex.store.repair import check_store


class OpenIndex:
    """One open index directory. ``manifest``: the directory's, when the caller already holds it.

    The build must be complete (else an error says how to finish it before ``then``).
    """

    def __init__(self, index_dir: str | os.PathLike, manifest: dict | None = None, then: str = "query it"):
        self.dir = Path(index_dir)
        if manifest is None:
            manifest = read_complete_manifest(index_dir, then)
        elif manifest.get("status") != "complete":
            read_complete_manifest(index_dir, then)  # the same error, from the file itself
        damage = check_store(index_dir, full=False, manifest=manifest)  # the cheap sampled check
        if damage:
            raise damage_error(index_dir, damage, then=then)
        self.manifest = manifest
        self._stamp = _stamp(self.dir)
        self.layers: list[str] = list(manifest["build"]["layers"])
        """Every stored layer, model order."""
        self.shapes = layer_shapes(manifest)
        self.store = Store(index_dir)
        self.n = len(self.store)
        self.pre = Preconditioners(index_dir, manifest)
        self.indices: IndexSet | None = None
        self._rows: RowReader | None = None
        self._projection: ProjectionSpec | None = None
        self._basis: RowBasis | None = None
        self._self_influence: dict[tuple, np.ndarray] = {}

    # -- parts, each made once ------------------------------------------------------------------
    @property
    def projection(self) -> ProjectionSpec:
        """The projection the store was built with (decoded once)."""
        if self._projection is None:
            self._projection = ProjectionSpec.from_dict(self.manifest["build"]["projection"])
        return self._projection

    @property
    def basis(self) -> RowBasis:
        """The basis the stored rows are in (``basis.h5``, read once; empty for raw rows)."""
        if self._basis is None:
            self._basis = index_basis(self.dir, self.manifest)
        return self._basis

    @property
    def rows(self) -> RowReader:
        """Random reads of stored rows over every layer."""
        if self._rows is None:
            self._rows = RowReader(self.store, self.layers)
        return self._rows

    def load_indices(self, layers: Sequence[str] | None = None, use_gpu: bool = True) -> IndexSet:
        """The FAISS indices of ``layers`` (default: all), checked against the store; loaded once
        (again only when layers not loaded yet are asked for)."""
        want = set(layers or self.layers)
        if self.indices is None or not want <= set(self.indices.layers):
            self.indices = IndexSet(self.dir, self.manifest, self.n, layers, use_gpu, self.rows)
        return self.indices

    def methods(self, selfnorm: bool = False) -> list[str]:
        """Methods this index answers (with ``selfnorm``, the ``-selfnorm`` variants too)."""
        return methods_of(self.manifest, self.dir, selfnorm)

    def preconditioner(self, base: str) -> Preconditioner:
        """A base method's preconditioner, loaded once (identity for graddot/cosine)."""
        return self.pre.get(base)

    def selected_layers(self, layers: Sequence[str] | None) -> list[str]:
        """``layers`` checked against the index's (all of them when empty), model order."""
        return selected_layers(self.manifest, layers)

    def self_influence(self, base: str, damping: float, layers: Sequence[str]) -> np.ndarray:
        """``[N]`` self-influence under a base method, computed or read once per setting."""
        key = (base, float(damping), tuple(layers))
        if key not in self._self_influence:
            P = None if base == "cosine" else self.preconditioner(base)
            self._self_influence[key] = self_influence(self.dir, base, damping, list(layers),
                                                       manifest=self.manifest, preconditioner=P)
        return self._self_influence[key]

    def check_current(self) -> None:
        """Refuse to answer from an index that a new build replaced (or removed) since it was opened.

        A stat of ``manifest.json`` per call; when it changed, the manifest is read again: another
        ``generation`` (``build --overwrite``, a transcode) or a build in progress is refused, an
        update of the same build (the index stage, a fit) is not.
        """
        now = _stamp(self.dir)
        if now == self._stamp:
            return
        fix = ("reopen it (a QueryEngine: open a new one; `gradindex serve`: restart it) to answer from the new "
               "index")
        try:
            m = read_manifest(self.dir)
        except (FileNotFoundError, ValueError):
            raise IndexReplacedError(f"the index in {str(self.dir)!r} was removed or is being rebuilt since it was "
                                     f"opened; {fix} once its build finishes") from None
        if m.get("generation") != self.manifest.get("generation") or m.get("status") != "complete":
            state = "replaced by a new build" if m.get("status") == "complete" else "is being rebuilt"
            raise IndexReplacedError(f"the index in {str(self.dir)!r} was {state} since it was opened (generation "
                                     f"{self.manifest.get('generation')} → {m.get('generation')}): its answers "
                                     f"would come from the deleted index; {fix}")
        self._stamp = now

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> OpenIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class IndexReplacedError(IndexMismatchError):
    """The index directory holds another build than the one an open index read."""


def _stamp(d: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(d / MANIFEST)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def open_index(index: str | os.PathLike | OpenIndex, then: str = "query it") -> tuple[OpenIndex, bool]:
    """``(OpenIndex, opened_here)``: an open index as is, or a path opened (the caller closes it)."""
    if isinstance(index, OpenIndex):
        return index, False
    return OpenIndex(index, then=then), True
