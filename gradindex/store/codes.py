"""Row codes of the store: float32, float16, int8 or int4 with one float32 scale per row and layer.

* ``fp32``, ``fp16``: the values themselves (``[n, D]`` float32 / float16); no scale.
* ``int8``: symmetric absmax, ``s = max|x| / 127``, code ``c = round(x / s)`` in ``-127..127``
  (int8 ``[n, D]``); ``x̂ = c · s``, so ``|x - x̂| ≤ s / 2`` per element.
* ``int4``: ``s = max|x| / 7``, ``c = round(x / s)`` in ``-7..7``, stored offset by 8 (``1..15``)
  two per byte: element ``2j`` in the low nibble, ``2j+1`` in the high one; an odd ``D`` pads
  with the zero code (uint8 ``[n, ceil(D/2)]``); ``|x - x̂| ≤ s / 2``.

An all-zero row has ``s = 0`` and decodes to zeros. Everything is vectorized numpy.

The codes are a registry (:func:`register_codec`): a new one is one module registering a :class:`Codec`
(an absmax code of some levels and dtype needs no functions; any other gives its encode/decode), and the
store writes it, a row spec names it, the store scan and the exhaustive indices read it
(``tests/test_codec_registry.py`` adds a toy one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradindex.spec import rows as row_specs


@dataclass(frozen=True)
class Codec:
    """One row code: how a ``[n, D]`` float block becomes codes (and a scale per row) on disk, and back."""

    name: str
    dtype: str
    """numpy dtype of the stored code array."""
    per_code: int = 1
    """Numbers per code element (int4: two nibbles a byte)."""
    levels: int = 0
    """Largest code magnitude of a symmetric absmax code with one float32 scale per row (0: no scale)."""
    encode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]] | None = None
    """``[n, D]`` float32 → ``(codes, scales or None)``; default: an absmax code of ``levels``, or a cast."""
    decode: Callable[[np.ndarray, np.ndarray | None, int], np.ndarray] | None = None
    """``(codes, scales, D)`` → ``[n, D]`` float32; default: the inverse of the default encode."""

    @property
    def bits(self) -> int:
        return np.dtype(self.dtype).itemsize * 8 // self.per_code


CODECS: dict[str, Codec] = {}
"""The registry of row codes (:func:`register_codec`); a new code is one module that registers it."""


def register_codec(codec: Codec) -> Codec:
    """Add a row code: the store writes and reads it, a row spec names it (``none,<name>``), a query scans it."""
    if codec.per_code < 1 or codec.levels < 0:
        raise ValueError(f"codec {codec.name!r}: per_code must be >= 1 and levels >= 0")
    CODECS[codec.name] = codec
    row_specs.CODE_BITS[codec.name] = codec.bits
    if codec.levels:
        row_specs.SCALED.add(codec.name)
    return codec


def unregister_codec(name: str) -> None:
    """Remove a registered code (tests)."""
    CODECS.pop(name, None)
    row_specs.CODE_BITS.pop(name, None)
    row_specs.SCALED.discard(name)


def _pack4(c: np.ndarray) -> np.ndarray:
    u = (c + 8).astype(np.uint8)  # [n, D] in 1..15
    if u.shape[1] % 2:
        u = np.concatenate([u, np.full((len(u), 1), 8, np.uint8)], axis=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack4(codes: np.ndarray, dim: int) -> np.ndarray:
    """Nibbles side by side, minus 8 in uint8 (wrapping), read back as int8, as float32."""
    n, w = codes.shape
    u = np.empty((n, w, 2), np.uint8)  # [n, W, 2]
    np.bitwise_and(codes, 15, out=u[..., 0])
    np.right_shift(codes, 4, out=u[..., 1])
    u -= 8
    return u.reshape(n, 2 * w).view(np.int8)[:, :dim].astype(np.float32)


register_codec(Codec("fp32", "<f4"))
register_codec(Codec("fp16", "<f2"))
register_codec(Codec("int8", "i1", levels=127))
register_codec(Codec("int4", "u1", per_code=2, levels=7))

STORAGES = ("fp32", "fp16", "int8", "int4")
"""The built-in codes (the CLI's ``--storage`` choices)."""


def check_storage(storage: str) -> str:
    if storage not in CODECS:
        raise ValueError(f"storage {storage!r} is not one of {list(CODECS)}")
    return storage


def codec(storage: str) -> Codec:
    return CODECS[check_storage(storage)]


def code_dtype(storage: str) -> np.dtype:
    return np.dtype(codec(storage).dtype)


def code_width(storage: str, dim: int) -> int:
    """Columns of the code array of a ``dim``-wide row."""
    per = codec(storage).per_code
    return -(-dim // per)


def has_scale(storage: str) -> bool:
    return codec(storage).levels > 0


def bytes_per_number(storage: str) -> float:
    """Bytes one stored number takes in ``storage`` (the per-row scale aside)."""
    return codec(storage).bits / 8


def row_bytes(storage: str, dim: int) -> int:
    """Bytes one example's row takes on disk (codes plus scale)."""
    return code_width(storage, dim) * code_dtype(storage).itemsize + (4 if has_scale(storage) else 0)


def encode(x: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``[n, D]`` float → ``(codes, scales [n] float32 or None)``."""
    c = codec(storage)
    x = np.asarray(x, dtype=np.float32)
    if c.encode is not None:
        return c.encode(x)
    if not c.levels:
        return x.astype(c.dtype, copy=False), None
    q = c.levels
    scale = (np.abs(x).max(axis=1) / q).astype(np.float32) if x.shape[1] else np.zeros(len(x), np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    y = x * inv[:, None]  # [n, D], one temporary, rounded and clipped in place
    np.rint(y, out=y)
    np.clip(y, -q, q, out=y)
    if c.per_code == 2:
        return _pack4(y), scale
    return y.astype(c.dtype), scale


def decode(codes: np.ndarray, scales: np.ndarray | None, storage: str, dim: int) -> np.ndarray:
    """``(codes, scales)`` → ``[n, dim]`` float32."""
    c = codec(storage)
    if c.decode is not None:
        return c.decode(codes, scales, dim)
    if not c.levels:
        return np.asarray(codes, dtype=np.float32)
    out = _unpack4(codes, dim) if c.per_code == 2 else codes.astype(np.float32)
    out *= scales[:, None]
    return out
