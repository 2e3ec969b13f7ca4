"""Deduplication in gradient space: groups of examples that teach the model the same thing.

Two examples are near-duplicates when the cosine of their per-example gradients (concatenated
over the chosen layers; with ``method='kfac'|'ekfac'`` first whitened by ``H^{-1/2}``, so the
cosine is the one the influence geometry sees) is at least ``threshold``. On rows stored in the EK-FAC
whitened eigenbasis, ``graddot`` un-whitens each row by the basis's per-column ``√(Λ* + δ)`` (an
orthogonal rotation of the raw gradient remains, with its cosines). Exact text duplicates
(identical tokens and labels, by the 16-byte token hash the build stored) are grouped too.

Scales to millions of rows with bounded memory: one pass over the store writes a seeded Gaussian
sketch of each unit vector (``sketch`` numbers, a JL projection: sketched cosines are within about
``2/√sketch`` of the true ones); a k-nearest-neighbour search over the sketches proposes pairs
whose sketched cosine clears ``threshold - margin`` (exact FAISS flat search up to ``exact_max``
rows; beyond, :func:`ivf_neighbors`, an IVF self-join done as one matrix product per list); each
proposed pair is then checked exactly on the stored rows (in IVF-list order, so a list's rows are
read together, and skipping pairs whose members are already joined); union-find over the confirmed
pairs gives the groups. With ``sketch=0`` the candidates come from the full vectors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import faiss
import numpy as np
import torch

from gradindex.index.space import Preconditioners
from gradindex.methods import DEFAULT_DAMPING, default_method, index_row_base, parse_method
from gradindex.precondition.preconditioner import selected_layers
from gradindex.progress import progress_bar
from gradindex.spec.manifest import row_basis
from gradindex.store import Store
from gradindex.store.opened import OpenStore, opened
from gradindex.store.rows import RowReader

log = logging.getLogger("gradindex")

Space = Preconditioners | dict[str, np.ndarray]
"""What :func:`_whiten` applies: the fitted preconditioners, or per-layer column factors for ``unwhiten``."""


@dataclass(frozen=True)
class DedupConfig:
    threshold: float | None = None
    """Cosine at or above which two examples' gradients count as near-duplicates; None: 0.6 for
    ``graddot``, 0.5 for whitened gradients (``kfac``/``ekfac``, and the rows of an index stored in
    the EK-FAC eigenbasis). 0.6 groups 90% of planted near copies (two words replaced) and no pair
    of different paragraphs on one topic (benchmarks/audit.py; with ``method='ekfac'``, 0.5 groups
    all near copies and no topic pair)."""
    method: str | None = None
    """``graddot`` (raw gradients; on an index stored in the EK-FAC eigenbasis, the rows un-whitened by the
    basis's column scale: exact on float32 rows, within about 0.03 on int4 codes) or ``kfac``/``ekfac``
    (whitened by ``H^{-1/2}`` first); None: ``graddot``, or ``ekfac`` on an index stored in the EK-FAC
    eigenbasis (as ``gradindex dedup``; there ekfac at 0.5 groups 87% of near copies and no topic pair,
    graddot at 0.6 83%: benchmarks/audit.py ``dedup_default``)."""
    damping: float = DEFAULT_DAMPING
    """Relative damping of the whitening."""
    neighbors: int = 16
    """Nearest neighbours proposed per example (a group larger than this is still found through
    chains of pairs)."""
    sketch: int = 256
    """Numbers per example in the candidate sketch; 0 = search the full vectors."""
    margin: float = 0.05
    """Candidates need a sketched cosine of at least ``threshold - margin``. A sketched cosine
    ``c`` errs by about ``(1 - c²)/√sketch`` (0.006 at c = 0.95, 0.02 at c = 0.8 with 256 numbers),
    so 0.05 loses almost no pair above the threshold."""
    seed: int = 0
    block: int = 8192
    """Rows (and proposed pairs) per step, at most."""
    block_bytes: int = 64 << 20
    """Bytes of float32 rows read at once, at most: wide rows make smaller blocks (else a block was the whole
    store below ``block`` rows, the audit's RSS growing with every example)."""
    exact_max: int = 50_000
    """Up to this many rows the candidates are each row's exact nearest neighbours (FAISS flat search);
    beyond, an IVF self-join proposes them (:func:`ivf_neighbors`)."""
    nprobe: int = 8
    """Beyond ``exact_max`` rows: the IVF lists (of about ``√(nprobe·N)``) each row's neighbours are
    looked for in. A pair is proposed when either member's lists hold the other. 8 finds 99.99% of the
    exact kNN pairs at the threshold on the scale benchmark (4: 99.8%; docs/audit.md)."""

    @property
    def cut(self) -> float:
        """The cosine threshold in use (``threshold``, or the method's default)."""
        if self.threshold is not None:
            return float(self.threshold)
        return 0.6 if parse_method(self.method or "graddot")[0] == "graddot" else 0.5

    def __post_init__(self) -> None:
        if not -1.0 <= self.cut <= 1.0:
            raise ValueError(f"--threshold is a cosine in [-1, 1], got {self.threshold}")
        if self.neighbors < 1 or self.sketch < 0 or self.nprobe < 1 or self.block < 1 or self.block_bytes < 1:
            raise ValueError("--neighbors, nprobe, block and block_bytes must be >= 1 and --sketch >= 0")
        base, selfnorm = parse_method(self.method or "graddot")
        if selfnorm or base == "cosine":
            raise ValueError(f"dedup compares normalised gradients; --method is graddot, kfac or ekfac, "
                             f"not {self.method!r}")


@dataclass
class Group:
    ids: list[int]
    kind: str
    """``exact`` (identical tokens), ``near`` (gradient cosine ≥ threshold) or ``exact+near``."""
    min_cosine: float | None
    """Smallest exact cosine of the confirmed pairs that joined the group (``None`` for exact-only groups;
    pairs whose members were already joined are not checked)."""

    @property
    def keep(self) -> int:
        return min(self.ids)

    def to_dict(self) -> dict:
        return {"ids": self.ids, "keep": self.keep, "drop": [i for i in self.ids if i != self.keep],
                "kind": self.kind, "min_cosine": self.min_cosine}


@dataclass
class DedupResult:
    groups: list[Group]
    n: int
    config: DedupConfig
    pairs_proposed: int = 0
    pairs_confirmed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    pairs_checked: int = 0
    """Proposed pairs whose exact cosine was computed (the others' members were already joined)."""

    def keep_mask(self) -> np.ndarray:
        """``[N]`` bool: the suggested keep-list (all but one member of each group dropped)."""
        keep = np.ones(self.n, dtype=bool)
        for g in self.groups:
            keep[[i for i in g.ids if i != g.keep]] = False
        return keep


def _roots(parent: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Roots of ``idx`` in the forest ``parent`` (``parent[i] <= i``), compressing the paths walked."""
    r = parent[idx]
    while True:
        up = parent[r]
        if (up == r).all():
            break
        r = up
    parent[idx] = r
    return r


def _union(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Join the sets of every pair ``(a[i], b[i])``; a set's root is its smallest member."""
    while len(a):
        ra, rb = _roots(parent, a), _roots(parent, b)
        m = ra != rb
        if not m.any():
            return
        a, b, ra, rb = a[m], b[m], ra[m], rb[m]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))  # hook roots; clashes retry


def rows_per_block(cfg: DedupConfig, width: int) -> int:
    """Rows per read: at most ``cfg.block`` rows and ``cfg.block_bytes`` of float32 rows ``width`` numbers wide."""
    return max(1, min(cfg.block, cfg.block_bytes // (4 * max(1, width))))


def _unit_rows(rows: dict[str, np.ndarray], layers: Sequence[str], pre: Space, method: str,
               damping: float) -> np.ndarray:
    """``[n, D_total]`` float32 unit vectors of store rows (concatenated over layers, whitened for kfac/ekfac)."""
    v = np.concatenate([_whiten(rows, n, pre, method, damping) for n in layers], axis=1)
    norm = np.linalg.norm(v, axis=1, keepdims=True)
    return np.where(norm > 0, v / np.where(norm > 0, norm, 1.0), 0.0).astype(np.float32)


UNWHITEN = "unwhiten"
"""The operation on rows stored in the EK-FAC eigenbasis that answers ``graddot`` (:func:`_space`)."""


def _whiten(rows: dict[str, np.ndarray], n: str, pre: Space, method: str, damping: float) -> np.ndarray:
    """One layer's ``[n, D]`` float32 rows, multiplied by ``H^{-1/2}`` for kfac/ekfac, or by the per-column
    ``√(Λ* + δ)`` for ``unwhiten`` (eigenbasis rows back to a rotation of the raw gradient: same cosines)."""
    x = np.ascontiguousarray(rows[n], dtype=np.float32)
    if method == "graddot":
        return x
    if method == UNWHITEN:
        return x * pre[n]
    return pre.apply(method, n, torch.from_numpy(x), -0.5, damping).numpy()


def _sketch_rows(rows: dict[str, np.ndarray], layers: Sequence[str], pre: Space, method: str,
                 damping: float, R: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``([n, d] unit sketches, [n] nonzero)``: ``Σ_layers x R`` normalised (the row's own norm cancels)."""
    out, nonzero = None, None
    for n in layers:
        x = _whiten(rows, n, pre, method, damping)
        nz = (x != 0).any(1)
        nonzero = nz if nonzero is None else nonzero | nz
        out = x @ R[n] if out is None else out + x @ R[n]
    nrm = np.linalg.norm(out, axis=1, keepdims=True)
    return np.where(nrm > 0, out / np.where(nrm > 0, nrm, 1.0), 0.0).astype(np.float32), nonzero


def find_duplicates(index_dir: str | os.PathLike | OpenStore, cfg: DedupConfig = DedupConfig(),
                    layers: Sequence[str] | None = None, progress: bool = False) -> DedupResult:
    """Groups of exact and near-duplicate training examples (module doc); ``index_dir`` a path or an open index."""
    import time

    t0 = time.perf_counter()
    with opened(index_dir, "deduplicate") as ix:
        cfg = resolved(ix, cfg)
        layers, base, pre = _space(ix, cfg, layers)
        store = ix.store
        N = len(store)
        vecs, nonzero, sketched = _vectors(store, layers, pre, base, cfg, progress)
        t1 = time.perf_counter()
        pairs = _candidate_pairs(vecs, nonzero, cfg, candidate_floor(cfg, sketched))
        del vecs
        t2 = time.perf_counter()
        parent = np.arange(N)
        confirmed, cosines, checked = _confirm(store, layers, pre, base, cfg, pairs, parent)
        hashes = store.column("token_hash")
    t3 = time.perf_counter()
    groups = _groups(parent, confirmed, cosines, hashes)
    secs = {"vectors": t1 - t0, "search": t2 - t1, "confirm": t3 - t2, "total": time.perf_counter() - t0}
    log.info("dedup: %d pairs proposed, %d checked, %d confirmed, %d groups", len(pairs), checked, len(confirmed),
             len(groups))
    return DedupResult(groups, N, cfg, len(pairs), len(confirmed), secs, checked)


def candidate_floor(cfg: DedupConfig, sketched: bool = True) -> float:
    """The similarity a pair needs in the candidate search: ``threshold - margin`` on sketches."""
    return cfg.cut - (cfg.margin if sketched else 1e-4)


def candidate_vectors(index_dir: str | os.PathLike | OpenStore, cfg: DedupConfig = DedupConfig(),
                      layers: Sequence[str] | None = None, progress: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, bool]:
    """``([N, d] unit vectors searched for candidates, [N] nonzero, sketched)`` as :func:`find_duplicates`
    makes them (for measurements of the candidate search)."""
    with opened(index_dir, "deduplicate") as ix:
        cfg = resolved(ix, cfg)
        layers, base, pre = _space(ix, cfg, layers)
        return _vectors(ix.store, layers, pre, base, cfg, progress)


def resolved(ix: OpenStore, cfg: DedupConfig) -> DedupConfig:
    """``cfg`` with its method set: when None, the first of graddot, ekfac, kfac the index answers."""
    return cfg if cfg.method is not None else replace(cfg, method=default_method(ix.manifest, ix.dir, app="dedup"))


def _space(ix: OpenStore, cfg: DedupConfig, layers: Sequence[str] | None
           ) -> tuple[list[str], str, Space]:
    """``(layers, row method, preconditioners)``: the method applied to the stored rows (whitened rows: ekfac
    is their plain cosine). ``graddot`` on rows in the EK-FAC eigenbasis, ``W = (Q_Sᵀ G Q_A) ⊙ (Λ* + δ)^{-1/2}``,
    is ``unwhiten``: ``W ⊙ √(Λ* + δ) = Q_Sᵀ G Q_A`` is an orthogonal rotation of the raw gradient ``G``, so its
    cosines are the raw gradients' (the preconditioners are then layer → ``[D]`` ``√(Λ* + δ)``)."""
    manifest, index_dir = ix.manifest, ix.dir
    layers = selected_layers(manifest, layers)
    base = parse_method(cfg.method)[0]
    if base == "graddot" and row_basis(manifest) == "ekfac":
        basis = ix.basis
        return layers, UNWHITEN, {n: (1.0 / basis.scale[n]).astype(np.float32).reshape(-1) for n in layers}
    base = index_row_base(manifest, index_dir, base, cfg.method)
    pre = Preconditioners(ix)
    if base != "graddot":
        pre.check(base)
    return layers, base, pre


def _vectors(store: Store, layers: Sequence[str], pre: Space, method: str, cfg: DedupConfig,
             progress: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """One pass over the store: every row's unit vector, or its unit sketch when ``cfg.sketch`` is smaller."""
    N = len(store)
    total = sum(store.dims[n] for n in layers)
    d = cfg.sketch if 0 < cfg.sketch < total else total
    R = None
    if d < total:
        rng = np.random.default_rng(cfg.seed)
        G = (rng.standard_normal((total, d)) / np.sqrt(d)).astype(np.float32)
        R = dict(zip(layers, np.split(G, np.cumsum([store.dims[n] for n in layers])[:-1]), strict=True))
    vecs = np.empty((N, d), dtype=np.float32)
    nonzero = np.zeros(N, dtype=bool)
    with progress_bar(total=N, unit="ex", desc="dedup: vectors", disable=not progress) as bar:
        for ids, blk in store.iter_blocks(layers, rows_per_block(cfg, total)):
            if R is None:
                u = _unit_rows(blk, layers, pre, method, cfg.damping)
                vecs[ids], nonzero[ids] = u, np.abs(u).sum(1) > 0
            else:
                vecs[ids], nonzero[ids] = _sketch_rows(blk, layers, pre, method, cfg.damping, R)
            bar.update(len(ids))
    return vecs, nonzero, R is not None


def _candidate_pairs(vecs: np.ndarray, nonzero: np.ndarray, cfg: DedupConfig, floor: float) -> np.ndarray:
    """``[P, 2]`` unique pairs ``i < j`` among each row's neighbours with cosine ≥ ``floor``.

    Up to ``cfg.exact_max`` live rows the neighbours are exact (FAISS flat search); beyond, they come from
    :func:`ivf_neighbors` and the pairs are ordered by the IVF list of their first member, so that the
    exact confirmation reads each list's rows together."""
    live = np.nonzero(nonzero)[0]
    if len(live) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    x = vecs if len(live) == len(vecs) else np.ascontiguousarray(vecs[live])
    d = x.shape[1]
    k = min(cfg.neighbors + 1, len(live))
    lists = None
    if len(live) <= cfg.exact_max:
        index = faiss.IndexFlatIP(d)
        index.add(x)
        sims, nbr = [], []
        for s in range(0, len(live), cfg.block):
            ss, nn = index.search(x[s:s + cfg.block], k)
            sims.append(ss)
            nbr.append(nn)
        sims, nbr = np.concatenate(sims), np.concatenate(nbr)
    else:
        sims, nbr, lists = ivf_neighbors(x, k - 1, floor, cfg.nprobe, cfg.seed, cfg.block)
    rows = np.repeat(np.arange(len(live)), nbr.shape[1])
    ok = (nbr.ravel() >= 0) & (sims.ravel() >= floor) & (nbr.ravel() != rows)
    a, b = rows[ok], nbr.ravel()[ok]
    pairs = np.unique(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1), axis=0)
    if lists is not None and len(pairs):
        pairs = pairs[np.argsort(lists[pairs[:, 0]], kind="stable")]
    return live[pairs]


KMEANS_POINTS, KMEANS_ITER = 32, 10
"""Training of the self-join's lists: rows sampled per list, k-means iterations."""


def ivf_lists(n: int, nprobe: int) -> int:
    """IVF lists of the self-join over ``n`` rows: the power of two nearest ``√(nprobe·n)``, 16 to n/16."""
    return int(max(16, min(2 ** round(np.log2(np.sqrt(max(1, nprobe * n)))), n // 16, 65536)))


def ivf_neighbors(x: np.ndarray, k: int, floor: float, nprobe: int = 8, seed: int = 0, block: int = 8192,
                  nlist: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Approximate ``k`` nearest neighbours (inner product, self excluded) of every row of ``x`` among the rows
    of its ``nprobe`` nearest IVF lists, keeping only similarities ≥ ``floor``.

    Spherical k-means (10 iterations on ≤ 32 rows a list) makes ``nlist`` lists (default :func:`ivf_lists`);
    each row joins the list of its nearest centroid and probes its ``nprobe`` nearest. Per list, the rows that
    probe it are scored against its members by one matrix product (BLAS: the multiply-adds of FAISS's IVF
    scan, about 3x faster each on a 2-core CPU), and a running top-k per row keeps the best. Returns
    ``(sims [N, k] float32, ids [N, k] int64 (-1: none ≥ floor), list [N])``."""
    N, d = x.shape
    nlist = max(1, min(nlist or ivf_lists(N, nprobe), N))
    nprobe = min(nprobe, nlist)
    rng = np.random.default_rng(seed)
    km = faiss.Kmeans(d, nlist, niter=KMEANS_ITER, spherical=True, seed=seed, max_points_per_centroid=KMEANS_POINTS,
                      min_points_per_centroid=1)
    km.train(x[np.sort(rng.choice(N, min(N, KMEANS_POINTS * nlist), replace=False))])
    quant = faiss.IndexFlatIP(d)
    quant.add(km.centroids)
    probes = np.concatenate([quant.search(x[s:s + block], nprobe)[1] for s in range(0, N, block)])
    own = probes[:, 0]
    members = np.argsort(own, kind="stable")
    mb = np.searchsorted(own[members], np.arange(nlist + 1))
    pos = np.empty(N, dtype=np.int64)
    pos[members] = np.arange(N) - mb[own[members]]  # a row's place in its own list
    flat = probes.ravel()
    by_list = np.argsort(flat, kind="stable")
    probers = by_list // nprobe  # rows, grouped by the list they probe
    pb = np.searchsorted(flat[by_list], np.arange(nlist + 1))
    top_s = np.full((N, k), -np.inf, dtype=np.float32)
    top_i = np.full((N, k), -1, dtype=np.int64)
    qstep, xstep = max(1, block // 4), block
    for li in range(nlist):
        xi = members[mb[li]:mb[li + 1]]
        if len(xi) == 0:
            continue
        X = x[xi]
        for qs in range(pb[li], pb[li + 1], qstep):
            qi = probers[qs:min(qs + qstep, pb[li + 1])]
            Q = x[qi]
            mine = np.nonzero(own[qi] == li)[0]
            for xs in range(0, len(xi), xstep):
                S = Q @ X[xs:xs + xstep].T
                m = mine[(pos[qi[mine]] >= xs) & (pos[qi[mine]] < xs + xstep)]
                S[m, pos[qi[m]] - xs] = -np.inf  # not oneself
                hit = np.nonzero((S >= floor).any(1))[0]
                if not len(hit):
                    continue
                S = S[hit]
                kk = min(k, S.shape[1])
                j = np.argpartition(-S, kk - 1, axis=1)[:, :kk] if S.shape[1] > kk else \
                    np.broadcast_to(np.arange(kk), S.shape)
                r = qi[hit]
                cs = np.concatenate([top_s[r], np.take_along_axis(S, j, 1)], 1)
                ci = np.concatenate([top_i[r], xi[xs + j]], 1)
                best = np.argpartition(-cs, k - 1, axis=1)[:, :k]
                top_s[r], top_i[r] = np.take_along_axis(cs, best, 1), np.take_along_axis(ci, best, 1)
    top_i[~(top_s >= floor)] = -1
    return top_s, top_i, own


def _confirm(store: Store, layers, pre, method, cfg: DedupConfig, pairs: np.ndarray, parent: np.ndarray):
    """The pairs whose exact cosine (from the stored rows) is ≥ the threshold, those cosines, and how many
    pairs were checked. Confirmed pairs are joined in ``parent`` (:func:`_union`) as they come, and a pair
    whose members are already joined is not checked (it would not change the groups)."""
    keep, cos, checked = [np.zeros((0, 2), dtype=np.int64)], [np.zeros(0)], 0
    reader = RowReader(store, list(layers))
    step = max(1, cfg.block // 2)
    for s in range(0, len(pairs), step):
        p = pairs[s:s + step]
        p = p[_roots(parent, p[:, 0]) != _roots(parent, p[:, 1])]
        if not len(p):
            continue
        checked += len(p)
        sub = max(1, rows_per_block(cfg, sum(store.dims[n] for n in layers)) // 2)  # (two rows a pair)
        c = np.concatenate([_cosines(reader, layers, pre, method, cfg, p[a:a + sub]) for a in range(0, len(p), sub)])
        ok = c >= cfg.cut
        keep.append(p[ok])
        cos.append(c[ok])
        _union(parent, p[ok, 0], p[ok, 1])
    return np.concatenate(keep), np.concatenate(cos), checked


def _cosines(reader: RowReader, layers, pre, method: str, cfg: DedupConfig, p: np.ndarray) -> np.ndarray:
    """``[P]`` exact cosines of the pairs ``p`` from their stored rows (whitened as the method asks)."""
    ids, inv = np.unique(p.ravel(), return_inverse=True)
    rows = reader.read(ids)
    inv = inv.reshape(-1, 2)
    dot, sq = np.zeros(len(p)), np.zeros(len(ids))
    for n in layers:
        x = _whiten(rows, n, pre, method, cfg.damping).astype(np.float64)
        sq += np.einsum("ij,ij->i", x, x)
        dot += np.einsum("ij,ij->i", x[inv[:, 0]], x[inv[:, 1]])
    nrm = np.sqrt(sq)
    den = nrm[inv[:, 0]] * nrm[inv[:, 1]]
    return np.where(den > 0, dot / np.where(den > 0, den, 1.0), 0.0)


def _groups(parent: np.ndarray, pairs: np.ndarray, cosines: np.ndarray, hashes: np.ndarray) -> list[Group]:
    """Groups of two or more: the sets of ``parent`` (joined by the confirmed ``pairs``) joined by identical
    token hashes."""
    n = len(parent)
    h = np.ascontiguousarray(hashes).view(np.dtype((np.void, hashes.shape[1]))).ravel()
    _, inv, counts = np.unique(h, return_inverse=True, return_counts=True)
    exact = counts[inv] > 1  # [N] rows whose tokens occur more than once
    first = np.full(len(counts), n, dtype=np.int64)
    np.minimum.at(first, inv, np.arange(n))
    dup = np.nonzero(exact)[0]
    _union(parent, dup, first[inv[dup]])
    while True:  # every row straight to its root (pointer doubling)
        up = parent[parent]
        if (up == parent).all():
            break
        parent[:] = up
    roots = parent
    near_min = np.full(n, np.inf)
    if len(pairs):
        np.minimum.at(near_min, roots[pairs[:, 0]], np.minimum(cosines, 1.0))
    size = np.bincount(roots, minlength=n)
    grouped = np.nonzero(size[roots] > 1)[0]  # ascending, so each group's ids come sorted
    order = grouped[np.argsort(roots[grouped], kind="stable")]
    out = []
    for members in np.split(order, np.nonzero(np.diff(roots[order]))[0] + 1) if len(order) else []:
        r = int(roots[members[0]])
        ex = bool(exact[members].any())
        near = bool(np.isfinite(near_min[r]))
        kind = "exact+near" if ex and near else ("exact" if ex else "near")
        out.append(Group(members.tolist(), kind, float(near_min[r]) if near else None))
    return sorted(out, key=lambda g: g.ids[0])
