"""An index directory opened once: its manifest, store, preconditioners and FAISS indices.

Everything that reads an index (the query engine, exact scores, self-influence, the index
builder) takes an :class:`OpenIndex` instead of a path, so ``manifest.json`` is read once per
open, each preconditioner file once, and the FAISS files once, not once per call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from gradindex.index.load import IndexSet
from gradindex.index.space import Preconditioners
from gradindex.methods import methods_of
from gradindex.precondition import Preconditioner, self_influence
from gradindex.precondition.preconditioner import selected_layers
from gradindex.spec.manifest import IndexMismatchError, Manifest, manifest_stamp
from gradindex.store.opened import OpenStore


class OpenIndex(OpenStore):
    """One open index directory: the store's floor (:class:`gradindex.store.opened.OpenStore`: manifest,
    store, basis, shapes, rows) plus its preconditioners and FAISS indices. ``manifest``: the directory's,
    when the caller already holds it. The build must be complete (else an error says how to finish it
    before ``then``).
    """

    def __init__(self, index_dir: str | os.PathLike, manifest: dict | None = None, then: str = "query it"):
        super().__init__(index_dir, manifest, then)
        self._stamp = manifest_stamp(self.dir)
        self.pre = Preconditioners(self)
        self.indices: IndexSet | None = None
        self._self_influence: dict[tuple, np.ndarray] = {}

    # -- parts, each made once ------------------------------------------------------------------
    def load_indices(self, layers: Sequence[str] | None = None, use_gpu: bool = True) -> IndexSet:
        """The FAISS indices of ``layers`` (default: all), checked against the store; loaded once
        (again only when layers not loaded yet are asked for)."""
        want = set(layers or self.layers)
        if self.indices is None or not want <= set(self.indices.layers):
            self.indices = IndexSet(self, layers, use_gpu)
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
            self._self_influence[key] = self_influence(self, base, damping, list(layers), preconditioner=P)
        return self._self_influence[key]

    def check_current(self) -> None:
        """Refuse to answer from an index that a new build replaced (or removed) since it was opened.

        A stat of ``manifest.json`` per call; when it changed, the manifest is read again: another
        ``generation`` (``build --overwrite``, a transcode) or a build in progress is refused, an
        update of the same build (the index stage, a fit) is not.
        """
        now = manifest_stamp(self.dir)
        if now == self._stamp:
            return
        fix = ("reopen it (a QueryEngine: open a new one; `gradindex serve`: restart it) to answer from the new "
               "index")
        try:
            m = Manifest.read(self.dir)
        except (FileNotFoundError, ValueError):
            raise IndexReplacedError(f"the index in {str(self.dir)!r} was removed or is being rebuilt since it was "
                                     f"opened; {fix} once its build finishes") from None
        if m.generation != self.described.generation or not m.complete:
            state = "replaced by a new build" if m.complete else "is being rebuilt"
            raise IndexReplacedError(f"the index in {str(self.dir)!r} was {state} since it was opened (generation "
                                     f"{self.described.generation} → {m.generation}): its answers "
                                     f"would come from the deleted index; {fix}")
        self._stamp = now


class IndexReplacedError(IndexMismatchError):
    """The index directory holds another build than the one an open index read."""


def open_index(index: str | os.PathLike | OpenIndex, then: str = "query it") -> tuple[OpenIndex, bool]:
    """``(OpenIndex, opened_here)``: an open index as is, or a path opened (the caller closes it)."""
    if isinstance(index, OpenIndex):
        return index, False
    return OpenIndex(index, then=then), True
