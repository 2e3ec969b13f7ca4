"""Every part of a sharded index read as one store: :class:`PartsStore` (a :class:`~gradindex.store.Store` over the
parts' shard files, by the whole index's rows) and :class:`OpenParts` (an :class:`~gradindex.store.opened.OpenStore`
over it, with the whole index's manifest and the parts' shared fits).

What reads the store as a whole (the audit's score sample and its duplicate search, the server's per-example
columns, an explanation's stored rows) takes these as it takes one index's: no part is copied, each part's files
are read where they lie (on a filesystem this process sees). A part's files hold ids shifted to start at 0
(:mod:`gradindex.index.sharded`); they are shifted back here, so ids are the whole index's rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from gradindex.checksum import Damage, DamagedIndexError, damage_error
from gradindex.spec.manifest import IndexMismatchError, Manifest
from gradindex.store import Store
from gradindex.store.opened import OpenStore

ID_COLUMN = "ids"


class PartsStore(Store):
    """The stores of every part of ``sharded`` (a :class:`~gradindex.index.sharded.Sharded`) as one read-only store:
    file ``k`` is the ``k``-th shard file in part order, rows are the whole index's. Each part's store gets its own
    check at open (every recorded file there, at its recorded size)."""

    def __init__(self, sharded):
        stores = [Store(p.dir) for p in sharded.parts]
        self.paths, self.first_ids, self.sizes, self._shift = [], [], [], []
        for p, s in zip(sharded.parts, stores, strict=True):
            if (s.storage, s.layers, s.dims) != (stores[0].storage, stores[0].layers, stores[0].dims):
                raise IndexMismatchError(f"{str(p.dir)!r} stores other rows ({s.storage}, {len(s.dims)} layers) than "
                                         f"{str(sharded.parts[0].dir)!r}; split the index again")
            if len(s) != p.n:
                raise IndexMismatchError(f"{str(p.dir)!r} holds {len(s)} rows, shards.json says {p.n}; split the "
                                         "index again")
            self.paths += s.paths
            self.first_ids += [p.first + f for f in s.first_ids]
            self.sizes += s.sizes
            self._shift += [p.first] * len(s.paths)
            s.close()
        self.dir = self._home_store = stores[0].dir  # (part 0's; the messages that name a file name its own part)
        self.storage, self.layers, self.dims = stores[0].storage, stores[0].layers, stores[0].dims
        self.n = int(sum(self.sizes))
        self._starts = np.cumsum([0] + self.sizes)
        self._files = OrderedDict()
        self._hashes = {}

    def damaged_error(self, path: Path, e: BaseException) -> DamagedIndexError:
        """The error of an unreadable shard file, naming its part (``gradindex verify PART`` checks it)."""
        part = path.parent.parent
        why = str(e).strip() or type(e).__name__
        return damage_error(part, [Damage(f"{path.parent.name}/{path.name}", f"unreadable: {why}",
                                          f"split the index again (`gradindex verify {part}` checks the part)")])

    def verify_gathered(self, bounds, local, name, codes, scales, expected) -> None:
        """:meth:`Store.verify_gathered <gradindex.store.Store.verify_gathered>` a file at a time, its damage named in
        its own part (its directory, ``store/shard-NNNNN.h5``)."""
        hashes, have = expected
        for k, a, b in bounds:
            self.dir = self.paths[k].parent  # (what Store's message names)
            try:
                super().verify_gathered([(k, 0, b - a)], local[a:b], name, codes[a:b],
                                        None if scales is None else scales[a:b], (hashes[a:b], have[a:b]))
            finally:
                self.dir = self._home_store

    def column(self, name: str) -> np.ndarray:
        """A per-example column over every part (``ids`` the whole index's rows)."""
        return np.concatenate([self._shifted(k, name, self._read(k, lambda f: f[name][:]))
                               for k in range(len(self.paths))])

    def shard_columns(self, k: int, names: Sequence[str], start: int, stop: int) -> dict[str, np.ndarray]:
        return {c: self._shifted(k, c, v) for c, v in super().shard_columns(k, names, start, stop).items()}

    def iter_blocks(self, layers: Sequence[str] | None = None, block: int = 4096, start: int = 0,
                    stop: int | None = None) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """:meth:`Store.iter_blocks <gradindex.store.Store.iter_blocks>`, ids the whole index's rows."""
        at = start  # (the blocks come in store order, contiguous from start: the file of each is where it starts)
        for ids, rows in super().iter_blocks(layers, block, start, stop):
            k = int(np.searchsorted(self._starts, at, side="right") - 1)
            yield ids + self._shift[k], rows
            at += len(ids)

    def _shifted(self, k: int, name: str, v: np.ndarray) -> np.ndarray:
        return v + self._shift[k] if name == ID_COLUMN else v


class OpenParts(OpenStore):
    """A sharded index opened as one :class:`~gradindex.store.opened.OpenStore`: the whole index's manifest, a
    :class:`PartsStore`, and part 0's directory for the fits and the basis (the same files in every part; the
    self-influence columns, cut per part, are not read through it). ``dir`` is part 0's; ``home`` the sharded
    directory."""

    def __init__(self, sharded):
        self.home, self.dir, self.manifest = sharded.dir, sharded.parts[0].dir, sharded.manifest
        self.parts = len(sharded.parts)
        self.described = Manifest(self.manifest)
        self.layers = list(self.described.layers)
        self.shapes = self.described.shapes
        self.store = PartsStore(sharded)
        self.n = len(self.store)
        self._rows = self._projection = self._basis = None
