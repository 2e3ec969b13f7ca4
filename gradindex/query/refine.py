"""Query refinement (ASTRA-style): a few preconditioned iterations towards ``(H + δI)⁻¹ g_q``.

EK-FAC answers ``x₀ = P⁻¹ g_q`` with ``P = Q diag(Λ* + δ) Qᵀ`` (block-diagonal per layer, diagonal in
the Kronecker eigenbasis). Refinement improves that query vector against the true curvature of the
model, the Gauss-Newton matrix over a training sample, ``H = mean_n J_nᵀ H_n J_n`` (``J_n``: the
Jacobian of example ``n``'s logits with respect to the hooked layers' weights; ``H_n``: the softmax
cross-entropy Hessian of its target tokens, summed loss as in every gradient here), with ``P`` as
preconditioner:

* ``neumann``: ``x ← x + α P⁻¹ (g_q − (H + δI) x)`` (preconditioned Neumann / Richardson);
* ``cg``: preconditioned conjugate gradients from ``x₀`` on the same system.

Zero steps is plain EK-FAC exactly (the query rows are returned as they are). ``H`` products are
taken with the model (:class:`GaussNewton`: one forward pass and three reverse-mode passes per batch,
``torch.func.functional_call``) in the space the rows are captured in: where a side is projected (``P_g``, ``P_a``,
or the side maps of a whitened basis), ``(M H Mᵀ) x`` with ``M G = P_g G P_aᵀ`` and
``Mᵀ X = P_gᵀ X P_a``, i.e. the exact Gauss-Newton matrix of the projected coordinates, the one the
EK-FAC fitted on those rows approximates. The refined ``x`` is then written as the query rows that
score it against the index's stored rows as they are (:class:`RowCurvature`):

* rows in the EK-FAC whitened eigenbasis (the default index): ``u = (Q_Sᵀ x Q_A) ⊘ s`` with
  ``s = (Λ* + δ)^{-1/2}`` the stored column scale, since stored rows are ``(Q_Sᵀ Ĝ Q_A) ⊙ s`` and
  ``⟨u, row_t⟩ = ⟨x, Ĝ_t⟩``; with ``x = P⁻¹ g_q`` this is the plain query row;
* raw rows preconditioned at query time: ``P x``, which the engine's ``P⁻¹`` maps back to ``x``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradindex.data import IGNORE, collate
from gradindex.methods import absolute_damping, index_row_base, method_spec, parse_method

REFINE_METHODS = ("neumann", "cg")
REFINE_CURVATURES = ("ggn", "fisher", "sampled")


@dataclass(frozen=True)
class RefineConfig:
    """How a query vector is refined (``--refine``, ``--refine-steps``, ``--refine-sample``)."""

    method: str = "cg"
    """``cg`` (preconditioned conjugate gradients) or ``neumann`` (preconditioned Neumann iterations)."""
    steps: int = 1
    """Curvature products per query beyond the first (``steps + 1`` in all); 0 with ``damping=None`` returns plain
    EK-FAC exactly. The defaults (1 step over 32 examples at damping 10) are the setting that stays within 10x a
    plain query's time (8.2-9.9x p50) and gained on each corpus measured, 1%-drop LDS +0.059 / +0.026 / +0.033
    (``benchmarks/results/refine.json``, ``refine_solve.json``); more steps and examples gain more (+0.064 /
    +0.076 / +0.064 at 2-8 steps over 256) at 80-150x."""
    sample: int = 32
    """Training examples the Gauss-Newton products are averaged over (a seeded random sample)."""
    batch: int = 16
    """Examples per forward/backward pass of a curvature product."""
    alpha: float = 0.0
    """Step size of ``neumann`` (ignored by ``cg``); 0: ``1 / λ̂_max(P⁻¹(H + δI))`` from a few power
    iterations (the EK-FAC preconditioner does not bound the Gauss-Newton spectrum: with a step of 1 the
    iterations can diverge)."""
    seed: int = 0
    """Seed of the training sample (and of ``sampled``'s labels)."""
    damping: float | None = 10.0
    """Relative damping ``d`` of the refined system, ``(H + δ'I) x = g`` with ``δ' = d · mean Λ`` of the index's
    EK-FAC (the preconditioner moved to it too); ``None``: the query's damping (on the default rows, the damping the
    build baked in). The rows are scored as stored either way. Refinement wants a larger damping than plain
    EK-FAC (docs/math.md, "Damping"): at damping 1 more steps lowered the 1%-drop LDS below plain EK-FAC on two
    corpora of three, at 10 they raised it on all three, at 100 by ≤ 0.03."""
    curvature: str = "ggn"
    """The matrix ``H`` refined against. ``ggn``: the exact Gauss-Newton matrix of the sample, products taken
    with the model at every step (:class:`GaussNewton`). ``fisher``: the empirical Fisher of the sample,
    ``mean_s g_s g_sᵀ`` of its captured per-example gradients (observed labels: the matrix the default
    ``--fisher empirical`` EK-FAC approximates). ``sampled``: the same with labels drawn from the model (an
    unbiased Monte-Carlo Gauss-Newton, what ``--fisher true`` fits). Both Fisher forms capture the sample's
    gradients once and cache them (:class:`SampleFisher`): a step costs two products with ``[S, D]``."""

    def __post_init__(self) -> None:
        if self.method not in REFINE_METHODS:
            raise ValueError(f"refine method {self.method!r} is not one of {REFINE_METHODS}")
        if self.curvature not in REFINE_CURVATURES:
            raise ValueError(f"refine curvature {self.curvature!r} is not one of {REFINE_CURVATURES}")
        if self.damping is not None and not (math.isfinite(self.damping) and self.damping > 0):
            raise ValueError(f"refine damping must be a positive finite number (relative, like --damping); got "
                             f"{self.damping}")
        if self.steps < 0 or self.sample < 1 or self.batch < 1 or not self.alpha >= 0:
            raise ValueError(f"refine needs steps >= 0, sample >= 1, batch >= 1 and alpha >= 0; got "
                             f"steps={self.steps}, sample={self.sample}, batch={self.batch}, alpha={self.alpha}")

    def note(self, n: int) -> str:
        """A result's note on this refinement on an index of ``n`` examples."""
        return (f"query refined: {self.method}, {self.steps} steps, Gauss-Newton products over "
                f"{min(self.sample, n)} training examples")


def refine_config(default: RefineConfig | None, refine: RefineConfig | bool | None, method: str, manifest: dict,
                  index_dir, basis_kind: str) -> RefineConfig | None:
    """The refinement a call asked for, checked against ``method`` on an index with rows in ``basis_kind``: ``None``
    takes ``default`` (skipped for methods without an inverse curvature), ``True`` the default settings, ``False``
    none."""
    asked = refine is not None
    cfg = RefineConfig() if refine is True and default is None else (
        default if refine is None or refine is True else (refine or None))
    if cfg is None:
        return None
    base, _ = parse_method(method)
    on_rows = index_row_base(manifest, index_dir, base, method)
    whitened_ekfac = base == "ekfac" and basis_kind == "ekfac"
    if method_spec(base).fitted is None or (on_rows != base and not whitened_ekfac):
        if not asked:
            return None
        raise ValueError(f"query refinement improves an EK-FAC/K-FAC inverse-curvature product; method "
                         f"{method!r} on this index's {basis_kind!r} rows has none (use --method ekfac, or "
                         "drop --refine)")
    return cfg


def training_sample(cfg: RefineConfig, n: int, texts) -> tuple[list[list[int]], list[list[int]]]:
    """The curvature products' sample: ``cfg.sample`` of ``n`` rows drawn with ``cfg.seed``, tokens from ``texts``."""
    rng = np.random.default_rng(cfg.seed)
    ids = np.sort(rng.choice(n, min(cfg.sample, n), replace=False)).astype(np.int64)
    return texts.require("query refinement takes curvature products on training examples and needs the data", ids)


# -- the preconditioner in the captured space --------------------------------------------------------
@dataclass
class RowCurvature:
    """One layer's ``P = Q_S ⊗ Q_A diag(Λ + δ)`` in the captured space, and how its rows are scored."""

    Q_S: torch.Tensor
    """``[k_g, k_g]`` float64."""
    Q_A: torch.Tensor
    """``[k_a, k_a]`` float64."""
    lam: torch.Tensor
    """``[k_g, k_a]`` ``Λ + δ`` (floored as :func:`gradindex.precondition.apply.damped` floors it)."""
    delta: float
    """Absolute damping ``δ`` added to ``H`` in the refined system."""
    eigen_rows: bool
    """Stored rows are ``(Q_Sᵀ Ĝ Q_A) ⊙ (Λ + δ)^{-1/2}`` (else raw rows, preconditioned by the engine)."""
    rows_lam: torch.Tensor | None = None
    """The ``Λ + δ`` the rows (or the engine's query-time ``P⁻¹``) use, where the solve's differs
    (:meth:`at_damping`); ``None``: ``lam``."""

    def at_damping(self, damping: float) -> RowCurvature:
        """The same rows solved at relative damping ``damping``: ``P' = P + (δ' − δ)I``, ``δ' = damping · mean Λ``."""
        lam0 = self._row_lam
        base = lam0 - self.delta
        delta = absolute_damping(damping, base)
        return RowCurvature(self.Q_S, self.Q_A, (base + delta).clamp_min(0.5 * delta), delta, self.eigen_rows, lam0)

    @property
    def _row_lam(self) -> torch.Tensor:
        return self.lam if self.rows_lam is None else self.rows_lam

    def _rot(self, x: torch.Tensor) -> torch.Tensor:  # [n, k_g·k_a] → [n, k_g, k_a]
        k_g, k_a = self.lam.shape
        return self.Q_S.T @ x.reshape(-1, k_g, k_a) @ self.Q_A

    def _back(self, R: torch.Tensor) -> torch.Tensor:
        return (self.Q_S @ R @ self.Q_A.T).reshape(len(R), -1)

    def solve(self, r: torch.Tensor) -> torch.Tensor:
        """``P⁻¹ r`` for rows ``r`` ``[n, D]``."""
        return self._back(self._rot(r) / self.lam)

    def query_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The query rows that score ``x`` against the stored rows: ``(Q_Sᵀ x Q_A) ⊘ s`` or ``P x``."""
        R = self._rot(x) * (self._row_lam.sqrt() if self.eigen_rows else self._row_lam)
        return R.reshape(len(x), -1) if self.eigen_rows else self._back(R)

    def captured(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored-basis query rows (as the engine captures them) → captured rows ``Ĝ``."""
        if not self.eigen_rows:
            return rows
        k_g, k_a = self.lam.shape
        return self._back(rows.reshape(-1, k_g, k_a) * self._row_lam.sqrt())


def eigenbasis_curvature(Q_S: np.ndarray, Q_A: np.ndarray, scale: np.ndarray, damping: float) -> RowCurvature:
    """From an EK-FAC eigenbasis ``basis.h5`` layer: ``Λ + δ = s⁻²``, ``δ = d/(1+d) · mean(s⁻²)``
    (``δ = d · mean(Λ)`` and ``mean(Λ + δ) = mean(Λ) + δ``)."""
    lam = 1.0 / np.square(np.asarray(scale, np.float64))
    delta = absolute_damping(damping / (1.0 + damping), lam)
    return RowCurvature(torch.as_tensor(np.asarray(Q_S, np.float64)), torch.as_tensor(np.asarray(Q_A, np.float64)),
                        torch.as_tensor(lam), delta, True)


def preconditioner_curvature(pre, layer: str, damping: float) -> RowCurvature:
    """From a fitted :class:`~gradindex.precondition.Preconditioner` (raw rows, preconditioned at query time)."""
    from gradindex.precondition.apply import damped

    Q_S, Q_A, Lam = pre._tensors(layer, torch.device("cpu"), torch.float64)
    delta = pre.delta(layer, damping)
    return RowCurvature(Q_S, Q_A, 1.0 / damped(Lam, delta, -1.0), delta, False)


def row_curvature(basis, pre, base: str, damping: float, layer: str) -> RowCurvature:
    """A layer's :class:`RowCurvature`: from the rows' EK-FAC eigenbasis, else ``base``'s preconditioner in ``pre``."""
    if basis.kind == "ekfac":
        return eigenbasis_curvature(basis.Q_S[layer], basis.Q_A[layer], basis.scale[layer], basis.damping)
    return preconditioner_curvature(pre.get(base), layer, damping)


# -- the solver -----------------------------------------------------------------------------------------
Rows = dict[str, torch.Tensor]
"""layer → ``[D]`` float64 (one query)."""


def _dot(a: Rows, b: Rows) -> float:
    return float(sum((a[n] * b[n]).sum() for n in a))


def largest_eigenvalue(g: Rows, curv: Mapping[str, RowCurvature], hvp: Callable[[Rows], Rows],
                       iterations: int = 5) -> float:
    """``λ̂_max`` of ``P⁻¹(H + δI)`` by power iterations started from ``P⁻¹ g`` (slightly low, never high)."""
    x = {n: curv[n].solve(g[n][None])[0] for n in g}
    lam = 0.0
    for _ in range(iterations):
        norm = _dot(x, x) ** 0.5
        if not norm > 0:
            break
        x = {n: v / norm for n, v in x.items()}
        h = hvp(x)
        y = {n: curv[n].solve((h[n] + curv[n].delta * x[n])[None])[0] for n in x}
        lam = _dot(x, y)
        x = y
    return lam


def refine_solve(g: Rows, curv: Mapping[str, RowCurvature], hvp: Callable[[Rows], Rows], steps: int,
                 method: str = "cg", alpha: float = 0.0) -> tuple[Rows, list[float]]:
    """``(x, residuals)``: ``steps`` iterations on ``(H + δI) x = g`` from ``x₀ = P⁻¹ g``.

    ``alpha`` (``neumann``): the step; 0 estimates ``1/λ̂_max`` per query (:func:`largest_eigenvalue`,
    5 more products).
    ``hvp(x)`` returns ``H x`` (no damping); ``residuals[k] = ‖g − (H + δI) x_k‖`` for the iterates
    it was computed for (``x₀`` … ``x_{steps-1}``).
    """
    def A(x: Rows) -> Rows:
        h = hvp(x)
        return {n: h[n] + curv[n].delta * x[n] for n in x}

    def Pinv(r: Rows) -> Rows:
        return {n: curv[n].solve(r[n][None])[0] for n in r}

    x = Pinv(g)
    res: list[float] = []
    if steps == 0:
        return x, res
    if method == "neumann":
        if not alpha > 0:
            lam = largest_eigenvalue(g, curv, hvp)
            alpha = 1.0 / lam if lam > 0 else 1.0
        for _ in range(steps):
            Ax = A(x)
            r = {n: g[n] - Ax[n] for n in g}
            res.append(_dot(r, r) ** 0.5)
            z = Pinv(r)
            x = {n: x[n] + alpha * z[n] for n in x}
        return x, res
    Ax = A(x)
    r = {n: g[n] - Ax[n] for n in g}
    z = Pinv(r)
    p = dict(z)
    rz = _dot(r, z)
    for k in range(steps):
        res.append(_dot(r, r) ** 0.5)
        Ap = A(p)
        pAp = _dot(p, Ap)
        if not pAp > 0 or not rz > 0:  # converged (or lost positive definiteness): stop here
            break
        a = rz / pAp
        x = {n: x[n] + a * p[n] for n in x}
        if k == steps - 1:
            break
        r = {n: r[n] - a * Ap[n] for n in r}
        z = Pinv(r)
        rz_new = _dot(r, z)
        p = {n: z[n] + (rz_new / rz) * p[n] for n in p}
        rz = rz_new
    return x, res


# -- Gauss-Newton products with the model ------------------------------------------------------------------
@contextmanager
def eager_attention(model: nn.Module):
    """transformers' eager attention for the block (forward-mode AD has no rule for the fused SDPA kernels)."""
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "_attn_implementation", None)
    if cfg is None or old in (None, "eager"):
        yield
        return
    cfg._attn_implementation = "eager"
    try:
        yield
    finally:
        cfg._attn_implementation = old


class GaussNewton:
    """``H V = mean_n J_nᵀ H_n J_n V`` over a training sample, for weight directions ``V`` of hooked layers.

    ``V``: layer → ``[N_o, N_i(+1)]`` (gradindex's layout; the last column is the bias). One forward-mode
    pass gives ``J V`` (the logits' change), the cross-entropy Hessian of each target token
    ``diag(p) − p pᵀ`` is applied, and one reverse-mode pass maps it back. ``maps``: layer →
    ``(M_g, M_a)`` side maps (``[k, n]`` or ``None`` for an exact side) so that products can be taken in
    the captured space (:meth:`captured_product`).
    """

    def __init__(self, model: nn.Module, modules: Mapping[str, nn.Module], infos: Mapping, pad_id: int,
                 ids: Sequence[list[int]], labels: Sequence[list[int]], batch: int = 16,
                 maps: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]] | None = None):
        bad = [n for n, i in infos.items() if i.kind not in ("linear", "conv1d")]
        if bad:
            raise ValueError(f"query refinement supports linear and Conv1D layers; {bad[:3]} are not")
        self.model, self.modules, self.infos = model, dict(modules), dict(infos)
        self.device = next(model.parameters()).device
        self.batches = [collate(list(ids[s:s + batch]), list(labels[s:s + batch]), pad_id)
                        for s in range(0, len(ids), batch)]
        self.n = len(ids)
        self.maps = dict(maps or {})
        self.params = {}
        for n, m in self.modules.items():
            self.params[f"{n}.weight"] = m.weight
            if self.infos[n].bias:
                self.params[f"{n}.bias"] = m.bias

    def _tangents(self, V: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for n, m in self.modules.items():
            info = self.infos[n]
            W = V[n][:, : info.n_in]
            out[f"{n}.weight"] = (W if info.kind == "linear" else W.T).to(m.weight.dtype).contiguous()
            if info.bias:
                out[f"{n}.bias"] = V[n][:, info.n_in].to(m.bias.dtype).contiguous()
        return out

    def product(self, V: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``H V`` in the layout of ``V`` (float64)."""
        tangents = self._tangents({n: V[n].to(self.device) for n in self.modules})
        total = {n: torch.zeros(V[n].shape, dtype=torch.float64, device=self.device) for n in self.modules}
        with eager_attention(self.model):
            for b in self.batches:
                for n, G in self._batch_product(b, tangents).items():
                    total[n] += G
        return {n: (t / self.n).cpu() for n, t in total.items()}

    def _batch_product(self, b: dict, tangents: dict) -> dict[str, torch.Tensor]:
        """``Σ_{n ∈ batch} J_nᵀ H_n J_n V`` per layer (float64).

        ``J V`` by the double-backward trick (``∂/∂u ⟨Jᵀu, V⟩``, ``u = 0``) rather than ``torch.func.jvp``, whose
        forward-mode rules run as Python decompositions (1.5x slower here); one forward serves both products."""
        from torch.func import functional_call

        b = {k: v.to(self.device) for k, v in b.items()}
        kwargs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "use_cache": False}
        names = list(self.params)
        params = {k: self.params[k].detach().requires_grad_(True) for k in names}
        with torch.enable_grad():
            z = functional_call(self.model, params, (), kwargs).logits
            u = torch.zeros_like(z, requires_grad=True)
            jt = torch.autograd.grad(z, [params[k] for k in names], u, create_graph=True)
            (Jv,) = torch.autograd.grad(jt, u, [tangents[k] for k in names], retain_graph=True)  # [B, T, V]
            mask = (b["labels"][:, 1:] != IGNORE)[..., None]  # [B, T-1, 1]: target tokens
            p = torch.softmax(z[:, :-1].detach().double(), -1)
            w = Jv[:, :-1].double()
            Hu = (p * w - p * (p * w).sum(-1, keepdim=True)) * mask  # (diag p − p pᵀ) J V per token
            Hu = torch.cat([Hu, torch.zeros_like(Hu[:, :1])], 1).to(z.dtype)  # [B, T, V]
            grads = dict(zip(names, torch.autograd.grad(z, [params[k] for k in names], Hu), strict=True))
        return {n: self.infos[n].weight_grad_to_G(grads[f"{n}.weight"], grads.get(f"{n}.bias")).double()
                for n in self.modules}

    def captured_product(self, x: Rows, shapes: Mapping[str, tuple[int, int]]) -> Rows:
        """``M H Mᵀ x`` for captured rows ``x`` (layer → ``[k_g·k_a]``), float64."""
        V = {}
        for n, v in x.items():
            M_g, M_a = self.maps.get(n, (None, None))
            X = v.reshape(shapes[n])
            X = X if M_g is None else M_g.double().T @ X
            V[n] = X if M_a is None else X @ M_a.double()
        HV = self.product(V)
        out = {}
        for n, Y in HV.items():
            M_g, M_a = self.maps.get(n, (None, None))
            Y = Y if M_g is None else M_g.double() @ Y
            out[n] = (Y if M_a is None else Y @ M_a.double().T).reshape(-1)
        return out


class SampleFisher:
    """``H x = (1/S) Σ_s g_s (g_sᵀ x)`` over a sample's captured per-example gradients ``g_s`` (all layers
    jointly, so cross-layer terms are kept), computed once: no model pass per product."""

    def __init__(self, rows: Mapping[str, torch.Tensor]):
        self.rows = {n: torch.as_tensor(v).float().contiguous() for n, v in rows.items()}
        """float32: a product is two passes over ``[S, D]``, bound by memory traffic (accumulated in float64)."""
        self.n = len(next(iter(self.rows.values())))

    def captured_product(self, x: Rows, shapes: Mapping[str, tuple[int, int]] | None = None) -> Rows:
        """``H x`` for captured rows ``x`` (layer → ``[D]``); ``shapes`` unused (the rows are flat)."""
        coef = sum((self.rows[n] @ x[n].float()).double() for n in x)  # [S]
        c = (coef / self.n).float()
        return {n: (self.rows[n].T @ c).double() for n in x}


@torch.no_grad()
def sampled_labels(model: nn.Module, ids: Sequence[list[int]], labels: Sequence[list[int]], pad_id: int,
                   seed: int, batch: int = 16) -> list[list[int]]:
    """``labels`` with every target token replaced by one drawn from the model's own next-token distribution
    (seeded): per-example gradients of these labels give an unbiased estimate of the Gauss-Newton matrix."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for s in range(0, len(ids), batch):
        b = collate(list(ids[s:s + batch]), list(labels[s:s + batch]), pad_id)
        logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
        p = torch.softmax(logits[:, :-1].double().cpu(), -1)  # [B, T-1, V]
        draw = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=g).reshape(p.shape[:2])
        for i, y in enumerate(labels[s:s + batch]):
            new = list(y)
            for t in range(1, len(y)):
                if y[t] != IGNORE:
                    new[t] = int(draw[i, t - 1])
            out.append(new)
    return out


# -- the engine's refiner --------------------------------------------------------------------------------------
class Refiner:
    """Refined query rows for one engine: its model, capture, row space and preconditioners; results cached.

    ``curvature(base, damping, layer)`` gives a layer's :class:`RowCurvature`; ``sample()`` the training
    sample's ``(ids, labels)``. Refined rows are kept per (query tokens, method, damping, layers, config),
    ``cache`` entries at most.
    """

    def __init__(self, model: nn.Module, capture, space, pad_id: int, sample: Callable[[RefineConfig], tuple],
                 curvature: Callable[[str, float, str], RowCurvature], cache: int = 1024,
                 gradients: Callable[[list, list], Mapping[str, torch.Tensor]] | None = None):
        self.model, self.capture, self.space, self.pad_id = model, capture, space, pad_id
        self._sample, self._curvature, self._gradients = sample, curvature, gradients
        self._ggn: dict[tuple, GaussNewton] = {}
        self._cache: OrderedDict = OrderedDict()
        self.cache_size = cache
        self.last_residuals: list[list[float]] = []

    def fisher(self, cfg: RefineConfig, layers: Sequence[str], curv: Mapping[str, RowCurvature]) -> SampleFisher:
        """The sample's :class:`SampleFisher` (``cfg.curvature`` ``fisher`` or ``sampled``), captured once."""
        key = (cfg.sample, cfg.seed, cfg.curvature, tuple(layers))
        if key not in self._ggn:
            if self._gradients is None:
                raise ValueError("this refiner has no gradient capture for Fisher curvature; use curvature='ggn'")
            ids, labels = self._sample(cfg)
            if cfg.curvature == "sampled":
                labels = sampled_labels(self.model, ids, labels, self.pad_id, cfg.seed, cfg.batch)
            rows = self._gradients(ids, labels)
            self._ggn[key] = SampleFisher({n: curv[n].captured(torch.as_tensor(rows[n]).double()) for n in layers})
        return self._ggn[key]

    def gauss_newton(self, cfg: RefineConfig, layers: Sequence[str], full: bool = False) -> GaussNewton:
        key = (cfg.sample, cfg.seed, cfg.batch, tuple(layers), full)
        if key not in self._ggn:
            ids, labels = self._sample(cfg)
            maps = {} if full else {n: (self.space.side_map(n, "g", "cpu"), self.space.side_map(n, "a", "cpu"))
                                    for n in layers}
            if not full and any(self.space.side_scale(n, s) is not None for n in layers for s in "ag"):
                raise ValueError("query refinement needs linear side maps; this index's rows are scaled entrywise "
                                 "(an Adam-preconditioned index): query it without --refine")
            self._ggn[key] = GaussNewton(self.model, {n: self.capture.modules[n] for n in layers},
                                         {n: self.capture.infos[n] for n in layers}, self.pad_id, ids, labels,
                                         cfg.batch, maps)
        return self._ggn[key]

    def rows(self, tokens, grads: Mapping[str, torch.Tensor], method: str, damping: float, layers: Sequence[str],
             cfg: RefineConfig) -> dict[str, torch.Tensor]:
        """Refined stored-basis query rows ``{layer: [Q, D]}`` for queries ``tokens`` with rows ``grads``."""
        base, _ = parse_method(method)
        if cfg.steps == 0:
            return {n: torch.as_tensor(grads[n]) for n in layers}
        curv = {n: self._curvature(base, damping, n) for n in layers}
        if cfg.damping is not None:
            curv = {n: c.at_damping(cfg.damping) for n, c in curv.items()}
        shapes = {n: tuple(curv[n].lam.shape) for n in layers}
        out = {n: [] for n in layers}
        self.last_residuals = []
        for j in range(len(tokens)):
            key = (tuple(tokens.input_ids[j]), tuple(tokens.labels[j]), base, float(damping), tuple(layers), cfg)
            if key not in self._cache:
                g = {n: curv[n].captured(torch.as_tensor(grads[n][j:j + 1]).double())[0] for n in layers}
                ggn = self.gauss_newton(cfg, layers) if cfg.curvature == "ggn" else self.fisher(cfg, layers, curv)
                x, res = refine_solve(g, curv, lambda v, ggn=ggn: ggn.captured_product(v, shapes), cfg.steps,
                                      cfg.method, cfg.alpha)
                self._cache[key] = ({n: curv[n].query_rows(x[n][None])[0].float() for n in layers}, res)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            rows, res = self._cache[key]
            self.last_residuals.append(res)
            for n in layers:
                out[n].append(rows[n])
        return {n: torch.stack(v) for n, v in out.items()}

    def full_space(self, Gq: Mapping[str, torch.Tensor], pre, damping: float, layers: Sequence[str],
                   cfg: RefineConfig) -> dict[str, torch.Tensor]:
        """Refined full-space ``x = (H + δI)⁻¹ G_q`` per layer ``[N_o, N_i(+1)]`` for ``--rerank-full``
        (``pre``: the full-space preconditioner; ``Gq``: the query's full gradients). Gauss-Newton products only."""
        if cfg.curvature != "ggn":
            raise ValueError(f"--rerank-full refines in full space with Gauss-Newton products; curvature "
                             f"{cfg.curvature!r} is captured-space only (use --refine-curvature ggn there)")
        curv = {n: preconditioner_curvature(pre, n, damping if cfg.damping is None else cfg.damping) for n in layers}
        shapes = {n: tuple(Gq[n].shape) for n in layers}
        g = {n: Gq[n].double().reshape(-1) for n in layers}
        ggn = self.gauss_newton(cfg, layers, full=True)
        x, _ = refine_solve(g, curv, lambda v: ggn.captured_product(v, shapes), cfg.steps, cfg.method, cfg.alpha)
        return {n: x[n].reshape(shapes[n]).float() for n in layers}
