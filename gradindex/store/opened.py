"""An index directory opened at the store's floor: its manifest (read once), store, row basis, layer shapes,
row spec and fast row reader.

The stages above the store (precondition, apps) take an :class:`OpenStore` instead of a path, so that
nothing re-reads ``manifest.json`` or the basis; :class:`gradindex.index.OpenIndex` is built on it
(adding the preconditioners and FAISS indices a query needs).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gradindex.capture import ProjectionSpec
from gradindex.checksum import damage_error
from gradindex.spec.manifest import Manifest
from gradindex.spec.rows import RowSpec
from gradindex.store.basis import RowBasis, index_basis
from gradindex.store.repair import check_store
from gradindex.store.rows import RowReader
from gradindex.store.shards import Store


class OpenStore:
    """One open index directory. ``manifest``: the directory's, when the caller already holds it (kept as is:
    a stage that records in it, a fit, updates the caller's dict).

    The build must be complete (else an error says how to finish it before ``then``); the store gets its
    cheap sampled hash check (``full``: the whole-file hashes, as a fit checks them).
    """

    def __init__(self, index_dir: str | os.PathLike, manifest: dict | None = None, then: str = "read it",
                 full: bool = False):
        self.dir = Path(index_dir)
        if manifest is None or manifest.get("status") != "complete":  # (a held one: the same error, from the file)
            described = Manifest.read_complete(index_dir, then)
        if manifest is None:
            manifest = described.data
        damage = check_store(index_dir, full=full, manifest=manifest)
        if damage:
            raise damage_error(index_dir, damage, then=then)
        self.manifest = manifest
        self.described = Manifest(manifest)
        """The typed view of the manifest (:class:`gradindex.spec.manifest.Manifest`)."""
        self.layers: list[str] = list(self.described.layers)
        """Every stored layer, model order."""
        self.shapes: dict[str, tuple[int, int]] = self.described.shapes
        """layer → ``(rows, cols)`` of its stored matrix."""
        self.store = Store(index_dir)
        self.n = len(self.store)
        self._rows: RowReader | None = None
        self._projection: ProjectionSpec | None = None
        self._basis: RowBasis | None = None

    @property
    def spec(self) -> RowSpec:
        """What a stored row holds (the manifest's row spec)."""
        return self.described.rows

    @property
    def projection(self) -> ProjectionSpec:
        """The projection the store was built with (decoded once)."""
        if self._projection is None:
            self._projection = ProjectionSpec.from_dict(self.described.projection)
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

    def close(self) -> None:
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Description:
    """An index directory known by its manifest alone, for the questions the manifest and the files beside it
    answer (which methods, which full-space fits): :class:`OpenStore`'s ``dir``, ``manifest`` and ``described``
    with no store opened, no hash check, and no complete build required (an interrupted index still lists them)."""

    dir: Path
    manifest: dict

    @property
    def described(self) -> Manifest:
        return Manifest(self.manifest)


def description(index: str | os.PathLike | OpenStore) -> OpenStore | Description:
    """An open store (or index) as is; a path, as its ``manifest.json`` alone (:class:`Description`)."""
    return index if isinstance(index, OpenStore) else Description(Path(index), Manifest.read(index).data)


@contextmanager
def opened(index: str | os.PathLike | OpenStore, then: str = "read it", kind: type[OpenStore] = OpenStore):
    """``with opened(index) as ix``: an open store of ``kind`` (an :class:`OpenStore`, or a subclass such as
    :class:`~gradindex.index.OpenIndex`) as is, its owner closing it; or a path opened as ``kind`` for the block
    and closed after it. ``then``: what the caller is about to do, for the error of an incomplete build."""
    if isinstance(index, kind):
        yield index
        return
    with kind(index, then=then) as ix:
        yield ix
