"""What a build stores per layer: projection sizes from a byte budget, and the whitened basis's factor pass.

Both are settled before capture and recorded in the manifest's ``build`` section (``projection``
with per-layer ``sizes``, and ``basis``), so a resume or a query with other settings is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from fractions import Fraction

import numpy as np
from torch import nn

from gradindex.capture import ProjectionSpec
from gradindex.capture.allocation import allocate
from gradindex.capture.batch import batch_gradients
from gradindex.capture.fullcov import FullCovariance
from gradindex.capture.layers import LayerInfo
from gradindex.data import Tokenized
from gradindex.progress import progress_bar
from gradindex.store.basis import RowBasis, kfac_basis, read_basis, write_basis
from gradindex.store.codes import code_dtype

FLOAT32_BYTES = 4
DEFAULT_BUDGET_CAP = 256 << 10
"""``auto`` budget: 1/8 of the full float32 gradient, at most this many bytes per example."""


def parse_budget(budget: int | str, full_bytes: int) -> int:
    """Bytes per example: an integer (``65536``), a fraction of ``full_bytes`` (``"1/8"``, ``"0.125"``),
    or ``auto``: ``min(full_bytes / 8, 256 KiB)`` (int4 codes of the whole gradient where it is that small)."""
    text = str(budget).strip()
    if text.lower() == "auto":
        return min(full_bytes // 8, DEFAULT_BUDGET_CAP)
    try:
        if "/" in text or "." in text:
            frac = Fraction(text)
            if not 0 < frac <= 1:
                raise ValueError
            return int(full_bytes * frac)
        value = int(text)
        if value <= 0:
            raise ValueError
        return value
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"budget {budget!r} is not understood; give bytes per example (e.g. 65536) or a fraction "
                         f"of the full float32 gradient ({full_bytes} bytes here), e.g. 1/8") from None


def full_bytes(infos: dict[str, LayerInfo]) -> int:
    """Float32 bytes of one example's full (unprojected) gradient over these layers."""
    return FLOAT32_BYTES * sum(i.n_in_total * i.n_out for i in infos.values())


def bytes_per_number(storage: str) -> float:
    """Bytes one stored number takes in ``storage`` (the per-row scale aside)."""
    return code_dtype(storage).itemsize / (2 if storage == "int4" else 1)


def sized_projection(cfg, infos: dict[str, LayerInfo], basis: RowBasis) -> ProjectionSpec:
    """``cfg.projection``, or per-layer sizes from ``cfg.budget`` under ``cfg.allocation``.

    The budget buys numbers at ``cfg.storage``'s width: int4 rows get 8× the numbers of float32 ones.
    """
    if not cfg.budget:
        return cfg.projection
    widths = {n: (i.n_in_total, i.n_out) for n, i in infos.items()}
    budget = parse_budget(cfg.budget, full_bytes(infos))
    sizes = allocate(widths, budget, cfg.allocation, bytes_per_number(cfg.storage), basis.spectra)
    kind = "gaussian" if cfg.projection.is_identity else cfg.projection.kind
    return ProjectionSpec(kind=kind, k_a=0, k_g=0, seed=cfg.projection.seed,
                          sizes=tuple((n, ka, kg) for n, (ka, kg) in sizes.items()))


def basis_identity(cfg, basis: RowBasis, model_fp: str, data_fp: str) -> dict:
    """The manifest's ``build.basis``: kind, and for ``kfac`` the settings and a digest of the maps."""
    if cfg.basis == "raw":
        return {"kind": "raw"}
    h = hashlib.blake2b(digest_size=16)
    for n in sorted(basis.W_a):
        h.update(n.encode())
        h.update(np.ascontiguousarray(basis.W_a[n], np.float32).tobytes())
        h.update(np.ascontiguousarray(basis.W_g[n], np.float32).tobytes())
    return {"kind": cfg.basis, "damping": cfg.basis_damping, "examples": cfg.basis_examples,
            "seed": cfg.basis_seed, "digest": h.hexdigest()}


def factor_pass(model: nn.Module, data: Tokenized, rows, layers, pad_id: int, batch_size: int,
                progress: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Full-space ``layer → (A, S)`` (float64 token means) from one forward/backward over ``rows``."""
    model.requires_grad_(False)
    rows = list(rows)
    with FullCovariance(model, layers) as cap, progress_bar(total=len(rows), unit="ex", desc="basis factors",
                                                     disable=not progress) as bar:
        for s in range(0, len(rows), batch_size):
            idx = rows[s:s + batch_size]
            batch_gradients(model, cap, [data.input_ids[i] for i in idx], [data.labels[i] for i in idx], pad_id)
            bar.update(len(idx))
        return {n: (A.cpu().numpy(), S.cpu().numpy()) for n, (A, S, _) in cap.means().items()}


def full_space_basis(model: nn.Module, data: Tokenized, pad_id: int, out, cfg, model_fp: str, data_fp: str,
                     progress: bool) -> tuple[RowBasis, Callable[[], None] | None]:
    """The ``kfac`` basis: reused from ``out`` when it was made with these settings, else one factor pass.

    Returns the basis and, when it is new, the call that writes it (once ``out`` is known to be ours).
    """
    ident = {"model": model_fp, "data": data_fp, "damping": cfg.basis_damping, "examples": cfg.basis_examples,
             "seed": cfg.basis_seed, "layers": ",".join(cfg.layers)}
    old = read_basis(out, ident) if out.exists() else None
    if old is not None:
        return old, None
    n = len(data)
    k = cfg.basis_examples
    rows = np.arange(n) if k <= 0 or k >= n else np.sort(np.random.default_rng(cfg.basis_seed).choice(n, k, False))
    basis = kfac_basis(factor_pass(model, data, rows, cfg.layers, pad_id, cfg.batch_size, progress), cfg.basis_damping)
    return basis, lambda: write_basis(out, basis, ident)
