"""Self-influence ``⟨(H + δI)⁻¹ Ĝ_n, Ĝ_n⟩`` per training example: read from the fit, or computed."""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from gradindex.methods import DEFAULT_DAMPING, parse_method, row_methods
from gradindex.model import resolve_device
from gradindex.precondition.ekfac import store_pass
from gradindex.precondition.files import check_fingerprints, precond_path, read_self_influence
from gradindex.precondition.preconditioner import Preconditioner, load_preconditioner, selected_layers
from gradindex.store.opened import OpenStore, opened

_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 4
PASS_BYTES = 8 << 20
"""float32 bytes of rows a computed self-influence reads a step. A query computes it once per index (a sharded
index's rank, once per part): at the fit's 64 MB blocks the float64 copies of a block and the heap they left
fragmented raised a 5,000-row part's peak RSS by ~210 MB, and 20,000 rows' by ~350 MB; at 8 MB ~40 MB, as fast."""


def _stored(ix: OpenStore, method: str) -> tuple[float, list[str], np.ndarray] | None:
    """The per-layer self-influence written at fit time, if there is a valid file (cached by mtime)."""
    path = precond_path(ix.dir, method)
    if not path.exists() or (method != "graddot" and method not in ix.described.preconditioners):
        return None
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _CACHE:
        check_fingerprints(path, ix.manifest, method)
        _CACHE[key] = read_self_influence(path)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return _CACHE[key]


def self_influence(
    index: str | os.PathLike | OpenStore,
    method: str,
    damping: float = DEFAULT_DAMPING,
    layers: Sequence[str] | None = None,
    device: str = "auto",
    block: int = 1024,
    preconditioner: Preconditioner | None = None,
) -> np.ndarray:
    """``[N]`` self-influence of every stored example under ``method``, summed over ``layers``.

    ``graddot``: ``‖Ĝ‖²``; ``kfac``/``ekfac``: ``⟨(H + δI)⁻¹ Ĝ, Ĝ⟩`` with ``δ = damping × mean(Λ)``;
    ``cosine``: 1 (0 for an all-zero row). On rows stored in a whitened basis, the method is
    the operation on those rows (:func:`gradindex.methods.row_base`) at the basis's baked damping.
    Read from ``precond/<method>.h5`` when it was written at this damping; otherwise computed with
    one pass over the store. ``index``: an open index (or a path, opened here); ``preconditioner`` (the
    method's, loaded): pass it when already at hand.
    """
    base, _ = parse_method(method)
    with opened(index, "compute self-influence") as ix:
        on_rows = row_methods().get(ix.described.basis_kind, {}).get(base, base)  # whitened rows: ekfac = their norm
        if on_rows != base:  # (a name the table lacks is already the operation on the rows, as the engine asks)
            return self_influence(ix, on_rows, damping, layers, device, block)
        layers = selected_layers(ix.manifest, layers)
        if base == "cosine":
            return (self_influence(ix, "graddot", damping, layers, device, block) > 0).astype(np.float64)
        found = _stored(ix, base)
        if found is not None:
            d, names, per_layer = found
            if per_layer.shape[0] != ix.described.examples:
                raise ValueError(
                    f"{str(precond_path(ix.dir, base))!r} has {per_layer.shape[0]} rows, the store "
                    f"{ix.described.examples}; refit with `gradindex precondition {ix.dir} --method {base}`")
            if (base == "graddot" or np.isclose(d, damping, rtol=1e-12, atol=0.0)) and set(layers) <= set(names):
                return per_layer[:, [names.index(n) for n in layers]].sum(axis=1)
        P = preconditioner if preconditioner is not None else load_preconditioner(ix, base)
        block = min(block, max(1, PASS_BYTES // (4 * sum(ix.store.dims[n] for n in layers))))
        if not P.is_identity:  # (the method's curvature: K-FAC/EK-FAC rotate each row once)
            out = P.kind.self_influence(P, ix.store, layers, damping, resolve_device(device), block).sum(axis=1)
        else:
            out = store_pass(ix.store, layers, ix.shapes, None, device=resolve_device(device), dtype=torch.float64,
                             block=block).sq_norms.sum(axis=1)
    release_heap()
    return out


def release_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). A pass over
    the rows frees every block it read, but the heap keeps the pages between what stays: ~80 MB after 78,000 rows,
    counted in a sharded index's rank's RSS (and under the tier it loads next) until trimmed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass
