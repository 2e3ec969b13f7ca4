"""Queries over a sharded index (:mod:`gradindex.index.sharded`): in one process, or one run of parts per
``torchrun`` rank.

Rank 0 (or the one process) holds the model: it computes each batch's query rows once, as
:class:`~gradindex.query.QueryEngine` does, and broadcasts them with the search's settings; every rank maps them
into its parts' space (the parts share the whole index's fits, so the same vectors), searches each of its parts
(its tier, then the exact re-rank from its own stored rows), shifts the ids to the whole index's rows and keeps
its best ``k``; one gather brings every rank's best to rank 0, which keeps the best ``k`` of those (ties by id, as
one index ranks them) and attaches the texts. The exact (full-space) stage, refinement and texts run on rank 0 as
for one index, on the merged results. Without ``torchrun`` the one process searches every part in turn.

A rank that fails answers its error to rank 0, which raises it; rank 0 always ends the run with a ``None``
broadcast, on which the other ranks return (:func:`~gradindex.query.ranks.follow`). A rank that dies or stalls is
named by rank 0 within the run's timeout (:mod:`gradindex.query.ranks`).

Each rank reads only its own parts (and ``shards.json``, which must be rank 0's), so under ``torchrun`` a part need
only be on its own rank's host: the texts' token hashes and the server's per-example columns of another rank's
rows come from that rank (:meth:`PartSearch.column_rows`). What reads the whole store on rank 0 (an explanation's
stored rows, the audit's score sample, outliers and duplicates) reads every part through
:class:`~gradindex.index.parts.PartsStore` (:attr:`ShardedQueryEngine.store`, :attr:`ShardedQueryEngine.whole`,
opened on first use), and so needs every part on rank 0's filesystem; the self-influence of the outliers is each
part's, computed by the rank that holds it (:meth:`ShardedQueryEngine.self_influence`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from gradindex import distributed
from gradindex.index import OpenIndex
from gradindex.index.cost import sketch_candidates
from gradindex.index.parts import OpenParts
from gradindex.index.sharded import SHARDS_FILE, Sharded, is_sharded, owned_parts, read_sharded
from gradindex.methods import DEFAULT_DAMPING
from gradindex.precondition import self_influence
from gradindex.query.engine import QueryEngine, QueryResult
from gradindex.query.ranks import ask, follow, lost, stop_followers
from gradindex.query.search import clamp_k
from gradindex.query.texts import TrainingTexts
from gradindex.spec.layout import STORE_DIR
from gradindex.spec.manifest import IndexMismatchError
from gradindex.store import Store

__all__ = ["PartSearch", "ShardedQueryEngine", "follow", "open_engine", "part_candidates", "serve_parts",
           "stop_followers"]

SHARE_Z = 3.0
"""Standard deviations of margin in a part's share of the candidates (:func:`part_candidates`)."""
SHARE_RUN = 16
"""The variance factor of a part's count of the unsplit first stage's top ``C`` over a binomial's: rows come in runs
of similar rows (a document's windows are stored one after another), so a query's nearest rows fall in a part a run
at a time (measured: 18 on the 40 queries of 10^5 real rows split in 2, docs/scaling.md)."""


def part_candidates(c: int, n_part: int, n: int, want: int) -> int:
    """A part's share of the whole index's ``c`` candidates (the sketch tiers' exact re-rank).

    The part holds ``f = n_part / n`` of the rows, so of the ``c`` rows the unsplit first stage would hand on it holds
    ``c·f`` on average. Were the rows in an order unrelated to the query the count would be binomial, spread
    ``√(c·f·(1−f))``; they come in runs of similar rows, which multiplies the variance by :data:`SHARE_RUN`. The part
    takes ``⌈c·f + SHARE_Z·√(SHARE_RUN·c·f·(1−f))⌉``, at least ``want`` (the ``k`` and ``lowest`` asked) and at most its
    rows: 385 a part for 2 parts of ``c`` = 500, 242 for 4 (docs/scaling.md)."""
    f = n_part / n
    share = math.ceil(c * f + SHARE_Z * math.sqrt(SHARE_RUN * c * f * (1 - f)))
    return int(min(n_part, max(want, share)))


class PartSearch:
    """The parts of a sharded index one process answers for, each opened search-only (``opened``: parts already
    open, by number, shared and not closed here)."""

    def __init__(self, sharded: Sharded, owned: Sequence[int], layers: Sequence[str] | None = None,
                 use_gpu: bool = True, opened: dict[int, OpenIndex] | None = None):
        self.parts = [sharded.parts[j] for j in owned]
        self.examples = sharded.examples
        self.engines: list[QueryEngine] = []
        self.where = sharded.dir / SHARDS_FILE
        self.digest = hashlib.sha256(self.where.read_bytes()).hexdigest()
        """This host's :data:`SHARDS_FILE`, hashed: every rank's must be rank 0's (:meth:`hello`)."""
        try:
            for j in owned:
                ix = (opened or {}).get(j, sharded.parts[j].dir)
                self.engines.append(QueryEngine(ix, load_model=False, layers=layers, use_gpu=use_gpu))
        except BaseException:
            self.close()
            raise

    def run(self, op: str, kw: dict):
        return getattr(self, op)(**kw)

    def search(self, grads: Mapping[str, np.ndarray], k: int, lowest: int = 0, candidates: int | None = None,
               share: bool = True, **kw) -> list[QueryResult]:
        """Each query's best ``k`` (and lowest ``lowest``) over these parts, ids in the whole index's rows.
        ``candidates``: the whole index's ``C``; with ``share``, a part with a sketch tier re-ranks its share of it
        (:func:`part_candidates`), else each part takes ``candidates`` (or its own default) whole."""
        out = None
        for part, eng in zip(self.parts, self.engines, strict=True):
            c = candidates
            if share and eng.indices.sketch is not None:
                c = part_candidates(candidates or sketch_candidates(self.examples), eng.n, self.examples,
                                    max(k, lowest))
            res = eng.search(grads, k=min(k, eng.n), lowest=min(lowest, eng.n), texts=False, candidates=c, **kw)
            for r in res:
                for h in r.hits + r.lowest:
                    h.id += part.first
            out = res if out is None else merge(out, res, k, lowest)
        return out

    def hello(self, digest: str) -> None:
        """Refuse a run whose ranks read different sharded indices (rank 0's :data:`SHARDS_FILE` hashes to
        ``digest``): each host may hold its own copy of the index's directory, with its own parts in it."""
        if digest != self.digest:
            raise IndexMismatchError(f"rank {distributed.rank()}'s {str(self.where)!r} is not rank 0's: every host's "
                                     f"copy of the sharded index must hold the same {SHARDS_FILE} (copy rank 0's, or "
                                     "split the index again and give each host its parts)")

    def ping(self) -> None:
        """Answer (:meth:`ShardedQueryEngine.probe_ranks`)."""

    def column_rows(self, names: Sequence[str], ids: np.ndarray) -> dict[str, dict[int, np.ndarray]]:
        """Per-example columns ``names`` of those rows ``ids`` (the whole index's) these parts hold, by name, then
        id."""
        ids = np.asarray(ids, dtype=np.int64)
        out: dict[str, dict[int, np.ndarray]] = {n: {} for n in names}
        for part, eng in zip(self.parts, self.engines, strict=True):
            mine = ids[(ids >= part.first) & (ids < part.stop)]
            if len(mine):
                for n, col in eng.example_columns(tuple(names), mine - part.first).items():
                    out[n].update(zip(mine.tolist(), col, strict=True))
        return out

    def scores(self, grads: Mapping[str, np.ndarray], **kw) -> np.ndarray:
        """``[Q, n]`` exact scores against these parts' rows, in row order."""
        return np.concatenate([eng.scores(grads, **kw) for eng in self.engines], axis=1)

    def self_influence(self, base: str, damping: float, layers: Sequence[str]) -> np.ndarray:
        """``[n]`` self-influence of these parts' rows under a base method (each part's own column of the fit,
        else computed from its rows), in row order."""
        return np.concatenate([self_influence(eng.index, base, damping, list(layers)) for eng in self.engines])

    def close(self) -> None:
        for eng in self.engines:
            eng.close()


def merge(a: list[QueryResult], b: list[QueryResult], k: int, lowest: int) -> list[QueryResult]:
    """Per query, the best ``k`` and lowest ``lowest`` of two answers over disjoint rows (ranked as one index's
    re-rank ranks them: by score, then by id); notes joined, seconds added."""
    out = []
    for x, y in zip(a, b, strict=True):
        x.hits = sorted(x.hits + y.hits, key=lambda h: (-h.score, h.id))[:k]
        x.lowest = sorted(x.lowest + y.lowest, key=lambda h: (h.score, h.id))[:lowest]
        x.notes = list(dict.fromkeys(x.notes + y.notes))
        x.seconds = {n: x.seconds.get(n, 0.0) + y.seconds.get(n, 0.0) for n in {**x.seconds, **y.seconds}}
        out.append(x)
    return out


def read_own(index: str | os.PathLike, rank: tuple[int, int] | None) -> Sharded:
    """:func:`read_sharded` of the parts ``rank`` (``(rank, ranks)`` under ``torchrun``) answers for; a part it cannot
    read is named with the rank, the parts it needs and where it looked (a host of its own may lack them)."""
    try:
        return read_sharded(index, rank)
    except (FileNotFoundError, IndexMismatchError, ValueError) as e:
        if rank is None or not (Path(index) / SHARDS_FILE).is_file():
            raise
        try:
            names = [p["dir"] for p in json.loads((Path(index) / SHARDS_FILE).read_text())["parts"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise e from None
        r, w = rank
        mine = [names[j] for j in owned_parts(len(names), r, w)]
        raise type(e)(f"rank {r} of {w} answers for {', '.join(mine)} of {str(index)!r} (as read on its host, in "
                      f"{os.getcwd()!r}): {e}; a rank's host needs shards.json and that rank's parts, copied from "
                      "where the index was split") from None


class RankZeroFailed(RuntimeError):
    """A rank other than 0 whose run rank 0 ended after an error (it exits non-zero, as rank 0 does)."""


def serve_parts(index: str | os.PathLike, layers: Sequence[str] | None = None, use_gpu: bool = True) -> None:
    """A ``torchrun`` rank other than 0: open this rank's parts and answer rank 0 until it is done (an error opening
    them is the answer to every request)."""
    local: PartSearch | BaseException
    try:
        rank = (distributed.rank(), distributed.world_size())
        sh = read_own(index, rank)  # (this rank's parts only: another host may hold the others)
        local = PartSearch(sh, sh.owned(*rank), layers, use_gpu)
    except Exception as e:  # noqa: BLE001 -- answered to rank 0
        local = e
    try:
        if follow(local):
            raise RankZeroFailed("rank 0 ended the run after an error (its output says which); this rank stops too")
    finally:
        if isinstance(local, PartSearch):
            local.close()


class _Columns:
    """What :class:`TrainingTexts` reads of the store (the token hashes) over every part, by the whole index's rows
    (:meth:`rows_of`): a part open here from its store; another from its directory in one process, or under
    ``torchrun`` from the rank that holds it (``fetch``: its host alone may hold it), every column asked at once in
    one round (:meth:`rows`), the last :data:`KEEP` values kept (the server's ``/example`` asks for the rows it then
    reads the text of)."""

    KEEP = 4096

    def __init__(self, sharded: Sharded, stores: dict[int, Store], fetch=None):
        self.parts, self.stores, self.fetch = sharded.parts, stores, fetch
        self.firsts = [p.first for p in sharded.parts]
        self._cols: dict[tuple[str, int], np.ndarray] = {}
        self._kept: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    def _column(self, name: str, j: int) -> np.ndarray:
        if (name, j) not in self._cols:
            if j in self.stores:
                self._cols[name, j] = self.stores[j].column(name)
            else:
                with Store(self.parts[j].dir) as s:
                    self._cols[name, j] = s.column(name)
        return self._cols[name, j]

    def rows_of(self, name: str, ids) -> np.ndarray:
        """Column ``name`` of rows ``ids`` (the whole index's), in order."""
        return self.rows((name,), ids)[name]

    def rows(self, names: Sequence[str], ids) -> dict[str, np.ndarray]:
        """Columns ``names`` of rows ``ids`` (the whole index's), in order; another rank's rows in one round."""
        ids = np.asarray(ids, dtype=np.int64)
        part = [bisect.bisect_right(self.firsts, int(i)) - 1 for i in ids]
        remote = sorted({int(i) for i, j in zip(ids, part, strict=True) if j not in self.stores
                         and any((n, int(i)) not in self._kept for n in names)}) if self.fetch is not None else []
        if remote:
            self._kept.update({(n, i): v for n, col in self.fetch(tuple(names), np.array(remote, dtype=np.int64))
                               .items() for i, v in col.items()})
        out = {}
        for n in names:
            if not len(ids):
                out[n] = np.zeros((0,), dtype=self._column(n, 0).dtype)
                continue
            out[n] = np.stack([self._kept[n, int(i)] if (n, int(i)) in self._kept
                               else self._column(n, j)[int(i) - self.firsts[j]]
                               for i, j in zip(ids, part, strict=True)])
        while len(self._kept) > self.KEEP:
            self._kept.popitem(last=False)
        return out


class ShardedQueryEngine(QueryEngine):
    """A :class:`~gradindex.query.QueryEngine` over a sharded index directory: the model and part 0 open here, the
    search over every part (this process's own parts, and under ``torchrun`` every other rank's through
    :func:`ask`). Ids are the whole index's rows and :attr:`n` its examples; answers equal one index's. On rank 0
    only (the others run :func:`serve_parts`); :meth:`close` ends their run."""

    def __init__(self, index: str | os.PathLike | Sharded, model_dir: str | os.PathLike | None = None, *,
                 layers: Sequence[str] | None = None, use_gpu: bool = True,
                 data: str | os.PathLike | None = None, share_candidates: bool = True, **kwargs):
        self._stopped, self.local, self._first, self._whole = False, None, None, None
        self.share_candidates = share_candidates
        """Whether a sketch tier's part re-ranks its share of the candidates (:func:`part_candidates`), not all."""
        try:
            if distributed.rank() != 0:
                raise RuntimeError("a sharded index's engine opens on rank 0; other ranks run serve_parts")
            ranks = (0, distributed.world_size()) if distributed.active() else None  # (the others read theirs)
            self.sharded = index if isinstance(index, Sharded) else read_own(index, ranks)
            owned = self.sharded.owned(0, distributed.world_size())
            self._first = OpenIndex(self.sharded.parts[0].dir)
            super().__init__(self._first, model_dir, layers=layers, use_gpu=use_gpu, data=data, **kwargs)
            self.local = PartSearch(self.sharded, owned, layers, use_gpu, {0: self._first})
            if distributed.active():  # every rank's parts open and its shards.json rank 0's, or the first error
                self._ask("hello", {"digest": self.local.digest})
            self.n = self.sharded.examples
            stores = {j: e.store for j, e in zip(owned, self.local.engines, strict=True)}
            self.by_part = _Columns(self.sharded, stores, self._fetch_rows if distributed.active() else None)
            self.texts = TrainingTexts(self.sharded.manifest, self.by_part, self.tokenizer, data)
            self.home = self.sharded.dir
            """The sharded index directory (:attr:`dir` is part 0's: the fits every part shares)."""
        except BaseException:
            self.close(failed=True)
            raise

    @property
    def whole(self) -> OpenParts:
        """Every part as one open store (the whole index's manifest and rows; part 0's fits), opened on first use:
        what reads every part's rows here (the audit, outliers, duplicates, an explanation, the server's explained
        results) needs every part on this host; a query, the server's searches and the texts do not."""
        if self._whole is None:
            away = [p.dir for p in self.sharded.parts if not (p.dir / STORE_DIR).is_dir()]
            if away:
                raise FileNotFoundError(f"{str(away[0])!r} is not on this host ({len(away)} of the index's "
                                        f"{len(self.sharded.parts)} parts are not): this command reads every part's "
                                        "rows on rank 0, so run it where every part is readable (a shared "
                                        "filesystem, or all parts copied here); queries and the server need only "
                                        "each rank's own parts")
            if distributed.active():  # (rank 0 read only its own parts' manifests: check the others' copies here)
                read_sharded(self.sharded.dir)
            self._whole = OpenParts(self.sharded)
        return self._whole

    @property
    def store(self) -> Store:
        """Every part's rows as one store (:attr:`whole`)."""
        return self.whole.store

    @store.setter
    def store(self, value: Store) -> None:  # (QueryEngine.__init__ sets part 0's: this engine reads every part)
        pass

    def check_current(self) -> None:
        """:meth:`QueryEngine.check_current` of every part open here (in one process, every part; under torchrun,
        rank 0's: the other ranks check theirs at each search)."""
        for eng in self.local.engines:
            eng.index.check_current()

    def probe_ranks(self) -> None:
        """Have every rank answer, so that one that died while no request came is found lost (:meth:`lost`); nothing
        in one process."""
        if distributed.active():
            self._ask("ping", {})

    def _fetch_rows(self, names: Sequence[str], ids: np.ndarray) -> dict[str, dict[int, np.ndarray]]:
        """Columns ``names`` of rows ``ids`` from the ranks that hold them (one round), by name, then id."""
        out: dict[str, dict[int, np.ndarray]] = {n: {} for n in names}
        for got in self._ask("column_rows", {"names": list(names), "ids": np.asarray(ids, dtype=np.int64)}):
            for n, col in got.items():
                out[n].update(col)
        return out

    def example_columns(self, names: Sequence[str], ids) -> dict[str, np.ndarray]:
        """Per-example columns ``names`` of rows ``ids`` (the whole index's), from the parts that hold them: another
        rank's in one round, which also brings the rows' token hashes, kept for the text usually read next (the
        server's ``/example``: one round where it took three)."""
        got = self.by_part.rows(tuple(dict.fromkeys([*names, "token_hash"])), ids)
        return {n: got[n] for n in names}

    def _ask(self, op: str, kw: dict) -> list:
        if not distributed.active():
            return [self.local.run(op, kw)]
        return ask(self.local, op, kw, self.describe_rank)

    def describe_rank(self, rank: int) -> str:
        """What rank ``rank`` of this run answers for: ``part-00001, rows 16-39``."""
        owned = self.sharded.owned(rank, distributed.world_size())
        first, last = self.sharded.parts[owned[0]], self.sharded.parts[owned[-1]]
        names = first.dir.name if len(owned) == 1 else f"{first.dir.name}..{last.dir.name}"
        return f"{names}, rows {first.first}-{last.stop - 1}"

    def lost(self) -> str | None:
        """Why the run's ranks can no longer answer (a rank died or stalled); ``None`` while they can."""
        return lost()

    def self_influence(self, base: str, damping: float, layers: Sequence[str]) -> np.ndarray:
        """``[N]`` self-influence of every row under a base method: each part's, from the rank that holds it."""
        kw = {"base": base, "damping": damping, "layers": list(layers)}
        return np.concatenate(self._ask("self_influence", kw))

    def search(self, grads, k: int = 10, method: str | None = None, damping: float = DEFAULT_DAMPING,
               layers=None, lowest: int = 0, candidates: int | None = None, shortlist: int | None = None,
               nprobe: int | None = None, texts: bool = True) -> list[QueryResult]:
        """:meth:`QueryEngine.search <gradindex.query.QueryEngine.search>` over every part, merged."""
        notes = []
        k, lowest = clamp_k(k, lowest, self.n, notes)
        q = {n: torch.as_tensor(v).float().cpu().numpy() for n, v in grads.items()}
        kw = {"grads": q, "k": k, "method": method, "damping": damping, "layers": layers, "lowest": lowest,
              "candidates": candidates, "shortlist": shortlist, "nprobe": nprobe, "share": self.share_candidates}
        answers = self._ask("search", kw)
        out = answers[0]
        for more in answers[1:]:
            out = merge(out, more, k, lowest)
        for r in out:
            r.notes = list(dict.fromkeys(r.notes + notes))
        if texts and self.tokenizer is not None:
            self._attach_texts(out)
        return out

    def scores(self, queries, method: str | None = None, damping: float = DEFAULT_DAMPING,
               layers: Sequence[str] | str | None = None, text_field: str = "text", refine=None) -> np.ndarray:
        """``[Q, N]`` exact scores against every row of every part (:meth:`QueryEngine.scores
        <gradindex.query.QueryEngine.scores>`)."""
        method = self.resolve_method(method)
        chosen = self.select_layers(layers)
        grads = queries if isinstance(queries, Mapping) else self._query_rows(
            queries, text_field, method, damping, chosen, self.refine_config(refine, method), time.perf_counter())[1]
        q = {n: torch.as_tensor(grads[n]).float().cpu().numpy() for n in chosen}
        kw = {"grads": q, "method": method, "damping": damping, "layers": chosen}
        return np.concatenate(self._ask("scores", kw), axis=1)

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        """Close every part opened here and end the other ranks' run (once; ``failed``: after an error, so that they
        exit non-zero too)."""
        if not self._stopped:
            self._stopped = True
            stop_followers(failed)
        if self._whole is not None:
            self._whole.close()
        if self.local is not None:
            self.local.close()
        if getattr(self, "index", None) is not None:
            super().close()
        if self._first is not None:
            self._first.close()


def open_engine(index: str | os.PathLike, model_dir: str | os.PathLike | None = None, **kwargs) -> QueryEngine:
    """A :class:`~gradindex.query.QueryEngine` over ``index``: a :class:`ShardedQueryEngine` where it is a sharded
    index directory (the CLI's commands open their engine so)."""
    if not isinstance(index, OpenIndex) and is_sharded(index):
        return ShardedQueryEngine(index, model_dir, **kwargs)
    return QueryEngine(index, model_dir, **kwargs)
