"""The compression study of ``fidelity.py``: full-space gradients, every codec of ``reference.py``,
LDS / top-k overlap / fact recall per byte, and the bytes plot.

Full-space per-example gradients ``G = Σ_t g_t [a_t; 1]ᵀ`` ``[n, N_o, N_i+1]`` and the token-mean
factors ``A``, ``S`` of every GPT-2 block Conv1D are captured here with plain hooks (summed
per-example loss over the target tokens, factors over non-padding tokens, as the library does), so
the study simulates stores the library cannot write yet. The reference is full-space EK-FAC at the
configured damping, computed from the same gradients (``reference.influence``); its LDS is checked
against the library's own full-space EK-FAC in the results (``reference_check``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks import reference as C
from benchmarks.common import evaluate, fact_recall, overlap_at_k, top_indices
from gradindex.data import collate, per_example_loss

Layers = list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]
"""Per layer: ``(name, G_train [N, N_o, N_i], A [N_i, N_i], S [N_o, N_o])``."""


# -- capture ------------------------------------------------------------------------------------------
def conv1d_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The block linear layers (HF ``Conv1D``) of a GPT-2, in model order."""
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}


def capture_full(model: torch.nn.Module, ids: list[list[int]], labels: list[list[int]], pad_id: int,
                 batch: int = 16) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """``(G, A, S, tokens)``: layer → ``[n, N_o, N_i+1]`` float64 per-example gradients of the summed
    token loss, and layer → token-mean ``A`` ``[N_i+1, N_i+1]``, ``S`` ``[N_o, N_o]``."""
    mods = conv1d_layers(model)
    acts: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(_m, inp, out):
            acts[name], outs[name] = inp[0].detach(), out
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    G: dict[str, list[np.ndarray]] = {n: [] for n in mods}
    A = {n: 0.0 for n in mods}
    S = {n: 0.0 for n in mods}
    tokens = 0
    try:
        for s in range(0, len(ids), batch):
            b = collate(ids[s: s + batch], labels[s: s + batch], pad_id)
            mask = b["attention_mask"].bool()  # [B, T]
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            loss, _ = per_example_loss(logits, b["labels"])
            names = list(outs)
            grads = torch.autograd.grad(loss.sum(), [outs[n] for n in names])
            tokens += int(mask.sum())
            for n, g in zip(names, grads, strict=True):
                a = acts[n].double()
                a = torch.cat([a, torch.ones_like(a[..., :1])], -1) * mask[..., None]  # [B, T, N_i+1]
                g = g.double() * mask[..., None]  # [B, T, N_o]
                G[n].append(torch.einsum("bto,bti->boi", g, a).numpy())
                af, gf = a[mask], g[mask]  # [tokens, ·]
                A[n] = A[n] + (af.T @ af).numpy()
                S[n] = S[n] + (gf.T @ gf).numpy()
    finally:
        for h in handles:
            h.remove()
    return ({n: np.concatenate(v) for n, v in G.items()}, {n: a / tokens for n, a in A.items()},
            {n: s / tokens for n, s in S.items()}, tokens)


# -- codecs ---------------------------------------------------------------------------------------------
class Encoded:
    """What one codec yields for scoring: per-layer query-side rows, decoded stored rows, and the
    self-side rows (``⟨self_l, stored_l⟩`` summed over layers is the example's self-influence)."""

    def __init__(self) -> None:
        self.q: list[np.ndarray] = []
        self.t: list[np.ndarray] = []
        self.selfside: list[np.ndarray] = []
        self.bytes = 0
        self.shared_bytes = 0

    def add(self, q: np.ndarray, t: np.ndarray, selfside: np.ndarray | None, nbytes: int) -> None:
        self.q.append(q.reshape(len(q), -1))
        self.t.append(t.reshape(len(t), -1))
        self.selfside.append((t if selfside is None else selfside).reshape(len(t), -1))
        self.bytes += nbytes


def _code(x: np.ndarray, code: str, seed: int) -> tuple[np.ndarray, int]:
    flat = x.reshape(len(x), -1)
    dec, nb = C.roundtrip(flat, code, seed)
    return dec.reshape(x.shape), nb


def raw_codec(code: str) -> Callable:
    """Stored: ``code(G)`` in the raw basis. Query: ``(H + δI)⁻¹ G_q`` with full-space EK-FAC."""
    def enc(ctx, seed):
        e = Encoded()
        for li, ((_, G, _, _), Gq, curv) in enumerate(zip(ctx["layers"], ctx["Gq"], ctx["ekfac"], strict=True)):
            t, nb = _code(G, code, seed)
            q = _cached(ctx, ("precond", li), lambda: C.precondition(Gq, curv, ctx["damping"]))  # noqa: B023
            e.add(q, t, C.precondition(t, curv, ctx["damping"]), nb)
        return e
    return enc


def _cached(ctx, key: tuple, make: Callable) -> np.ndarray:
    """Whitened / preconditioned rows shared by several codecs (``ctx['cache']``)."""
    cache = ctx.setdefault("cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def whitened(ctx, li: int, curv_key: str = "ekfac") -> tuple[np.ndarray, np.ndarray]:
    """``(W_train, W_query)`` of layer ``li`` whitened by ``ctx[curv_key]`` (cached for ``ekfac``)."""
    (_, G, _, _), Gq, curv = ctx["layers"][li], ctx["Gq"][li], ctx[curv_key][li]
    make = lambda: (C.whiten(G, curv, ctx["damping"]), C.whiten(Gq, curv, ctx["damping"]))  # noqa: E731
    return _cached(ctx, ("whiten", curv_key, li), make) if curv_key == "ekfac" else make()


def eigen_codec(code: str, curv_key: str = "ekfac", g_transform: Callable | None = None) -> Callable:
    """Stored: ``code(W)``, ``W = (Q_Sᵀ G Q_A) ⊙ (Λ + δ)^{-1/2}`` (whitened eigenbasis). Query: ``W_q``.
    ``curv_key``: which fitted curvature (``ekfac``, ``kfac``, or a sample fit); ``g_transform``: applied
    to the training rows before whitening (e.g. a float16 store that is transcoded after the fit)."""
    def enc(ctx, seed):
        e = Encoded()
        for li in range(len(ctx["layers"])):
            if g_transform is None:
                W, Wq = whitened(ctx, li, curv_key)
            else:
                curv = ctx[curv_key][li]
                W = C.whiten(g_transform(ctx["layers"][li][1]), curv, ctx["damping"])
                Wq = whitened(ctx, li, curv_key)[1]
            t, nb = _code(W, code, seed)
            e.add(Wq, t, None, nb)
        return e
    return enc


def proj_ekfac_codec(size: Callable, code: str = "fp32") -> Callable:
    """Library-style: stored ``code(P_g G P_aᵀ)``; EK-FAC fitted in the projected space (factors
    ``P_a A P_aᵀ``, ``P_g S P_gᵀ``, ``Λ*`` from the stored rows); query ``(Ĥ + δI)⁻¹ P_g G_q P_aᵀ``.
    ``size(N_o, N_i) → (k_g, k_a)``."""
    def enc(ctx, seed):
        e = Encoded()
        for li, ((_, G, A, S), Gq) in enumerate(zip(ctx["layers"], ctx["Gq"], strict=True)):
            k_g, k_a = size(*G.shape[1:])
            P_g = C.gaussian_projection(k_g, G.shape[1], seed * 7919 + 2 * li)
            P_a = C.gaussian_projection(k_a, G.shape[2], seed * 7919 + 2 * li + 1)
            t, nb = _code(C.project(G, P_g, P_a), code, seed)
            curv = C.fit_curvature(P_a @ A @ P_a.T, P_g @ S @ P_g.T, t, "ekfac")
            e.add(C.precondition(C.project(Gq, P_g, P_a), curv, ctx["damping"]), t,
                  C.precondition(t, curv, ctx["damping"]), nb)
        return e
    return enc


def whitened_proj_codec(size: Callable, code: str = "fp32", kind: str = "ekfac") -> Callable:
    """Whiten, then a factored projection, then (optionally) a code; scores are plain inner products.
    ``kind='kfac'``: ``S_δ^{-1/2} G A_δ^{-1/2}`` with per-factor damping (raw basis);
    ``kind='ekfac'``: the EK-FAC-whitened eigenbasis coordinates ``W`` of :func:`reference.whiten`."""
    def enc(ctx, seed):
        e = Encoded()
        for li, ((_, G, A, S), Gq) in enumerate(zip(ctx["layers"], ctx["Gq"], strict=True)):
            if kind == "kfac":
                def make(G=G, Gq=Gq, A=A, S=S):
                    Sw, Aw = C.factor_whiteners(A, S, ctx["damping"])
                    return Sw @ G @ Aw, Sw @ Gq @ Aw
                W, Wq = _cached(ctx, ("kfac-whiten", li), make)
            else:
                W, Wq = whitened(ctx, li)
            k_g, k_a = size(*G.shape[1:])
            P_g = C.gaussian_projection(k_g, G.shape[1], seed * 7919 + 2 * li)
            P_a = C.gaussian_projection(k_a, G.shape[2], seed * 7919 + 2 * li + 1)
            t, nb = _code(C.project(W, P_g, P_a), code, seed)
            e.add(C.project(Wq, P_g, P_a), t, None, nb)
        return e
    return enc


def eigen_norm_codec(code: str) -> Callable:
    """Damping-free codes: the rotated rows ``R = Q_Sᵀ G Q_A`` scaled per column by ``√Λ*`` (shared, not
    per example), coded, and scaled back; the query side ``R_q ⊙ (Λ + δ)⁻¹`` applies any damping."""
    def enc(ctx, seed):
        e = Encoded()
        for li, curv in enumerate(ctx["ekfac"]):
            W, Wq = whitened(ctx, li)
            back = curv.damped(ctx["damping"], 0.5)  # W ⊙ back = R
            col = np.sqrt(np.maximum(curv.Lambda, 1e-30 * max(float(curv.Lambda.mean()), 1e-300)))
            t, nb = _code(W * back / col, code, seed)
            t = t * col
            inv = curv.damped(ctx["damping"], -1.0)
            e.add(Wq * back * inv, t, t * inv, nb)
        return e
    return enc


def topvar_codec(frac: float, code: str, curv_key: str = "ekfac", norm: bool = False) -> Callable:
    """Whitened eigenbasis, keeping only the ``frac`` share of coordinates (over all layers) with the
    largest whitened variance ``E[W²] = Λ*/(Λ* + δ)`` (within a layer: the largest ``Λ*``); those
    columns are coded. The kept column indices are stored once (shared bytes).
    ``norm``: code the rotated coordinates ``R`` scaled per column by ``1/√Λ*`` instead of ``W``, so the
    stored codes do not depend on the damping (the query side applies ``(Λ + δ)⁻¹``)."""
    def enc(ctx, seed):
        damp = ctx["damping"]
        var = [np.ravel(c.Lambda * c.damped(damp, -1.0)) for c in ctx[curv_key]]
        allv = np.concatenate(var)
        n_keep = max(1, int(round(frac * allv.size)))
        cut = np.sort(allv)[::-1][n_keep - 1]
        e = Encoded()
        for li, v in enumerate(var):
            keep = np.flatnonzero(v >= cut)
            if len(keep) == 0:
                continue
            W, Wq = whitened(ctx, li, curv_key)
            W, Wq = W.reshape(len(W), -1)[:, keep], Wq.reshape(len(Wq), -1)[:, keep]
            if norm:
                curv = ctx[curv_key][li]
                back = curv.damped(damp, 0.5).ravel()[keep]  # W ⊙ back = R
                lam = curv.Lambda.ravel()[keep]
                col = np.sqrt(np.maximum(lam, 1e-30 * max(float(curv.Lambda.mean()), 1e-300)))
                inv = curv.damped(damp, -1.0).ravel()[keep]
                t, nb = _code(W * back / col, code, seed)
                t = t * col
                e.add(Wq * back * inv, t, t * inv, nb)
            else:
                t, nb = _code(W, code, seed)
                e.add(Wq, t, None, nb)
            e.shared_bytes += 4 * len(keep)
        return e
    return enc


# -- the grid -------------------------------------------------------------------------------------------
def _k(k: int) -> Callable:
    return lambda n_out, n_in: (min(k, n_out), min(k, n_in))


def _r(r: float) -> Callable:
    return lambda n_out, n_in: C.ratio_sizes(n_out, n_in, r)


RATIOS = (0.125, 0.25, 0.354, 0.5, 0.707)


GRIDS = ("full", "quick", "default")
"""The study's codec grids: every codec, a smoke handful, or the library's default codes (for a damping sweep)."""


def grid(name: str = "full") -> list[tuple[str, str, Callable, bool]]:
    """``(family, name, encoder, random)`` for every compression of the grid ``name`` (:data:`GRIDS`);
    ``random``: averaged over projection seeds. ``default``: the exact reference (``raw fp32``), the
    library's default codes (``eigen int4``) and their nearest alternatives, all deterministic."""
    if name not in GRIDS:
        raise ValueError(f"study grid must be one of {GRIDS}, got {name!r}")
    if name == "default":
        return [("raw (EK-FAC query)", "raw fp32", raw_codec("fp32"), False),
                ("eigen (EK-FAC whitened)", "eigen int8", eigen_codec("int8"), False),
                ("eigen (EK-FAC whitened)", "eigen int4", eigen_codec("int4"), False),
                ("eigen (EK-FAC whitened)", "eigen int4-mse", eigen_codec("int4-mse"), False),
                ("eigen, damping-free codes (column scale √Λ*)", "eigen-norm int4", eigen_norm_codec("int4"), False),
                ("eigen top-variance int8", "topvar 0.5 int8", topvar_codec(0.5, "int8"), False)]
    if name == "quick":
        return [("raw", "raw fp32", raw_codec("fp32"), False),
                ("raw", "raw int8", raw_codec("int8"), False),
                ("eigen", "eigen int4", eigen_codec("int4"), False),
                ("proj k×k fp32", "proj 8x8 fp32", proj_ekfac_codec(_k(8)), True),
                ("whitened proj (EK-FAC)", "wproj r=0.5 fp32", whitened_proj_codec(_r(0.5)), True)]
    g: list[tuple[str, str, Callable, bool]] = []
    for code in ("fp32", "fp16", "int8", "int4"):
        g.append(("raw (EK-FAC query)", f"raw {code}", raw_codec(code), False))
    for code in ("fp16", "int8", "int4", "int4-mse", "int4-sr", "int3-mse", "int2-mr"):
        g.append(("eigen (EK-FAC whitened)", f"eigen {code}", eigen_codec(code), False))
    for code in ("int8", "int4"):
        g.append(("eigen (K-FAC whitened)", f"eigen-kfac {code}", eigen_codec(code, "kfac"), False))
        g.append(("eigen, damping-free codes (column scale √Λ*)", f"eigen-norm {code}", eigen_norm_codec(code),
                  False))
    for k in (4, 8, 16, 32, 64, 128):
        g.append(("proj k×k fp32 (EK-FAC fit in projection)", f"proj {k}x{k} fp32", proj_ekfac_codec(_k(k)), True))
    for r in RATIOS:
        g.append(("proj r·N fp32 (EK-FAC fit in projection)", f"proj r={r} fp32", proj_ekfac_codec(_r(r)), True))
    for r in (0.354, 0.707):
        g.append(("proj r·N int8 (EK-FAC fit in projection)", f"proj r={r} int8",
                  proj_ekfac_codec(_r(r), "int8"), True))
    for r in (0.25, 0.354, 0.5, 1.0):
        g.append(("K-FAC-whitened proj fp32", f"kwproj r={r} fp32", whitened_proj_codec(_r(r), kind="kfac"), True))
        g.append(("EK-FAC-whitened proj fp32", f"wproj r={r} fp32", whitened_proj_codec(_r(r)), True))
    g.append(("EK-FAC-whitened proj int8", "wproj r=0.707 int8", whitened_proj_codec(_r(0.707), "int8"), True))
    g.append(("K-FAC-whitened proj int8", "kwproj r=0.707 int8", whitened_proj_codec(_r(0.707), "int8", kind="kfac"),
              True))
    for frac in (0.5, 0.25, 0.125, 0.0625, 0.03125):
        for code in ("fp16", "int8", "int4"):
            g.append((f"eigen top-variance {code}", f"topvar {frac} {code}", topvar_codec(frac, code), False))
    for frac, code in ((0.5, "int8"), (0.25, "int8"), (0.25, "int4"), (0.125, "int8")):
        g.append((f"eigen top-Λ*, damping-free {code}", f"topvar-norm {frac} {code}",
                  topvar_codec(frac, code, norm=True), False))
    return g


# -- driver ----------------------------------------------------------------------------------------------
def run_study(model: torch.nn.Module, setup, masks: np.ndarray, losses: np.ndarray, cfg, log=print) -> dict:
    """Every codec of :func:`grid` on one corpus: LDS, share and top-k overlap against full-space EK-FAC,
    fact recall@1 (plain and self-normalized), bytes per example and encode seconds.

    The gradients and factors are captured and fitted once; with ``cfg.study_dampings`` the grid is rerun
    at each of those dampings (``by_damping``: each against full-space EK-FAC at the same damping, and
    ``top{k}_overlap_vs_default`` against it at ``cfg.damping``). The top-level ``reference`` and ``rows``
    are always at ``cfg.damping``."""
    quick = cfg.study_grid == "quick"
    t0 = time.perf_counter()
    pad = setup.tokenizer.pad_token_id
    model.requires_grad_(True)
    G, A, S, _ = capture_full(model, setup.train.input_ids, setup.train.labels, pad)
    Qids = setup.query.input_ids + (setup.fact_query.input_ids if setup.facts else [])
    Qlab = setup.query.labels + (setup.fact_query.labels if setup.facts else [])
    Gq, _, _, _ = capture_full(model, Qids, Qlab, pad)
    t_capture = time.perf_counter() - t0
    names = list(G)
    layers = [(n, G[n], A[n], S[n]) for n in names]
    full_bytes = 4 * sum(G[n][0].size for n in names)
    ctx = {"layers": layers, "Gq": [Gq[n] for n in names], "damping": cfg.damping}
    t1 = time.perf_counter()
    ctx["ekfac"] = [C.fit_curvature(A[n], S[n], G[n], "ekfac") for n in names]
    t_fit = time.perf_counter() - t1
    ctx["kfac"] = [C.fit_curvature(A[n], S[n], None, "kfac") for n in names]
    # cheap factor pass before capture: A, S and Λ* from a random sample of the training set
    rng = np.random.default_rng(0)
    samples = {}
    for share in ((0.25, 0.5) if cfg.study_grid == "full" else ()):
        rows = np.sort(rng.choice(len(setup.train), max(2, int(share * len(setup.train))), replace=False))
        Gs, As, Ss, _ = capture_full(model, [setup.train.input_ids[i] for i in rows],
                                     [setup.train.labels[i] for i in rows], pad)
        ctx[f"ekfac-sample{share}"] = [C.fit_curvature(As[n], Ss[n], Gs[n], "ekfac") for n in names]
        samples[share] = len(rows)
    log(f"[{setup.name}] study: full-space gradients captured ({t_capture:.1f} s), EK-FAC fitted "
        f"({t_fit:.1f} s); {full_bytes} float32 bytes per example")

    extra = [] if cfg.study_grid != "full" else [
        ("eigen, factors from a sample", "eigen int4, sample 25%", eigen_codec("int4", "ekfac-sample0.25"), False),
        ("eigen, factors from a sample", "eigen int4, sample 50%", eigen_codec("int4", "ekfac-sample0.5"), False),
        ("eigen, factors from a sample", "eigen int8, sample 25%", eigen_codec("int8", "ekfac-sample0.25"), False),
        ("eigen, factors from a sample", "topvar 0.25 int8, sample 25%", topvar_codec(0.25, "int8", "ekfac-sample0.25"),
         False),
        ("eigen, factors from a sample", "topvar 0.25 int8, sample 50%", topvar_codec(0.25, "int8", "ekfac-sample0.5"),
         False),
        ("eigen, fp16 store transcoded", "eigen int4 from fp16 store", eigen_codec("int4", g_transform=C.fp16),
         False),
    ]
    codecs = grid("quick" if quick else cfg.study_grid) + extra
    dampings = [cfg.damping] + [d for d in getattr(cfg, "study_dampings", ()) if d != cfg.damping]
    by_damping: dict[str, dict] = {}
    default_top = None
    for d in dampings:
        ctx["damping"], ctx["cache"] = d, {}  # whitened rows depend on the damping
        t2 = time.perf_counter()
        res = _study_at(ctx, codecs, setup, masks, losses, cfg, full_bytes, default_top)
        default_top = res.pop("_ref_top") if default_top is None else default_top
        res.pop("_ref_top", None)
        res["seconds"] = round(time.perf_counter() - t2, 1)
        by_damping[str(d)] = res
        ref = res["reference"]
        log(f"[{setup.name}] study at δ={d}: reference LDS {ref['lds']:.3f}, {len(res['rows'])} codecs "
            f"({res['seconds']:.0f} s)")
    out = {**by_damping[str(cfg.damping)],
           "full_float32_bytes_per_example": full_bytes,
           "layers": {n: list(G[n].shape[1:]) for n in names},
           "sample_fit_examples": samples,
           "seconds": {"capture_full_space": round(t_capture, 1), "ekfac_fit_full_space": round(t_fit, 2),
                       "total": round(time.perf_counter() - t0, 1)}}
    if len(dampings) > 1:
        out["by_damping"] = {str(d): by_damping[str(d)] for d in sorted(dampings)}
    return out


def _study_at(ctx: dict, codecs: list, setup, masks: np.ndarray, losses: np.ndarray, cfg, full_bytes: int,
              default_top: np.ndarray | None) -> dict:
    """Reference and codec rows at ``ctx['damping']``; ``default_top``: the reference's top-k at
    ``cfg.damping`` (None when this *is* that damping) for ``top{k}_overlap_vs_default``."""
    k, damping = cfg.top_k, ctx["damping"]
    n_q = len(setup.query.input_ids)
    ref = sum(C.influence(Gq, lay[1], c, damping) for lay, Gq, c in zip(ctx["layers"], ctx["Gq"], ctx["ekfac"],
                                                                          strict=True))
    ref_ev = evaluate(ref[:n_q], masks, losses)
    ref_lds = float(ref_ev["per_query"].mean())
    ref_top = top_indices(ref[:n_q], k)
    base_top = ref_top if default_top is None else default_top
    ref_self = sum(np.square(whitened(ctx, li)[0]).reshape(len(ctx["layers"][li][1]), -1).sum(1)
                   for li in range(len(ctx["layers"])))  # ⟨(H+δI)⁻¹ g_i, g_i⟩
    reference = {"method": "ekfac", "damping": damping, "lds": ref_lds,
                 "lds_se": float(ref_ev["per_query"].std(ddof=1) / math.sqrt(n_q)),
                 f"top{k}_overlap_vs_default": float(overlap_at_k(ref_top, base_top).mean()),
                 "fact_recall": None if not setup.facts else fact_recall(ref[n_q:], setup.fact_rows),
                 "fact_recall_selfnorm": None if not setup.facts else fact_recall(
                     ref[n_q:] / np.sqrt(np.where(ref_self > 0, ref_self, np.inf))[None, :], setup.fact_rows)}
    rows = []
    for family, name, enc, random in codecs:
        seeds = range(cfg.study_seeds if random else 1)
        per = []
        for seed in seeds:
            t2 = time.perf_counter()
            e = enc(ctx, seed)
            secs = time.perf_counter() - t2
            s = C.scores(e.q, e.t)  # [Q + F, N]
            selfinf = sum((a * b).sum(1) for a, b in zip(e.selfside, e.t, strict=True))
            ev = evaluate(s[:n_q], masks, losses)
            sn = s[n_q:] / np.sqrt(np.where(selfinf > 0, selfinf, np.inf))[None, :]
            top = top_indices(s[:n_q], k)
            per.append({"lds_q": ev["per_query"], "overlap": overlap_at_k(top, ref_top),
                        "overlap_default": overlap_at_k(top, base_top),
                        "fact": fact_recall(s[n_q:], setup.fact_rows) if setup.facts else None,
                        "fact_sn": fact_recall(sn, setup.fact_rows) if setup.facts else None,
                        "bytes": e.bytes, "shared": e.shared_bytes, "secs": secs})
        pq = np.mean([p["lds_q"] for p in per], axis=0)
        diff = pq - ref_ev["per_query"]
        row = {"family": family, "name": name, "bytes_per_example": int(per[0]["bytes"]),
               "shared_bytes": int(per[0]["shared"]), "bytes_fraction": per[0]["bytes"] / full_bytes,
               "lds": float(pq.mean()), "lds_se": float(pq.std(ddof=1) / math.sqrt(len(pq))),
               "lds_share": float(pq.mean() / ref_lds), "diff_vs_ref": float(diff.mean()),
               "diff_vs_ref_se": float(diff.std(ddof=1) / math.sqrt(len(diff))),
               f"top{k}_overlap": float(np.mean([p["overlap"].mean() for p in per])),
               "fact_recall": None if not setup.facts else float(np.mean([p["fact"] for p in per])),
               "fact_recall_selfnorm": None if not setup.facts else float(np.mean([p["fact_sn"] for p in per])),
               "encode_seconds": round(float(np.mean([p["secs"] for p in per])), 3), "seeds": len(per)}
        if default_top is not None:
            row[f"top{k}_overlap_vs_default"] = float(np.mean([p["overlap_default"].mean() for p in per]))
        if len(per) > 1:
            row["lds_share_seed_std"] = float(np.std([p["lds_q"].mean() / ref_lds for p in per], ddof=1))
        rows.append(row)
    return {"reference": reference, "rows": rows, "_ref_top": ref_top}


def meets_targets(row: dict, k: int = 10) -> bool:
    """The compression target (benchmarks/README.md, "Targets quoted below"): ≥ 95% of full-space
    EK-FAC's LDS, ≥ 90% of its top-10, ≤ 1/8 of the float32 bytes (per-row
    scales included; a 0.1% allowance covers them), every planted fact at rank 1."""
    return (row["lds_share"] >= 0.95 and row[f"top{k}_overlap"] >= 0.90 and row["bytes_fraction"] <= 0.125 * 1.001
            and row["fact_recall"] in (None, 1.0))


def format_study(study: dict, k: int = 10) -> str:
    ref = study["reference"]
    lines = [f"-- compression study: reference full-space EK-FAC (δ={ref['damping']}) LDS {ref['lds']:.3f} "
             f"± {ref['lds_se']:.3f}, fact recall {ref['fact_recall']}; full float32 "
             f"{study['full_float32_bytes_per_example']} B/example",
             f"{'compression':<30}{'bytes':>9}{'frac':>8}{'LDS':>7}{'±SE':>6}{'share':>7}{f'top{k}':>7}"
             f"{'fact':>6}{'f-sn':>6}{'enc s':>7}  target"]
    for r in study["rows"]:
        lines.append(f"{r['name']:<30}{r['bytes_per_example']:>9}{r['bytes_fraction']:>8.4f}{r['lds']:>7.3f}"
                     f"{r['lds_se']:>6.3f}{r['lds_share']:>7.3f}{r[f'top{k}_overlap']:>7.3f}"
                     f"{(r['fact_recall'] if r['fact_recall'] is not None else float('nan')):>6.2f}"
                     f"{(r['fact_recall_selfnorm'] if r['fact_recall_selfnorm'] is not None else float('nan')):>6.2f}"
                     f"{r['encode_seconds']:>7.2f}  {'MEETS' if meets_targets(r, k) else ''}")
    return "\n".join(lines)


DAMPING_CODECS = ("eigen int4", "eigen int8", "eigen int4-mse", "eigen-norm int4", "topvar 0.5 int8")
"""Codecs of the damping tables besides the reference, when the study has them."""


def format_damping(study: dict, k: int = 10) -> str:
    """The study per damping: full-space EK-FAC (LDS, top-k overlap with itself at the default damping,
    facts), then per codec its LDS share and top-k overlap at the same damping and with the default's."""
    lines = [f"-- study by damping (reference: full-space EK-FAC at each δ; 'vs δ0': top-{k} overlap with it at "
             f"δ={study['reference']['damping']})",
             f"{'δ':>7}{'ref LDS':>9}{'±SE':>7}{'vs δ0':>7}{'facts':>11}   " + "   ".join(
                 f"{n}: LDS share, top-{k}, vs δ0, facts" for n in DAMPING_CODECS
                 if any(r["name"] == n for r in study["rows"]))]
    for d, st in study["by_damping"].items():
        ref = st["reference"]
        cells = f"{d:>7}{ref['lds']:>9.3f}{ref['lds_se']:>7.3f}{ref[f'top{k}_overlap_vs_default']:>7.2f}" \
                f"{_facts(ref):>11}"
        rows = {r["name"]: r for r in st["rows"]}
        for n in DAMPING_CODECS:
            if n in rows:
                r = rows[n]
                cells += f"   {r['lds']:.3f} {r['lds_share']:.3f} {r[f'top{k}_overlap']:.2f} " \
                         f"{r.get(f'top{k}_overlap_vs_default', r[f'top{k}_overlap']):.2f} {_facts(r)}"
        lines.append(cells)
    return "\n".join(lines)


def _facts(r: dict) -> str:
    if r.get("fact_recall") is None:
        return "-"
    return f"{r['fact_recall']:.2f}/{r['fact_recall_selfnorm']:.2f}"


def damping_markdown(result: dict, codecs: tuple[str, ...] = ("eigen int4",)) -> str:
    """Markdown table of the study by damping, one row per corpus and δ: full-space EK-FAC (LDS ± SE over
    queries, top-k overlap with itself at the default damping, facts plain / self-normalized), then per
    codec: LDS, share of the same-δ reference (± the paired SE, relative), top-k overlap with the same-δ
    reference and with the default-δ reference, facts."""
    k = result["config"]["top_k"]
    d0 = result["config"]["damping"]
    head = f"| corpus | δ | EK-FAC LDS | top-{k} vs δ={d0} | facts |" + "".join(
        f" {c}: LDS | share | top-{k} | top-{k} vs δ={d0} | facts |" for c in codecs)
    lines = [head, "|" + " --- |" * (5 + 5 * len(codecs))]
    for corpus, res in result["corpora"].items():
        st = (res.get("study") or {}).get("by_damping")
        if not st:
            continue
        for d, sd in st.items():
            ref = sd["reference"]
            cells = f"| {corpus} | {d} | {ref['lds']:.3f} ± {ref['lds_se']:.3f} | " \
                    f"{ref[f'top{k}_overlap_vs_default']:.2f} | {_facts(ref).replace('/', ' / ')} |"
            rows = {r["name"]: r for r in sd["rows"]}
            for c in codecs:
                r = rows.get(c)
                if r is None:
                    cells += " | | | | |"
                    continue
                se = r["diff_vs_ref_se"] / ref["lds"]
                cells += f" {r['lds']:.3f} | {r['lds_share']:.2f} ± {se:.2f} | {r[f'top{k}_overlap']:.2f} | " \
                         f"{r.get(f'top{k}_overlap_vs_default', r[f'top{k}_overlap']):.2f} | " \
                         f"{_facts(r).replace('/', ' / ')} |"
            lines.append(cells)
    return "\n".join(lines)


def plot_study(result: dict, path: Path) -> None:
    """Share of full-space EK-FAC's LDS (top row) and top-k overlap with it (bottom row) against bytes per
    example (log x), one line per compression family, one column per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = result["config"]["top_k"]
    corpora = {c: r["study"] for c, r in result["corpora"].items() if r.get("study")}
    fig, axes = plt.subplots(2, len(corpora), figsize=(9 * len(corpora), 11), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>pXh*"
    for col, (corpus, st) in enumerate(corpora.items()):
        fams: dict[str, list[dict]] = {}
        for r in st["rows"]:
            fams.setdefault(r["family"], []).append(r)
        full = st["full_float32_bytes_per_example"]
        panels = (("lds_share", "share of full-space EK-FAC LDS", 0.95),
                  (f"top{k}_overlap", f"top-{k} overlap with full-space EK-FAC", 0.90))
        for row, (key, label, line) in enumerate(panels):
            ax = axes[row][col]
            for i, (fam, rs) in enumerate(fams.items()):
                rs = sorted(rs, key=lambda r: r["bytes_per_example"])
                ax.plot([r["bytes_per_example"] for r in rs], [r[key] for r in rs], marker=markers[i % len(markers)],
                        ms=5, color=colors[i % len(colors)], label=fam)
            ax.axvline(full / 8, color="k", ls="--", lw=1)
            ax.text(full / 8, 1.03, " 1/8 of float32", fontsize=8)
            ax.axhline(line, color="k", ls=":", lw=1)
            ax.set_xscale("log")
            ax.set_ylim(0, 1.1)
            ax.set_xlabel("bytes per example (log)")
            ax.set_ylabel(label)
            ax.set_title(f"{corpus}: reference LDS {st['reference']['lds']:.3f} ± {st['reference']['lds_se']:.3f}")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_damping(result: dict, path: Path, codecs: tuple[str, ...] = ("eigen int4", "eigen-norm int4")) -> None:
    """Per corpus (columns): LDS of full-space EK-FAC and of ``codecs`` against the relative damping (top), and
    top-k overlap with full-space EK-FAC at the same damping and at the default one (bottom); log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, d0 = result["config"]["top_k"], result["config"]["damping"]
    corpora = {c: r["study"]["by_damping"] for c, r in result["corpora"].items()
               if (r.get("study") or {}).get("by_damping")}
    fig, axes = plt.subplots(2, len(corpora), figsize=(5 * len(corpora), 8), squeeze=False)
    for col, (corpus, by) in enumerate(corpora.items()):
        ds = sorted(by, key=float)
        x = [float(d) for d in ds]
        ax = axes[0][col]
        ax.errorbar(x, [by[d]["reference"]["lds"] for d in ds], [by[d]["reference"]["lds_se"] for d in ds],
                    color="k", marker="o", capsize=3, label="full-space EK-FAC (exact)")
        for c in codecs:
            rows = [{r["name"]: r for r in by[d]["rows"]}.get(c) for d in ds]
            if all(rows):
                ax.plot(x, [r["lds"] for r in rows], marker="s", label=c)
        ax.set(xscale="log", xlabel="relative damping δ", ylabel="LDS", title=corpus)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.plot(x, [by[d]["reference"][f"top{k}_overlap_vs_default"] for d in ds], color="k", marker="o",
                label=f"full-space EK-FAC vs itself at δ={d0}")
        for c in codecs:
            rows = [{r["name"]: r for r in by[d]["rows"]}.get(c) for d in ds]
            if all(rows):
                ax.plot(x, [r[f"top{k}_overlap"] for r in rows], marker="s", label=f"{c} vs EK-FAC at the same δ")
        ax.axhline(0.9, color="k", ls=":", lw=1)
        ax.set(xscale="log", xlabel="relative damping δ", ylabel=f"top-{k} overlap", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def study_markdown(result: dict, names: list[str] | None = None) -> str:
    """A markdown table of the study, corpora side by side: bytes fraction, LDS share (± the standard error
    of the paired per-query difference to the reference, relative), top-k overlap, fact recall@1
    (plain / self-normalized); ``names``: the rows to show (default all)."""
    k = result["config"]["top_k"]
    studies = {c: r["study"] for c, r in result["corpora"].items() if r.get("study")}
    first = next(iter(studies.values()))
    names = names or [r["name"] for r in first["rows"]]
    head = "| compression | bytes/example | of fp32 |" + "".join(
        f" {c}: LDS share | top-{k} | facts |" for c in studies)
    lines = [head, "|" + " --- |" * (3 + 3 * len(studies))]
    for name in names:
        rows = {c: {r["name"]: r for r in st["rows"]}.get(name) for c, st in studies.items()}
        r0 = next(r for r in rows.values() if r)
        cells = f"| {name} | {r0['bytes_per_example']} | {r0['bytes_fraction']:.3f} |"
        for c, r in rows.items():
            if r is None:
                cells += " | | |"
                continue
            fr = "" if r["fact_recall"] is None else f"{r['fact_recall']:.2f} / {r['fact_recall_selfnorm']:.2f}"
            se = r["diff_vs_ref_se"] / studies[c]["reference"]["lds"]  # paired with the reference, per query
            cells += f" {r['lds_share']:.2f} ± {se:.2f} | {r[f'top{k}_overlap']:.2f} | {fr} |"
        lines.append(cells)
    return "\n".join(lines)


if __name__ == "__main__":  # print the study's tables from a results file
    import json
    import sys

    res = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/fidelity.json").read_text())
    if any((r.get("study") or {}).get("by_damping") for r in res["corpora"].values()):
        print(damping_markdown(res, tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("eigen int4",)))
    else:
        print(study_markdown(res))
