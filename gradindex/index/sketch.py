"""The first tier of a two-tier index: a small in-RAM sketch of every example's whole-model row.

Each layer's index-space vector ``x_l`` (``D_l`` numbers) is sketched by a seeded CountSketch
``S_l`` to ``m_l`` numbers: coordinate ``j`` goes to bucket ``h_l(j)`` with sign ``σ_l(j) = ±1``,
``(S_l x)_b = Σ_{h(j)=b} σ(j) x_j``. A layer no wider than its share keeps its coordinates
(``S_l = I``). The parts are concatenated, ``y = [S_1 x_1, ..., S_L x_L]`` (``m = Σ m_l``
numbers, block-diagonal), so

* ``⟨y_q, y_t⟩ = Σ_l ⟨S_l q_l, S_l t_l⟩`` is an unbiased estimate of the whole-model score
  ``Σ_l ⟨q_l, t_l⟩`` (the signs are independent: ``E[σ_i σ_j] = 0`` for ``i ≠ j``), with variance
  ``Σ_l (‖q_l‖²‖t_l‖² + ⟨q_l, t_l⟩² - 2 Σ_j q_lj² t_lj²) / m_l ≤ 2 Σ_l ‖q_l‖²‖t_l‖² / m_l``;
* a search restricted to some layers zeroes the query's other parts (the per-layer parts are kept);
* ``m_l`` is allotted in proportion to the layer's mean squared norm (at least :data:`MIN_PART`),
  which for queries like the rows minimises that variance for a given ``m`` and makes every
  coordinate about equally large, so one int8 scale per row serves all parts.

Codes: ``int8`` with one float32 scale per row (:func:`gradindex.store.codes.encode`), stored in
FAISS's ``QT_8bit_direct_signed`` layout (``code + 128``). The scan wants every row's score (the
per-row scale and the method's per-example factors come after the product, so no top-k search can
stand in for it). It is one integer matrix product, ``torch._int_mm`` (int8 x int8 -> int32, exact),
of the query split in two int8 levels, ``y ≈ f₁ q₁ + f₂ q₂`` with ``q₁ = round(y / f₁)`` and ``q₂`` the
rounded remainder (relative rounding ~``(1/254)²``, far below the sketch's own error): 0.44 s per 10⁶
rows and query on one thread of an AVX-512 Xeon, 4.1x faster than FAISS's kernel asked for all ``N``
scores (``benchmarks/results/sketch_scan.json``). Not every CPU has a fast ``torch._int_mm``: on an
AVX2-only EPYC it ran ~100x slower than float32 (3.8 s a query at 10⁶). So the kernel is chosen once per
process (:func:`scan_kernel`) by timing both on a small block: ``int8``, or ``float``, which converts
1,024 rows at a time to float32 and multiplies them by the same two int8 levels, 1,024 columns a product (exact
in float32, added in float64): the same integers, so the same scores bit for bit, whichever kernel a process
(or a rank) took; about twice the int8 time where ``torch._int_mm`` is fast. ``GRADINDEX_SKETCH_KERNEL=int8|float``
fixes it. The top candidates are then re-ranked exactly from the store (:mod:`gradindex.query.search`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gradindex.errors import CorruptFileError
from gradindex.index.scan import level_factor
from gradindex.store.codes import encode

SKETCH_BYTES = 2048
"""Bytes per example of the default sketch (int8 numbers plus a 4-byte scale)."""
MIN_PART = 8
"""Fewest sketch numbers a layer gets (all of its coordinates when it has fewer)."""


def allocate(dims: dict[str, int], energy: dict[str, float], total: int) -> dict[str, int]:
    """``m_l`` per layer: ``total`` numbers shared in proportion to ``energy``, each at most ``D_l``
    and at least ``min(D_l, MIN_PART)``; what a full layer cannot take goes to the others."""
    m = {n: min(d, MIN_PART) for n, d in dims.items()}
    left = total - sum(m.values())
    open_ = [n for n in dims if m[n] < dims[n]]
    while left > 0 and open_:
        e = np.array([max(energy.get(n, 0.0), 1e-30) for n in open_], np.float64)
        want = np.floor(e / e.sum() * left).astype(np.int64)
        if want.sum() == 0:
            want[np.argmax(e)] = left
        for n, w in zip(open_, want.tolist(), strict=True):
            take = min(w, dims[n] - m[n])
            m[n] += take
            left -= take
        open_ = [n for n in open_ if m[n] < dims[n]]
    return m


def _layer_seed(seed: int, layer: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"sketch/{seed}/{layer}".encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class LayerSketch:
    """One layer's CountSketch ``S_l``: ``D`` coordinates into ``m`` buckets (``m = D``: identity)."""

    D: int
    m: int
    perm: np.ndarray | None = None
    """Coordinates ordered by bucket ``[D]``."""
    signs: np.ndarray | None = None
    """``σ`` of the coordinates in that order ``[D]`` float32."""
    starts: np.ndarray | None = None
    """First position of each bucket in ``perm`` ``[m]``."""

    @classmethod
    def make(cls, seed: int, layer: str, D: int, m: int) -> LayerSketch:
        if m >= D:
            return cls(D, D)
        rng = np.random.default_rng(_layer_seed(seed, layer))
        bucket = rng.permutation(np.concatenate([np.arange(m), rng.integers(0, m, D - m)]))  # every bucket used
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=D)
        perm = np.argsort(bucket, kind="stable")
        starts = np.searchsorted(bucket[perm], np.arange(m))
        return cls(D, m, perm, sign[perm], starts)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``[n, m]`` float32 ``S x`` for rows ``x`` ``[n, D]``."""
        x = np.asarray(x, np.float32)
        if self.perm is None:
            return x
        return np.add.reduceat(x[:, self.perm] * self.signs, self.starts, axis=1)


class Sketch:
    """The whole-model sketch: every layer's part, concatenated in layer order."""

    def __init__(self, seed: int, dims: dict[str, int], parts: dict[str, int]):
        self.seed, self.dims, self.parts = int(seed), dict(dims), dict(parts)
        self.layers = list(parts)
        self.m = int(sum(parts.values()))
        self.offsets = dict(zip(self.layers, np.cumsum([0] + [parts[n] for n in self.layers])[:-1].tolist(),
                                strict=True))
        self._layer = {n: LayerSketch.make(seed, n, dims[n], parts[n]) for n in self.layers}

    def to_dict(self) -> dict:
        return {"seed": self.seed, "dims": self.dims, "parts": self.parts, "m": self.m}

    @classmethod
    def from_dict(cls, d: dict) -> Sketch:
        return cls(d["seed"], d["dims"], d["parts"])

    def apply(self, x: dict[str, np.ndarray], layers: list[str] | None = None) -> np.ndarray:
        """``[n, m]`` float32 sketch of per-layer rows ``x`` (parts of layers not in ``layers`` are zero)."""
        chosen = set(layers or self.layers)
        n = len(next(iter(x.values())))
        out = np.zeros((n, self.m), np.float32)
        for name in self.layers:
            if name in chosen:
                o = self.offsets[name]
                out[:, o:o + self.parts[name]] = self._layer[name].apply(x[name])
        return out


def encode_sketch(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes [n, m] uint8 in FAISS's direct-signed layout, scales [n] float32)`` of sketches ``y``."""
    codes, scales = encode(y, "int8")
    return codes.view(np.uint8) ^ np.uint8(0x80), scales


class SketchIndex:
    """The sketch codes of every example in RAM (int8 ``[N, m]``) and their scores against query sketches."""

    def __init__(self, sketch: Sketch, codes: np.ndarray, scales: np.ndarray, block: int = 1 << 16):
        self.sketch, self.n = sketch, len(codes)
        self.scales = np.asarray(scales, np.float32)
        self.codes = torch.empty((self.n, sketch.m), dtype=torch.int8)
        dest = self.codes.numpy().view(np.uint8)
        path = getattr(codes, "filename", None)
        if isinstance(codes, np.memmap) and path and codes.flags.c_contiguous:
            read_into(Path(path), int(codes.offset), dest)  # plain reads: no mapped page joins the RSS
        else:
            for s in range(0, self.n, block):
                dest[s:s + block] = np.asarray(codes[s:s + block]).view(np.uint8)
        for s in range(0, self.n, block):  # FAISS's code + 128 → int8, in place
            dest[s:s + block] ^= np.uint8(0x80)
        self.kernel = scan_kernel(sketch.m)

    def nbytes(self) -> int:
        return int(self.n * (self.sketch.m + 4))

    def scores(self, yq: np.ndarray, batch: int = 8) -> np.ndarray:
        """``[Q, N]`` float32 sketch scores ``⟨y_q, ŷ_t⟩`` of query sketches ``yq`` ``[Q, m]``."""
        out = np.empty((len(yq), self.n), np.float32)
        for s in range(0, len(yq), batch):
            out[s:s + batch] = self.unscaled(np.asarray(yq[s:s + batch], np.float32), [(0, self.n)])
        out *= self.scales[None, :]
        return out

    def unscaled(self, q: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
        """``[Q, Σ (hi - lo)]`` float32 scores, before the rows' scales, of the rows ``lo:hi`` of each run, in
        order, by this process's kernel (module doc)."""
        if self.kernel == "int8":
            try:
                return _int8_product(self.codes, q, runs)
            except RuntimeError:  # a shape this build of torch refuses: the float kernel from now on
                self.kernel = "float"
        return _float_product(self.codes, q, runs)


def _int8_product(codes: torch.Tensor, q: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
    """:meth:`SketchIndex.unscaled` by one exact int8 product of the query's two levels per run."""
    levels, f = split_levels(q)  # [2Q, m] int8, [2Q]
    lv = torch.from_numpy(levels)
    out = np.empty((len(q), sum(hi - lo for lo, hi in runs)), np.float32)
    at = 0
    for lo, hi in runs:
        out[:, at:at + hi - lo] = _join_levels(torch._int_mm(lv, codes[lo:hi].t()).numpy(), f)  # [2Q, run] int32
        at += hi - lo
    return out


def _join_levels(d: np.ndarray, f: np.ndarray) -> np.ndarray:
    """``[Q, n]`` float32 ``f₁ d₁ + f₂ d₂`` of the two levels' integer products ``d`` ``[2Q, n]`` (factors ``f``)."""
    Q = len(d) // 2
    out = d[:Q].astype(np.float32) * f[:Q, None]
    out += d[Q:].astype(np.float32) * f[Q:, None]
    return out


FLOAT_BLOCK = 1024
"""Rows the float kernel converts at a time."""
EXACT_COLUMNS = 1024
"""Columns of one float32 product of int8 levels and codes: ``1024 × 127²`` < ``2²⁴``, so its sums are exact."""


def _float_product(codes: torch.Tensor, q: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
    """:meth:`SketchIndex.unscaled` by float32 products of the same two int8 levels as :func:`_int8_product`,
    :data:`FLOAT_BLOCK` rows converted at a time and :data:`EXACT_COLUMNS` columns a product (each exact, added in
    float64): the same integers, so the same scores, bit for bit; the kernel changes the speed alone."""
    levels, f = split_levels(q)
    lv, Q, m = torch.from_numpy(levels).to(torch.float32), len(q), codes.shape[1]
    cuts = [(c, min(m, c + EXACT_COLUMNS)) for c in range(0, m, EXACT_COLUMNS)]
    buf = torch.empty((FLOAT_BLOCK, m), dtype=torch.float32)
    d = torch.zeros((2 * Q, sum(hi - lo for lo, hi in runs)), dtype=torch.float64)
    at = 0
    for lo, hi in runs:
        for s in range(lo, hi, FLOAT_BLOCK):
            b = buf[:min(FLOAT_BLOCK, hi - s)]
            b.copy_(codes[s:s + len(b)])
            for c0, c1 in cuts:
                d[:, at:at + len(b)] += lv[:, c0:c1] @ b[:, c0:c1].t()
            at += len(b)
    return _join_levels(d.numpy(), f)


def read_into(path: Path, offset: int, dest: np.ndarray, block_bytes: int = 64 << 20) -> None:
    """Fill the contiguous array ``dest`` with the bytes of ``path`` from ``offset``, a block at a time (a memory
    map read end to end counts every page in the process's RSS: 2 GB more at open for 10^6 sketches)."""
    flat = dest.reshape(-1).view(np.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        for s in range(0, len(flat), block_bytes):
            view = memoryview(flat[s:s + block_bytes])
            got = f.readinto(view)
            if got != len(view):
                raise CorruptFileError(f"{str(path)!r} ended {len(view) - (got or 0)} bytes early (a torn sketch file)")


def split_levels(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q`` ``[Q, m]`` as ``f₁ q₁ + f₂ q₂`` (int8 levels stacked ``[2Q, m]``, factors ``[2Q]``)."""
    out, fs, r = [], [], np.asarray(q, np.float64)
    for _ in range(2):
        f = level_factor(r)
        lv = np.clip(np.rint(r / f[:, None]), -127, 127)
        out.append(lv.astype(np.int8))
        fs.append(f)
        r = r - lv * f[:, None]
    return np.ascontiguousarray(np.concatenate(out)), np.concatenate(fs).astype(np.float32)


@functools.cache
def _int_mm_works(m: int) -> bool:
    """Whether ``torch._int_mm`` multiplies int8 ``[2, m]`` by the transpose of a ``[5, m]`` block exactly
    (the scan's layout). torch 2.13's CPU kernel returns garbage for ``m = 1``, so that is refused too."""
    if m < 2:
        return False
    try:
        a = torch.arange(2 * m, dtype=torch.int64).reshape(2, m) % 255 - 127
        b = torch.arange(5 * m, dtype=torch.int64).reshape(5, m) % 253 - 126
        return bool(torch.equal(torch._int_mm(a.to(torch.int8), b.to(torch.int8).t()).long(), a @ b.t()))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


KERNEL_ENV = "GRADINDEX_SKETCH_KERNEL"
"""Fixes the sketch scan's kernel: ``int8``, ``float`` or ``auto`` (the default: timed, :func:`scan_kernel`)."""
SLOWER = 1.5
"""``auto`` takes ``float`` only where ``torch._int_mm`` is this many times slower than it (fast int8 CPUs:
2-4x faster; the AVX2-only EPYC measured: ~100x slower), so a noisy timing does not flip the choice."""


def kernel_setting() -> str:
    """:data:`KERNEL_ENV`'s value (``auto`` unset), checked: a tier calls it before it reads any code, so a wrong value
    is named as such (not as an unreadable index)."""
    want = (os.environ.get(KERNEL_ENV) or "auto").strip().lower()
    if want not in ("int8", "float", "auto"):
        raise ValueError(f"{KERNEL_ENV}={want!r} is not a sketch kernel: set it to int8, float or auto (timed)")
    return want


def scan_kernel(m: int) -> str:
    """The sketch scan's kernel for ``m`` numbers a row: ``int8`` (``torch._int_mm``) or ``float``; both give the
    same scores (``float`` where ``torch._int_mm`` is wrong for ``m``: its CPU kernel at ``m = 1``)."""
    want = kernel_setting()
    if want == "float" or not _int_mm_works(m):
        return "float"
    return "int8" if want == "int8" else _timed_kernel(m, torch.get_num_threads())


@functools.cache
def _timed_kernel(m: int, threads: int) -> str:
    """``int8`` unless ``torch._int_mm`` takes :data:`SLOWER` times the float kernel's time on 2,048 random rows
    and 8 queries here (best of 3 each)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (2 * FLOAT_BLOCK, m), dtype=torch.int8, generator=g)
    q = torch.randn((8, m), generator=g, dtype=torch.float32).numpy()

    def best(product) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            product(codes, q, [(0, len(codes))])
            times.append(time.perf_counter() - t)
        return min(times)

    return "float" if best(_int8_product) > SLOWER * best(_float_product) else "int8"
