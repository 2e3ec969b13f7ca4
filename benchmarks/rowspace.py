"""What should a stored row hold? Share of full-space EK-FAC's ranking kept per byte of row.

One small GPT-2 trained on the stdlib corpus (``benchmarks/fidelity.py``'s setup and trainer).
Every training and query example's full per-layer gradient ``G`` ``[N_o, N_i+1]`` is captured once
(``GradientCapture`` with no projection), with the full-space factors ``A``, ``S`` of the training
set. The reference is full-space EK-FAC (damping 0.1, relative). Each row recipe is then applied
to the same ``G``s exactly as a build would apply it (the library's ``allocate``,
``projection_matrix``, ``kfac_basis``), with EK-FAC fitted in the stored space as
``gradindex precondition`` fits it (``A``, ``S`` mapped by the same maps, ``Λ*`` from the rows):

* budget: 1/64, 1/16, 1/8, 1/4 of the full gradient's float32 bytes;
* allocation of the budget over layers: ``equal`` (one ``k``), ``ratio`` (same share per layer),
  ``spectrum`` (``k`` ∝ effective rank of each factor);
* basis: ``raw`` (random factored projection) or ``kfac`` (each side whitened by its damped
  full-space factor first), each scored by EK-FAC fitted on the rows (and, for ``kfac``, by the
  plain inner product of rows, which is what ``--method kfac`` computes on such an index);
* storage: float32, or int8/int4 codes with one scale per row and layer (the budget then buys 4×
  or 8× the numbers), in the raw basis or in the EK-FAC whitened eigenbasis
  (``gradindex compact --basis ekfac``).

Quality: per-query Spearman of the scores over the training set and top-10 overlap, both against
full-space EK-FAC, averaged over queries (and projection seeds). An end-to-end check builds one
recipe through the library (``build_store`` with a budget and the ``kfac`` basis, an EK-FAC fit,
``score_matrix``) and compares its scores with the simulated ones.

    python -m benchmarks.rowspace            # ~2 min on 2 cores; writes benchmarks/results/rowspace.json
    python -m benchmarks.rowspace --quick    # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.common import spearman_rows, train_model  # noqa: E402
from benchmarks.fidelity import FidelityConfig, make_setup, new_model  # noqa: E402
from gradindex.capture import (  # noqa: E402
    GradientCapture,
    KfacSums,
    ProjectedRows,
    ProjectionSpec,
    RowSpace,
    projection_matrix,
)
from gradindex.capture.allocation import allocate, stored_numbers  # noqa: E402
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.store.basis import kfac_basis  # noqa: E402

DAMPING = 0.1
BUDGETS = ("1/64", "1/16", "1/8", "1/4")
RULES = ("equal", "ratio", "spectrum")
TOP = 10


def capture_full(model, tok, data, batch: int = 16, covariance: bool = False):
    """layer → ``[n, N_o, N_i+1]`` float32 full gradients (and full-space float64 ``(A, S)`` token means)."""
    model.requires_grad_(False)
    spec = ProjectionSpec(kind="none", k_a=0, k_g=0)
    space = RowSpace(spec)
    kfac = KfacSums(space)
    cap = GradientCapture(model, None, ProjectedRows(space, "materialized"), *([kfac] if covariance else []))
    out: dict[str, list] = {}
    with cap:
        for s in range(0, len(data), batch):
            bg = batch_gradients(model, cap, data.input_ids[s:s + batch], data.labels[s:s + batch],
                                 tok.pad_token_id)
            for n, v in bg.grads.items():
                out.setdefault(n, []).append(v.float().numpy())
    G = {n: np.concatenate(v).reshape(-1, *space.dims(n)) for n, v in out.items()}
    factors = {n: (A.numpy(), S.numpy()) for n, (A, S, _) in kfac.means().items()} if covariance else None
    return G, factors


def right(x: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``x @ M`` for a batch ``x`` ``[b, r, n]`` as one 2-D BLAS product (numpy's stacked matmul is slow)."""
    b, r, n = x.shape
    return (np.ascontiguousarray(x).reshape(b * r, n) @ M).reshape(b, r, -1)


def left(M: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``M @ x`` for a batch ``x`` ``[b, n, c]``."""
    return right(x.transpose(0, 2, 1), M.T).transpose(0, 2, 1)


def ekfac_fit(rows: np.ndarray, A: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(Q_S, Q_A, (Λ*+δ)^{-1/2})`` of one layer from its rows ``[n, k_g, k_a]`` and factors."""
    Q_A = np.linalg.eigh(0.5 * (A + A.T))[1].astype(np.float32)
    Q_S = np.linalg.eigh(0.5 * (S + S.T))[1].astype(np.float32)
    R = right(left(Q_S.T, rows), Q_A)
    lam = (R.astype(np.float64) ** 2).mean(0)
    delta = DAMPING * lam.mean() if lam.mean() > 0 else DAMPING
    return Q_S, Q_A, (1.0 / np.sqrt(lam + delta)).astype(np.float32)


def whitened(x: np.ndarray, fit) -> np.ndarray:
    """Rows ``[n, k_g, k_a]`` → EK-FAC whitened eigenbasis rows ``[n, k_g·k_a]``."""
    Q_S, Q_A, scale = fit
    return (right(left(Q_S.T, x), Q_A) * scale).reshape(len(x), -1)


def quantize(x: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric per-row codes with one float scale per row (what a coded store decodes to)."""
    if bits >= 32:
        return x
    levels = 2 ** (bits - 1) - 1
    scale = np.abs(x).max(1, keepdims=True) / levels
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / scale), -levels, levels) * scale


def agreement(score: np.ndarray, ref: np.ndarray) -> dict:
    sp = spearman_rows(score, ref)
    top = np.argsort(-score, 1)[:, :TOP]
    rtop = np.argsort(-ref, 1)[:, :TOP]
    overlap = [len(set(a) & set(b)) / TOP for a, b in zip(top, rtop, strict=True)]
    return {"spearman": float(sp.mean()), "top10": float(np.mean(overlap))}


def side_maps(layer, sizes, seed, basis):
    """``(M_a, M_g)`` per layer: the random projection after the optional whitening (``None`` = exact side)."""
    k_a, k_g = sizes
    spec = ProjectionSpec(kind="gaussian", k_a=0, k_g=0, seed=seed, sizes=((layer, k_a, k_g),))
    out = []
    for side, k, W in (("a", k_a, basis.W_a.get(layer)), ("g", k_g, basis.W_g.get(layer))):
        n = W.shape[0] if W is not None else None
        M = None
        if k:
            n = n or (layer_widths[layer][0] if side == "a" else layer_widths[layer][1])
            M = projection_matrix(spec, layer, side, n).double().numpy()
        if W is not None:
            M = W if M is None else M @ W
        out.append(M)
    return out


layer_widths: dict[str, tuple[int, int]] = {}


_MAPPED: dict = {}


def mapped(Gt, Gq, factors, plan, seed, basis_name, basis) -> dict:
    """Per layer: stored-space train and query rows ``[n, k_g, k_a]`` and the EK-FAC fitted on them (cached)."""
    key = (tuple(sorted(plan.items())), seed, basis_name)
    if key not in _MAPPED:
        _MAPPED.clear()  # one recipe at a time: the rows of an exact plan are as large as the gradients
        out = {}
        for n in Gt:
            M_a, M_g = side_maps(n, plan[n], seed, basis)
            A, S = factors[n]
            t, q = Gt[n], Gq[n]
            if M_a is not None:
                M_a = M_a.astype(np.float32)
                t, q, A = right(t, M_a.T), right(q, M_a.T), M_a @ A @ M_a.T
            if M_g is not None:
                M_g = M_g.astype(np.float32)
                t, q, S = left(M_g, t), left(M_g, q), M_g @ S @ M_g.T
            out[n] = (t, q, ekfac_fit(t, A, S))
        _MAPPED[key] = out
    return _MAPPED[key]


def recipe_scores(Gt, Gq, factors, plan, seed, basis_name, basis, variants) -> dict[tuple, np.ndarray]:
    """Scores ``[Q, N]`` per ``(bits, eigen, method)`` for the storage variants ``(bits, eigen)`` of one recipe.

    ``ekfac``: EK-FAC fitted on the rows; ``dot``: plain inner products of the rows (``--method kfac``
    on a whitened index). ``eigen``: rows coded in the EK-FAC whitened eigenbasis (``gradindex compact``).
    """
    out: dict[tuple, np.ndarray] = {}

    def add(key, v):
        out[key] = out.get(key, 0.0) + v

    for t, q, fit in mapped(Gt, Gq, factors, plan, seed, basis_name, basis).values():
        wq = whitened(q, fit)
        for bits, eigen in variants:
            if eigen:
                add((bits, True, "ekfac"), wq @ quantize(whitened(t, fit), bits).T)
                continue
            tq = quantize(t.reshape(len(t), -1), bits)
            add((bits, False, "ekfac"), wq @ whitened(tq.reshape(t.shape), fit).T)
            add((bits, False, "dot"), q.reshape(len(q), -1) @ tq.T)
    return out


def run(cfg: FidelityConfig, budgets, rules, seeds: int, log=print, check: bool = True,
        basis_dampings: tuple[float, ...] = (), storages: tuple[str, ...] = ("int8", "int4")) -> dict:
    t0 = time.perf_counter()
    setup = make_setup(cfg)
    model = train_model(new_model(cfg, len(setup.tokenizer)), setup.train.input_ids, cfg, seed=0)
    log(f"trained in {time.perf_counter() - t0:.1f} s")
    Gt, factors = capture_full(model, setup.tokenizer, setup.train, covariance=True)
    Gq, _ = capture_full(model, setup.tokenizer, setup.query)
    layer_widths.update({n: (g.shape[2], g.shape[1]) for n, g in Gt.items()})
    full_numbers = sum(a * g for a, g in layer_widths.values())
    log(f"captured {len(setup.train)} x {len(setup.query)} full gradients, {len(Gt)} layers, "
        f"{full_numbers} numbers ({4 * full_numbers} float32 bytes) per example")
    raw = kfac_basis({}, DAMPING)
    bases = {"raw": raw, "kfac": kfac_basis(factors, DAMPING)}
    bases.update({f"kfac@{d:g}": kfac_basis(factors, d) for d in basis_dampings})
    spectra = bases["kfac"].spectra
    none = {n: (0, 0) for n in Gt}
    ref = recipe_scores(Gt, Gq, factors, none, 0, "raw", raw, [(32, False)])[(32, False, "ekfac")]
    rows = []
    bits_of = {"fp32": 32, "int8": 8, "int4": 4}

    def measure(budget, rule, basis, storages_here, plan, nseeds):
        """Rows of one plan and basis for storages ``[(storage, eigen)]``, sharing the mapping and fit."""
        variants = [(bits_of[st], eigen) for st, eigen in storages_here]
        res = [recipe_scores(Gt, Gq, factors, plan, s, basis, bases[basis], variants) for s in range(nseeds)]
        for storage, eigen in storages_here:
            bits = bits_of[storage]
            for method in (("ekfac", "dot") if basis.startswith("kfac") and not eigen else ("ekfac",)):
                ag = [agreement(r[(bits, eigen, method)], ref) for r in res]
                row = {"budget": budget, "allocation": rule, "basis": basis, "storage": storage,
                       "rows_in": "ekfac eigenbasis" if eigen else basis, "method": method,
                       "bytes": int(stored_numbers(layer_widths, plan) * bits / 8),
                       "numbers": int(stored_numbers(layer_widths, plan)),
                       "exact_layers": sum(1 for v in plan.values() if v == (0, 0)),
                       "spearman": float(np.mean([a["spearman"] for a in ag])),
                       "top10": float(np.mean([a["top10"] for a in ag]))}
                rows.append(row)
                log(f"  {budget:>5} {rule:<8} {basis:<9} {storage:<4} {row['rows_in']:<16} {method:<5} "
                    f"{row['bytes']:>8} B  spearman {row['spearman']:.3f}  top10 {row['top10']:.3f}")

    full_bytes = 4 * full_numbers
    for budget in budgets:
        b = int(full_bytes * Fraction(budget))
        for rule in rules:
            plan = allocate(layer_widths, b, rule, 4.0, spectra)
            for basis in ("raw", "kfac") + (tuple(f"kfac@{d:g}" for d in basis_dampings) if rule == "ratio" else ()):
                measure(budget, rule, basis, [("fp32", False)], plan, seeds)
        plans: dict[tuple, list[str]] = {}
        for storage, bpn in (("int8", 1.0), ("int4", 0.5)):
            if storage in storages:
                plan = allocate(layer_widths, b, "ratio", bpn, spectra)
                plans.setdefault(tuple(sorted(plan.items())), []).append(storage)
        for key, group in plans.items():
            plan = dict(key)
            exact = all(v == (0, 0) for v in plan.values())
            for basis in ("raw", "kfac"):
                measure(budget, "ratio", basis, [(st, e) for st in group for e in (False, True)], plan,
                        1 if exact else seeds)
    result = {"config": {"n_train": cfg.n_train, "n_query": cfg.n_query, "n_embd": cfg.n_embd,
                         "n_layer": cfg.n_layer, "steps": cfg.steps, "max_tokens": cfg.max_tokens,
                         "damping": DAMPING, "basis_damping": DAMPING, "proj_seeds": seeds,
                         "full_float32_bytes": 4 * full_numbers, "layers": layer_widths},
              "reference": "full-space EK-FAC (exact gradients, damping 0.1)", "rows": rows,
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpu": platform.processor() or platform.machine()}}
    if check:
        result["library_check"] = library_check(model, setup, Gt, Gq, factors, budgets[len(budgets) // 2], log)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def library_check(model, setup, Gt, Gq, factors, budget, log) -> dict:
    """Build the ``ratio``/``kfac`` recipe through the library; compare its EK-FAC scores with the simulation."""
    from gradindex.pipeline import BuildConfig, build_index
    from gradindex.query.scores import score_matrix
    from gradindex.store.basis import read_basis

    with tempfile.TemporaryDirectory() as d:
        cfg = BuildConfig.raw(budget=budget, allocation="ratio", basis="kfac", basis_damping=DAMPING, batch_size=16,
                          precondition="ekfac")
        res, _ = build_index(model, setup.tokenizer, setup.train, Path(d) / "idx", cfg, progress=False)
        spec = ProjectionSpec.from_dict(res.manifest["build"]["projection"])
        basis = read_basis(Path(d) / "idx")
        from gradindex.store.basis import capture_transforms
        cap = GradientCapture(model, None, ProjectedRows(RowSpace(spec, capture_transforms(basis))))
        q = {}
        with cap:
            for s in range(0, len(setup.query), 16):
                bg = batch_gradients(model, cap, setup.query.input_ids[s:s + 16], setup.query.labels[s:s + 16],
                                     setup.tokenizer.pad_token_id)
                for n, v in bg.grads.items():
                    q.setdefault(n, []).append(v.numpy())
        q = {n: np.concatenate(v) for n, v in q.items()}
        lib = {m: score_matrix(Path(d) / "idx", q, m, damping=DAMPING, device="cpu") for m in ("ekfac", "kfac")}
        plan = {n: spec.layer_sizes(n) for n in Gt}
        _MAPPED.clear()
        sim = recipe_scores(Gt, Gq, factors, plan, spec.seed, "library", basis, [(32, False)])
    corr = {m: float(np.corrcoef(lib[m].ravel(), sim[(32, False, k)].ravel())[0, 1])
            for m, k in (("ekfac", "ekfac"), ("kfac", "dot"))}
    log(f"library check ({budget}, ratio, kfac basis): score correlation with the simulation {corr}")
    return {"budget": budget, "score_correlation": corr}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model, few queries)")
    ap.add_argument("--seeds", type=int, default=2, help="projection seeds per recipe")
    ap.add_argument("--budgets", default=",".join(BUDGETS), help="fractions of the full float32 bytes")
    ap.add_argument("--rules", default=",".join(RULES), help="allocation rules")
    ap.add_argument("--basis-dampings", default="", help="extra K-FAC whitening dampings (ratio rule, float32)")
    ap.add_argument("--storages", default="int8,int4", help="coded storages to measure (empty: float32 only)")
    ap.add_argument("--no-check", action="store_true", help="skip the library cross-check")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rowspace.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = replace(FidelityConfig(), n_train=256, n_query=48)
    budgets, rules, seeds = tuple(a.budgets.split(",")), tuple(a.rules.split(",")), a.seeds
    if a.quick:
        cfg = replace(cfg, n_train=24, n_query=6, max_tokens=16, vocab=300, n_embd=16, steps=8, batch=8)
        budgets, seeds = ("1/16",), 1
    dampings = tuple(float(x) for x in a.basis_dampings.split(",") if x)
    res = run(cfg, budgets, rules, seeds, check=not a.no_check, basis_dampings=dampings,
              storages=tuple(x for x in a.storages.split(",") if x))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out} ({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
