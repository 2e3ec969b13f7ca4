"""Row codes of the store: float32, float16, int8 or int4 with one float32 scale per row and layer.

* ``fp32``, ``fp16``: the values themselves (``[n, D]`` float32 / float16); no scale.
* ``int8``: symmetric absmax, ``s = max|x| / 127``, code ``c = round(x / s)`` in ``-127..127``
  (int8 ``[n, D]``); ``x̂ = c · s``, so ``|x - x̂| ≤ s / 2`` per element.
* ``int4``: ``s = max|x| / 7``, ``c = round(x / s)`` in ``-7..7``, stored offset by 8 (``1..15``)
  two per byte: element ``2j`` in the low nibble, ``2j+1`` in the high one; an odd ``D`` pads
  with the zero code (uint8 ``[n, ceil(D/2)]``); ``|x - x̂| ≤ s / 2``.

An all-zero row has ``s = 0`` and decodes to zeros. Everything is vectorized numpy.
"""

from __future__ import annotations

import numpy as np

STORAGES = ("fp32", "fp16", "int8", "int4")
LEVELS = {"int8": 127, "int4": 7}
"""Largest code magnitude of each integer storage."""


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r} is not one of {list(STORAGES)}")
    return storage


def code_dtype(storage: str) -> np.dtype:
    return np.dtype({"fp32": "<f4", "fp16": "<f2", "int8": "i1", "int4": "u1"}[check_storage(storage)])


def code_width(storage: str, dim: int) -> int:
    """Columns of the code array of a ``dim``-wide row."""
    return (dim + 1) // 2 if storage == "int4" else dim


def has_scale(storage: str) -> bool:
    return storage in LEVELS


def row_bytes(storage: str, dim: int) -> int:
    """Bytes one example's row takes on disk (codes plus scale)."""
    return code_width(storage, dim) * code_dtype(storage).itemsize + (4 if has_scale(storage) else 0)


def encode(x: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``[n, D]`` float → ``(codes, scales [n] float32 or None)``."""
    x = np.asarray(x, dtype=np.float32)
    if storage == "fp32":
        return x, None
    if storage == "fp16":
        return x.astype(np.float16), None
    q = LEVELS[check_storage(storage)]
    scale = (np.abs(x).max(axis=1) / q).astype(np.float32) if x.shape[1] else np.zeros(len(x), np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    c = x * inv[:, None]  # [n, D], one temporary, rounded and clipped in place
    np.rint(c, out=c)
    np.clip(c, -q, q, out=c)
    if storage == "int8":
        return c.astype(np.int8), scale
    u = (c + 8).astype(np.uint8)  # [n, D] in 1..15
    if u.shape[1] % 2:
        u = np.concatenate([u, np.full((len(u), 1), 8, np.uint8)], axis=1)
    return u[:, 0::2] | (u[:, 1::2] << 4), scale


def decode(codes: np.ndarray, scales: np.ndarray | None, storage: str, dim: int) -> np.ndarray:
    """``(codes, scales)`` → ``[n, dim]`` float32."""
    if storage == "fp32":
        return np.asarray(codes, dtype=np.float32)
    if storage == "fp16":
        return codes.astype(np.float32)
    if storage == "int8":
        out = codes.astype(np.float32)
    else:  # nibbles side by side, minus 8 in uint8 (wrapping), read back as int8
        n, w = codes.shape
        u = np.empty((n, w, 2), np.uint8)  # [n, W, 2]
        np.bitwise_and(codes, 15, out=u[..., 0])
        np.right_shift(codes, 4, out=u[..., 1])
        u -= 8
        out = u.reshape(n, 2 * w).view(np.int8)[:, :dim].astype(np.float32)
    out *= scales[:, None]
    return out
