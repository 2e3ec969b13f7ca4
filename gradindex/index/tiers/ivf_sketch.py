"""The ``ivf-sketch`` tier: the sketch tier's codes (:mod:`gradindex.index.tiers.sketch`) grouped into inverted
lists, so that a query scores the lists nearest it instead of every example.

Build: the sketch files as the sketch tier writes them (resumable), then a FAISS IVF level over them: spherical
k-means (FAISS's IVF training, on the GPUs when FAISS sees any: :func:`gradindex.index.gpu.train`) of the
directions of a seeded sample of the decoded sketches into ``nlist`` lists (``IVF{nlist},sketch``;
``ivf-sketch``: :func:`default_nlist`, ``4·√N``), every example in the list whose centroid is nearest its
direction (``ivf.lists.npy``), and each list's mean sketch (``ivf.centroids.npy``). A query ranks the lists by its
inner product with their means (its mean score over each list, so a list of long rows ranks higher): the lists
that held 0.9 / 0.97 of the sketch's top 10 (sample rows as queries) were 12% / 56% of 10^5 real rows' (the
benchmark's) against 16% / 60% ranked by the unit centroids, and 45% / 71% for L2 k-means; on 3,000 tiny-GPT-2
rows 25% of the rows held 0.97 (38% by the unit centroids).

``nprobe`` is chosen in the same pass, for what decides a query's answer: the exact re-rank keeps a row when its
list is probed (any row of the exhaustive sketch's top ``C`` is then among the candidates), so ``nprobe`` is the
fewest lists, nearest first, that hold ``RECALL_TARGET + SAMPLE_MARGIN`` of the exhaustive sketch's top
:data:`TRUTH_K` of each of :data:`PROBE_QUERIES` sample rows held out of the training sample (the row itself not
counted), ranked both as ``ekfac`` ranks (the raw product) and as the default ``ekfac-selfnorm`` does (the product
over the row's norm: the direction). The calibration before (the raw top 10, 0.97) gave held-out queries 0.92 of
the exhaustive default's top 10 on the benchmark's real rows: the default ranks by direction, a stored row's top 10
is a third its own document's windows (in its own list), and held-out text sits farther from the rows than stored
rows do (:data:`SAMPLE_MARGIN`). ``index.json``'s ``ivf`` entry records ``nprobe``, the recall measured and the
recall at each power of two (the least over the rankings).

Search: the query's sketch (the chosen layers' parts, as the sketch tier's) picks its ``nprobe`` nearest lists by
inner product with the centroids, and more until they hold the ``C`` candidates (:func:`sketch_candidates`); the
rows of those lists are scored by the sketch tier's int8 product (held in list order, so a list is one slice),
times the method's per-example factors, and the top ``C`` (bottom ``C``: lists nearest ``-y``) go to the exact
re-rank. With every list probed, the candidates are the exhaustive sketch's. FAISS's own IVF search is not used
for the scan: a sketch row's score has a per-row scale and the method's factors after the product, so FAISS's
top-k by code inner product is not the ranking wanted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np
import torch

from gradindex.checksum import record
from gradindex.distributed import SOLO, Team
from gradindex.errors import CorruptFileError
from gradindex.index import gpu
from gradindex.index.cost import READ_BYTES_S, ROW_READ_S, SKETCH_NS, LookupCost, sketch_candidates
from gradindex.index.files import index_command
from gradindex.index.sketch import Sketch, SketchIndex, kernel_setting, read_into, scan_kernel
from gradindex.index.space import IndexSpace
from gradindex.index.tiers.base import (
    BuildJob,
    CandidateRequest,
    RowShape,
    TierSource,
    register_tier,
    too_few_to_train,
    top_and_bottom,
    with_factors,
)
from gradindex.index.tiers.sketch import SketchTier
from gradindex.index.tiers.sketch_files import sketch_files

LISTS_PER_ROOT = 4
"""``nlist = 4·√N`` by default: a query's centroid scan (``nlist`` rows) and its lists' rows (``nprobe·N/nlist``)
both grow as ``√N`` at a fixed ``nprobe``."""
RECALL_TARGET = 0.95
"""The recall@10 of the exhaustive default asked of real queries' ``nprobe`` lists; the build asks its sample rows
for :data:`SAMPLE_MARGIN` more (module doc)."""
SAMPLE_MARGIN = 0.025
"""What stored rows searched as queries hold above held-out queries at the same ``nprobe``: on the benchmark's
real rows, where the held-out queries got 0.95 of the exhaustive default's top 10, the sample rows held 0.97 of
their sketch top 50 at 10^5 and 0.95-0.96 at 3·10^5 (``benchmarks/results/lookup-ivf.json``)."""
PROBE_QUERIES = 256
"""Sample rows, held out of the k-means sample, that measure the recall at build (64 chose ``nprobe`` 713 of
10^5 real rows' 1,254 lists, where the held-out queries needed 727; 256 cost little beside the k-means)."""
TRUTH_K = 50
"""The depth of each sample row's exhaustive top the lists must hold: a third of a stored row's top 10 are its
neighbours in the store (rows within 8 of it on the benchmark: the same document's windows, mostly in its list;
4% for a held-out query's exact top 10), so its top 10 overstates the recall; its top 50 much less."""
RANKINGS = ("raw", "direction")
"""The sketch rankings ``nprobe`` must serve (:func:`rankings`): ``ekfac`` and ``ekfac-selfnorm`` (the default)."""
TRAIN_PER_LIST = 32
"""k-means sample: this many rows a list ..."""
TRAIN_BYTES = 1 << 30
"""... in at most this many bytes of float32 sketches (and at least ``nlist`` rows)."""
KMEANS_ITER = 10
SCAN_SECONDS = 0.5
"""``auto`` builds this tier in place of the exhaustive sketch where that one's scan is estimated at least this long
(~1.6·10^6 examples at the default 2 KiB sketch; :data:`~gradindex.index.cost.SKETCH_NS`)."""
RAM_SHARE = 0.5
"""... and the tier's RAM (the sketch codes, their list order, the centroids) fits this share of the machine's."""
CENTROID_NS = 0.05
"""Seconds × 1e9 per centroid number per query (one float32 BLAS product)."""
PROBE_SHARE = 0.6
"""The share of the rows a query's lists hold in the plan's estimate (the build chooses its own ``nprobe``): on the
benchmark's real rows the calibration chose 61% of the lists (0.62 of the rows) at 10^5 and 58% (0.59) at 3·10^5
(``benchmarks/results/lookup-ivf.json``, ``comparisons``; the one before, 0.92 of the exhaustive default, 0.3-0.5)."""
CENTROIDS, LISTS = "ivf.centroids.npy", "ivf.lists.npy"
_PATTERN = re.compile(r"ivf-sketch|ivf(\d+),sketch")


def default_nlist(n: int) -> int:
    """``round(4·√n)``, at most ``n / 8`` (at least 1)."""
    return int(max(1, min(round(LISTS_PER_ROOT * math.sqrt(n)), n // 8)))


@register_tier
class IvfSketchTier(SketchTier):
    """The sketch's codes in inverted lists, ``nprobe`` of them searched (module doc); ``auto``'s choice in the raw
    space where the exhaustive sketch scan is slow (:data:`SCAN_SECONDS`) and the sketch fits RAM."""

    name = "ivf-sketch"
    auto_order = 0.5

    @classmethod
    def matches(cls, factory: str) -> bool:
        return _PATTERN.fullmatch(factory.strip().lower()) is not None

    def asked_lists(self) -> int | None:
        """The ``nlist`` of an ``IVF{nlist},sketch`` string (None: :func:`default_nlist`)."""
        m = _PATTERN.fullmatch(self.factory.strip().lower())
        return int(m.group(1)) if m and m.group(1) else None

    def nlist(self, n: int) -> int:
        return min(n, self.asked_lists() or default_nlist(n))

    def suits(self, rows: RowShape, space: IndexSpace, ram_bytes: int) -> bool:
        slow = rows.n * self.sketch_codes() * SKETCH_NS * 1e-9 >= SCAN_SECONDS
        fits = ram_bytes <= 0 or self.cost(rows).ram_bytes <= RAM_SHARE * ram_bytes
        return super().suits(rows, space, ram_bytes) and slow and fits

    def check_examples(self, n: int) -> None:
        asked = self.asked_lists()
        if asked is not None and asked > n:
            raise ValueError(f"--index-type {self.factory} has {asked} lists, more than the {n} examples to train "
                             "it on; use fewer lists, ivf-sketch (4·√N lists) or sketch (exhaustive)")
        too_few_to_train(self.factory, f"{self.nlist(n)} lists", self.nlist(n), self.cfg.train_size)

    def cost(self, rows: RowShape, candidates: int | None = None) -> LookupCost:
        n, m = rows.n, self.sketch_codes()
        nlist = self.nlist(n)
        c = min(n, candidates or sketch_candidates(n))
        scanned = min(n, max(c, math.ceil(n * PROBE_SHARE)))
        secs = (nlist * m * CENTROID_NS + scanned * m * SKETCH_NS) * 1e-9 + \
            c * (ROW_READ_S + rows.row_bytes / READ_BYTES_S)
        files = n * (m + 4) + 4 * n + 4 * nlist * m
        held = n * (m + 4) + 8 * n + 4 * nlist * m + 4 * n * rows.layers
        return LookupCost(self.name, secs, held, files + 4 * n * rows.layers, scanned * (m + 4) + c * rows.row_bytes)

    def key(self) -> dict:
        return {**super().key(), "ivf": {"recall": RECALL_TARGET, "queries": PROBE_QUERIES, "top": TRUTH_K,
                                          "rankings": list(RANKINGS), "margin": SAMPLE_MARGIN}}

    def build(self, job: BuildJob) -> int:
        super().build(job)  # each layer's entry and the sketch files (resumable)
        build_ivf(job, self.nlist(job.n))
        return 0

    @classmethod
    def files(cls, meta: dict, layers: Sequence[str] | None = None) -> list[str]:
        ivf = meta.get("ivf")
        return sketch_files(meta) + ([ivf["centroids"], ivf["lists"]] if ivf else [])

    @classmethod
    def written_bytes(cls, meta: dict) -> int:
        return super().written_bytes(meta) + int((meta.get("ivf") or {}).get("bytes", 0))

    @classmethod
    def describe(cls, meta: dict) -> str:
        ivf = meta["ivf"]
        top = (ivf.get("truth") or {}).get("top", 10)
        return (f"{super().describe(meta)} in {ivf['nlist']} inverted lists, {ivf['nprobe']} searched (they held "
                f"{ivf['recall']:.3f} of the exhaustive sketch's top {top} on {ivf['queries']} sample rows)")

    def open(self, source: TierSource) -> None:
        kernel_setting()  # (a wrong GRADINDEX_SKETCH_KERNEL named as such, before any code is read)
        try:
            self.sketch: ListSketchIndex = load_lists(source.folder, source.meta, source.n)
        except (OSError, ValueError, KeyError) as e:
            raise CorruptFileError(f"the ivf-sketch tier in {str(source.folder)!r} is unreadable ({e}); rebuild "
                                   f"the indices with `{index_command(source.index_dir)}`") from None
        self.nprobe = int(source.meta["ivf"]["nprobe"])

    def first_stage(self, req: CandidateRequest, c: int) -> list[np.ndarray]:
        """Per query, the top ``c`` (and bottom ``c`` when ``req.lowest``) sketch estimates among the rows of its
        probed lists (``req.nprobe``, else the build's), with the exact score's per-example factors."""
        sk = self.sketch
        yq = sk.sketch.apply(req.u, list(req.layers))  # [Q, m]
        nprobe = req.nprobe or self.nprobe
        out = []
        for y in yq:
            parts = []
            for sign, want in ((1.0, c), (-1.0, c if req.lowest else 0)):
                if not want:
                    continue
                pos = sk.probe(sign * y, nprobe, want)
                s = sk.scores_at(y[None], pos).astype(np.float64)  # [1, len(pos)]
                ids = sk.order[pos]
                s = with_factors(self.source, s, req.layers, req.cosine, req.scale, ids)
                parts.append(ids[top_and_bottom(s, want if sign > 0 else 0, want if sign < 0 else 0, margin=0)[0]])
            out.append(np.unique(np.concatenate(parts)))
        return out


class ListSketchIndex(SketchIndex):
    """A :class:`SketchIndex` whose rows are held in list order (``order``: the example at each position; list
    ``l`` is positions ``offsets[l]:offsets[l + 1]``), with the centroids that pick the lists."""

    def __init__(self, sketch: Sketch, codes_path: Path, offset: int, scales: np.ndarray, lists: np.ndarray,
                 centroids: np.ndarray, block: int = 1 << 16):
        self.sketch, self.n = sketch, len(lists)
        self.order = np.argsort(lists, kind="stable")
        self.offsets = np.searchsorted(lists[self.order], np.arange(len(centroids) + 1))
        self.centroids = np.ascontiguousarray(centroids, np.float32)
        self.scales = np.asarray(scales, np.float32)[self.order]
        self.codes = torch.empty((self.n, sketch.m), dtype=torch.int8)
        dest = self.codes.numpy().view(np.uint8)
        at = np.empty(self.n, np.int64)
        at[self.order] = np.arange(self.n)
        buf = np.empty((min(block, self.n), sketch.m), np.uint8)
        for s in range(0, self.n, block):  # plain reads in example order, each row put at its list position
            part = buf[:min(block, self.n - s)]
            read_into(codes_path, offset + s * sketch.m, part)
            dest[at[s:s + len(part)]] = part ^ np.uint8(0x80)
        self.kernel = scan_kernel(sketch.m)

    def nbytes(self) -> int:
        return int(super().nbytes() + self.order.nbytes + self.centroids.nbytes)

    def scores(self, yq: np.ndarray, batch: int = 8) -> np.ndarray:
        """``[Q, N]`` sketch scores of every example, in example order (as :class:`SketchIndex`'s)."""
        s = super().scores(yq, batch)
        out = np.empty_like(s)
        out[:, self.order] = s
        return out

    def probe(self, y: np.ndarray, nprobe: int, rows: int) -> np.ndarray:
        """The positions (ascending) of the ``nprobe`` lists whose centroids have the largest inner product with
        ``y`` ``[m]``, and of the next nearest until they hold at least ``rows`` rows."""
        rank = np.argsort(-(self.centroids @ y), kind="stable")
        held = np.cumsum(np.diff(self.offsets)[rank])
        take = max(min(nprobe, len(rank)), min(len(rank), int(np.searchsorted(held, rows)) + 1))
        lists = np.sort(rank[:take])
        return np.concatenate([np.arange(self.offsets[x], self.offsets[x + 1]) for x in lists])

    def scores_at(self, yq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """``[Q, len(pos)]`` float32 sketch scores of the rows at positions ``pos`` (ascending; the same numbers as
        :meth:`scores`), a contiguous run of positions at a time."""
        cut = np.flatnonzero(np.diff(pos) != 1) + 1
        runs = [(int(pos[a]), int(pos[a]) + int(b - a)) for a, b in zip(np.r_[0, cut], np.r_[cut, len(pos)],
                                                                          strict=True)] if len(pos) else []
        out = self.unscaled(np.asarray(yq, np.float32), runs)
        out *= self.scales[pos][None, :]
        return out


def load_lists(folder: Path, meta: dict, n: int) -> ListSketchIndex:
    """The tier of a complete ``index.json``: its codes read into RAM in list order."""
    sk, ivf = meta["sketch"], meta["ivf"]
    sketch = Sketch.from_dict(sk["spec"])
    codes = np.load(Path(folder) / sk["codes"], mmap_mode="r")
    scales = np.load(Path(folder) / sk["scales"])
    lists = np.load(Path(folder) / ivf["lists"])
    centroids = np.load(Path(folder) / ivf["centroids"])
    if codes.shape != (n, sketch.m) or scales.shape != (n,) or lists.shape != (n,) \
            or centroids.shape != (ivf["nlist"], sketch.m) or (n and not 0 <= lists.min() <= lists.max() < len(
                centroids)):
        raise CorruptFileError(f"the ivf-sketch files in {str(folder)!r} hold {codes.shape} codes, {lists.shape} "
                               f"list ids and {centroids.shape} centroids, expected ({n}, {sketch.m}) codes and "
                               f"({ivf['nlist']}, {sketch.m}) centroids")
    return ListSketchIndex(sketch, Path(codes.filename), int(codes.offset), scales, lists, centroids)


# -- the build ---------------------------------------------------------------------------------------------------
def build_ivf(job: BuildJob, nlist: int) -> None:
    """Train the lists, assign every example and choose ``nprobe`` (module doc); ``job.meta['ivf']`` records
    them. Skipped when a resumed build's staging folder has them for this ``nlist``."""
    out, meta = job.out, job.meta
    done = meta.get("ivf")
    if done and done.get("nlist") == nlist and all((out / f).exists() for f in (CENTROIDS, LISTS)):
        return
    codes = _Codes(out, meta)
    probe, train = _samples(codes.n, nlist, job.cfg.seed, job.cfg.train_size, codes.m)
    factors = rankings(np.load(out / meta["norms"]["file"]).sum(axis=1, dtype=np.float64), job.inv is not None)
    unit = _train(codes.read(train), nlist, job.cfg.seed, job.cfg.gpu)
    team = job.share("ivf", str(out), meta["sketch"], unit, probe, factors, job.cfg.block_bytes) if job.share else SOLO
    lists, centroids, truth = assign(codes, unit, probe, factors, job.cfg.block_bytes, job.cfg.gpu, team)
    aim = min(1.0, RECALL_TARGET + SAMPLE_MARGIN)
    nprobe, recall, curve = choose_nprobe(codes.read(probe) @ centroids.T, lists, truth, aim)
    np.save(out / CENTROIDS, centroids)
    np.save(out / LISTS, lists)
    record(out.parent, [out / CENTROIDS, out / LISTS], [f"{out.name}/{CENTROIDS}", f"{out.name}/{LISTS}"])
    meta["ivf"] = {"nlist": int(nlist), "nprobe": int(nprobe), "recall": recall, "target": RECALL_TARGET,
                   "sample_target": aim, "truth": {"top": TRUTH_K, "rankings": list(RANKINGS)},
                   "recall_by_nprobe": curve, "queries": len(probe), "train_rows": len(train),
                   "centroids": CENTROIDS, "lists": LISTS,
                   "bytes": int((out / CENTROIDS).stat().st_size + (out / LISTS).stat().st_size)}
    job.save()


class _Codes:
    """The staged sketch codes, read (plain reads) and decoded to float32 sketches."""

    def __init__(self, out: Path, meta: dict):
        mm = np.load(out / meta["sketch"]["codes"], mmap_mode="r")
        self.path, self.offset, (self.n, self.m) = Path(mm.filename), int(mm.offset), mm.shape
        del mm
        self.scales = np.load(out / meta["sketch"]["scales"])

    def block(self, s: int, e: int) -> np.ndarray:
        buf = np.empty((e - s, self.m), np.uint8)
        read_into(self.path, self.offset + s * self.m, buf)
        return self.decode(buf, self.scales[s:e])

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The sketches of ``rows`` (ascending)."""
        return self.decode(np.asarray(np.load(self.path, mmap_mode="r")[rows]), self.scales[rows])

    @staticmethod
    def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        return (codes.view(np.int8) ^ np.int8(-128)).astype(np.float32) * scales[:, None]


def _samples(n: int, nlist: int, seed: int, train_size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(probe rows, k-means rows): a seeded permutation's first :data:`PROBE_QUERIES` (at most a quarter of ``n``)
    and the next rows after them (all rows when fewer than ``nlist`` are left)."""
    perm = np.random.default_rng(seed).permutation(n)
    p = min(PROBE_QUERIES, max(1, n // 4))
    rest = perm[p:] if n - p >= nlist else perm
    size = train_size or max(nlist, min(TRAIN_PER_LIST * nlist, TRAIN_BYTES // (4 * m)))
    return np.sort(perm[:p]), np.sort(rest[:min(len(rest), size)])


def _train(x: np.ndarray, nlist: int, seed: int, use_gpu: bool) -> np.ndarray:
    """``[nlist, m]`` unit centroids: FAISS's IVF (inner product: spherical k-means) trained on ``x``'s directions."""
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(x.shape[1]), x.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.cp.niter, ivf.cp.seed, ivf.cp.spherical = KMEANS_ITER, seed, True
    ivf.cp.min_points_per_centroid, ivf.cp.max_points_per_centroid = 1, max(1, -(-len(x) // nlist))
    gpu.train(ivf, np.ascontiguousarray(x), use_gpu)
    return np.ascontiguousarray(ivf.quantizer.reconstruct_n(0, nlist), np.float32)


def assign(codes: _Codes, centroids: np.ndarray, probe: np.ndarray, factors: np.ndarray, block_bytes: int,
           use_gpu: bool, team: Team = SOLO) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass over every sketch: ``[N]`` int32 the list of each (the unit centroid nearest its direction),
    ``[nlist, m]`` float32 each list's mean sketch, and ``[R, P, TRUTH_K]`` each probe row's exhaustive top of the
    others under each of the ``R`` rankings ``factors`` ``[R, N]`` (sketch score × factor; -1: none).

    ``team``: a torchrun build's ranks share the pass, block ``k`` on rank ``k % size`` (the nearest centroid and the
    probe rows' scores, most of its time; FAISS on the CPU on every rank, so that a near tie goes the same way on
    each); the blocks' lists and tops are met in block order, and the lead adds the lists' sums in a second read of
    the codes, in the order one process adds them (the same bits as one process on the CPU)."""
    def setup() -> tuple[faiss.Index, np.ndarray]:
        quant = faiss.IndexFlatIP(codes.m)
        quant.add(centroids)
        return gpu.for_search(quant, use_gpu and team.size == 1), codes.read(probe)  # (one kernel on every rank)

    quant, yq = team.each(setup)  # (a rank failing here fails every rank, before the rounds' collectives)
    lists = np.empty(codes.n, np.int32)
    sums = np.zeros(centroids.shape, np.float64)
    tops = [_Top(len(probe)) for _ in factors]
    step = max(1, block_bytes // (4 * codes.m))
    starts = list(range(0, codes.n, step))

    def work(k: int) -> tuple[np.ndarray, list[_Top]]:
        s, e = starts[k], min(codes.n, starts[k] + step)
        y = codes.block(s, e)
        mine = quant.search(y, 1)[1][:, 0].astype(np.int32)
        if team.size == 1:
            _add_sums(sums, mine, y)
        sc = yq @ y.T  # [P, B]
        at = (probe >= s) & (probe < e)
        sc[np.flatnonzero(at), probe[at] - s] = -np.inf  # not itself
        block = [_Top(len(probe)) for _ in factors]
        for top, f in zip(block, factors, strict=True):
            top.add(sc * f[None, s:e], s)
        return mine, block

    def combine(k: int, res: tuple[np.ndarray, list[_Top]]) -> None:
        lists[starts[k]:starts[k] + len(res[0])] = res[0]
        for top, b in zip(tops, res[1], strict=True):
            top.merge(b)

    team.rounds(len(starts), work, combine, unit="block of sketches")
    if team.size > 1 and team.lead:
        for s in starts:
            e = min(codes.n, s + step)
            _add_sums(sums, lists[s:e], codes.block(s, e))
    means = sums / np.maximum(np.bincount(lists, minlength=len(centroids)), 1)[:, None]
    return lists, means.astype(np.float32), np.stack([t.ids() for t in tops])


def _add_sums(sums: np.ndarray, lists: np.ndarray, y: np.ndarray) -> None:
    """Add the sketches ``y`` to their lists' ``sums`` (float64), a list at a time."""
    by = np.argsort(lists, kind="stable")
    first = np.flatnonzero(np.r_[True, np.diff(lists[by]) != 0])
    sums[lists[by][first]] += np.add.reduceat(y[by], first, axis=0, dtype=np.float64)


def assist(out: str, sketch: dict, centroids: np.ndarray, probe: np.ndarray, factors: np.ndarray, block_bytes: int,
           team: Team) -> None:
    """A torchrun rank other than 0: its share of :func:`assign` over the staged codes in ``out``."""
    assign(_Codes(Path(out), {"sketch": sketch}), centroids, probe, factors, block_bytes, False, team)


class _Top:
    """The running top :data:`TRUTH_K` ids of ``P`` rows of scores, a block of columns at a time."""

    def __init__(self, p: int):
        self.s = np.full((p, TRUTH_K), -np.inf, np.float32)
        self.i = np.full((p, TRUTH_K), -1, np.int64)

    def add(self, sc: np.ndarray, start: int) -> None:
        """Columns ``start, start + 1, ...`` scored ``sc`` ``[P, B]``."""
        self._keep(sc.astype(np.float32), np.broadcast_to(np.arange(start, start + sc.shape[1]), sc.shape))

    def merge(self, other: _Top) -> None:
        """Keep the top of this one's rows and ``other``'s (a later block's: ties go to this one's, as in
        :meth:`add`, so merging blocks' tops in block order gives the top one running top gives)."""
        self._keep(other.s, other.i)

    def _keep(self, s: np.ndarray, i: np.ndarray) -> None:
        cs, ci = np.concatenate([self.s, s], 1), np.concatenate([self.i, i], 1)
        top = np.argsort(-cs, axis=1, kind="stable")[:, :TRUTH_K]
        self.s, self.i = np.take_along_axis(cs, top, 1), np.take_along_axis(ci, top, 1)

    def ids(self) -> np.ndarray:
        return np.where(np.isfinite(self.s), self.i, -1)


def rankings(sq_norms: np.ndarray, normalized: bool) -> np.ndarray:
    """``[2, N]`` the per-example factors of the sketch score under the two rankings a query asks of the tier
    (:func:`~gradindex.index.tiers.base.with_factors`): the raw inner product (``ekfac``, ``graddot``: the norm where
    the sketches are of unit rows) and the direction (``-selfnorm`` on whitened rows, whose self-influence is the
    squared norm, and ``cosine``: 1 / the norm on raw sketches); ``sq_norms`` ``[N]`` the rows' squared norms."""
    norm = np.sqrt(np.maximum(np.asarray(sq_norms, np.float64), 0.0))
    raw = norm if normalized else np.ones_like(norm)
    direction = np.where(norm > 0, raw / np.where(norm > 0, norm, 1.0), 0.0)
    return np.stack([raw, direction]).astype(np.float32)


def choose_nprobe(probe_scores: np.ndarray, lists: np.ndarray, truth: np.ndarray,
                  target: float) -> tuple[int, float, dict[str, float]]:
    """``(nprobe, its recall, recall at each power of two)``: the fewest lists, nearest first by
    ``probe_scores`` ``[P, nlist]`` (a query's inner product with each centroid), that hold ``target`` of the
    ``truth`` ``[R, P, K]`` rows (``-1``: none) under each of the ``R`` rankings (a ``[P, K]`` truth: one); a truth
    row is found by ``nprobe`` when its list's rank is below it. The recalls are the least over the rankings."""
    P, nlist = probe_scores.shape
    order = np.argsort(-probe_scores, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(nlist), order.shape), 1)
    found = []  # per ranking: the sorted list ranks of its truth rows
    for t in np.asarray(truth).reshape(-1, *np.shape(truth)[-2:]):
        valid = t >= 0
        r = np.sort(rank[np.nonzero(valid)[0], lists[t[valid]]])
        if len(r):
            found.append(r)
    if not found:
        return nlist, 1.0, {}
    nprobe = max(int(r[min(len(r), math.ceil(target * len(r))) - 1]) + 1 for r in found)

    def recall(p: int) -> float:
        return float(min(np.mean(r < p) for r in found))

    curve = {str(p): recall(p) for p in (2 ** i for i in range(nlist.bit_length())) if p < nlist}
    return nprobe, recall(nprobe), curve
