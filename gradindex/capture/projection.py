"""Seeded factored projections, regenerated from (seed, layer name, side) and never stored.

The stream is produced from NumPy's PCG64 *bit generator* (whose raw output NumPy guarantees to
be stable across versions and platforms), turned into numbers by our own arithmetic, on the CPU,
in float64. So the same seed gives bit-identical matrices on CPU and GPU and across torch and
NumPy upgrades; ``tests/test_projection.py`` pins a few values per seed.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

PROJECTION_KINDS = ("gaussian", "rademacher", "none")
STREAM_VERSION = 1  # bump (and keep the old path) if the stream below ever has to change


@dataclass(frozen=True)
class ProjectionSpec:
    """How per-example gradients are compressed (docs/math.md, "Factored projection")."""

    kind: str = "gaussian"
    """``gaussian`` or ``rademacher`` entries with variance 1/k, or ``none`` for exact gradients."""
    k_a: int = 16
    """Rows of ``P_a`` (input side); ignored when ``kind == 'none'``."""
    k_g: int = 16
    """Rows of ``P_g`` (output-gradient side); ignored when ``kind == 'none'``."""
    seed: int = 0
    """Seed of the stream; with the layer's name and side it fixes every matrix."""
    sizes: tuple[tuple[str, int, int], ...] = ()
    """Per-layer ``(layer, k_a, k_g)`` overriding ``k_a``/``k_g`` (see :mod:`gradindex.capture.allocation`);
    a size of 0 leaves that side of that layer unprojected (exact)."""

    def __post_init__(self) -> None:
        if self.kind not in PROJECTION_KINDS:
            raise ValueError(f"projection kind {self.kind!r} is not one of {PROJECTION_KINDS}")
        if self.kind != "none" and not self.sizes and (self.k_a < 1 or self.k_g < 1):
            raise ValueError(f"projection sizes must be positive, got k_a={self.k_a}, k_g={self.k_g}")
        object.__setattr__(self, "sizes", tuple((str(n), int(a), int(g)) for n, a, g in self.sizes))
        bad = [s for s in self.sizes if s[1] < 0 or s[2] < 0]
        if bad:
            raise ValueError(f"per-layer projection sizes must be >= 0 (0 = exact side), got {bad}")

    @property
    def is_identity(self) -> bool:
        return self.kind == "none"

    def layer_sizes(self, layer: str) -> tuple[int, int]:
        """``(k_a, k_g)`` of one layer; 0 on a side means that side is not projected."""
        if self.is_identity:
            return 0, 0
        for n, ka, kg in self.sizes:
            if n == layer:
                return ka, kg
        if self.sizes:
            raise KeyError(f"layer {layer!r} has no size in this per-layer projection")
        return self.k_a, self.k_g

    def describe(self) -> str:
        """Short human form: ``16x16``, ``none`` or ``per-layer (N layers)``."""
        if self.is_identity:
            return "none"
        if self.sizes:
            return f"per-layer ({len(self.sizes)} layers)"
        return f"{self.k_a}x{self.k_g}"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "k_a": self.k_a, "k_g": self.k_g, "seed": self.seed}
        if self.sizes:
            d["sizes"] = {n: [ka, kg] for n, ka, kg in self.sizes}
        d["stream_version"] = STREAM_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ProjectionSpec:
        """The spec :meth:`to_dict` wrote (a manifest's ``build.projection``); one error for any bad one."""
        try:
            fields = dict(d)
            version = fields.pop("stream_version", STREAM_VERSION)
            if version == STREAM_VERSION:
                sizes = tuple((n, int(v[0]), int(v[1])) for n, v in (fields.pop("sizes", None) or {}).items())
                return cls(**fields, sizes=sizes)
            why = f"projection stream v{version}, this library draws v{STREAM_VERSION}"
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            why = f"a projection this library cannot read ({d!r}: {e})"
        raise ValueError(f"the index was built with {why}; install the gradindex version that built it, "
                         "or rebuild the index")

    @classmethod
    def parse(cls, text: str, kind: str = "gaussian", seed: int = 0) -> ProjectionSpec:
        """Parse the CLI form: ``K`` (square), ``KAxKG`` or ``none``."""
        text = str(text).strip().lower()
        if text == "none":
            return cls(kind="none", k_a=0, k_g=0, seed=seed)
        try:
            if "x" in text:
                ka, kg = (int(p) for p in text.split("x"))
            else:
                ka = kg = int(text)
        except ValueError:
            raise ValueError(
                f"projection {text!r} is not understood; use K (e.g. 16), KAxKG (e.g. 16x32) or none"
            ) from None
        return cls(kind=kind, k_a=ka, k_g=kg, seed=seed)


def _stream_seed(seed: int, layer: str, side: str) -> int:
    digest = hashlib.sha256(f"gradindex/v{STREAM_VERSION}/{seed}/{layer}/{side}".encode()).digest()
    return int.from_bytes(digest[:16], "little")


@functools.lru_cache(maxsize=512)
def _matrix_np(seed: int, layer: str, side: str, k: int, n: int, kind: str) -> np.ndarray:
    bits = np.random.PCG64(_stream_seed(seed, layer, side))
    if kind == "rademacher":
        raw = bits.random_raw(k * n)  # uint64
        signs = np.where((raw >> np.uint64(63)) == 1, 1.0, -1.0)
        out = signs / np.sqrt(k)
    elif kind == "gaussian":
        m = k * n
        raw = bits.random_raw(2 * ((m + 1) // 2)).reshape(2, -1)
        # 53-bit uniforms in (0, 1]; Box-Muller in float64.
        u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
        r = np.sqrt(-2.0 * np.log(u1))
        z = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[:m]
        out = z / np.sqrt(k)
    else:
        raise ValueError(f"no projection matrix for kind {kind!r}")
    return out.reshape(k, n).astype(np.float32)


def projection_matrix(
    spec: ProjectionSpec, layer: str, side: str, n: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``[k, n]`` matrix for one layer side (``'a'`` inputs, ``'g'`` output gradients)."""
    if side not in ("a", "g"):
        raise ValueError(f"side must be 'a' or 'g', got {side!r}")
    k_a, k_g = spec.layer_sizes(layer)
    k = k_a if side == "a" else k_g
    if k < 1:
        raise ValueError(f"side {side!r} of layer {layer!r} is not projected in this spec")
    arr = _matrix_np(spec.seed, layer, side, k, n, spec.kind)
    return torch.from_numpy(arr).to(device)
