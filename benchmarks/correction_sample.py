"""How few examples full-space EK-FAC's correction pass can take (issue 17): exactness of the re-rank's
scores when ``Λ*`` comes from a seeded sample of the fit set instead of all of it.

The default budget-bound build fits full-space EK-FAC for its exact re-rank: ``A`` and ``S`` over every
example (summed in the capture pass), then a correction pass ``Λ* = mean_n (Q_Sᵀ G_n Q_A)²`` over the
same examples, which costs about a forward + backward per example. Here, on ``width.py``'s trained
GPT-2 4x256 (1,024 stdlib paragraphs, 16 held-out queries), the eigenbases are the library's full fit
(:func:`~gradindex.precondition.fit_full_space` on all examples) and ``Λ*`` is recomputed from the
per-token factors (``TokenCapture``, float16 as ``width.py`` keeps them) over all examples and over
seeded samples of ``--samples`` sizes. Each variant's exhaustive full-space scores
``Σ_l ⟨R_q ⊘ (Λ* + δ), R_t⟩`` (``δ = damping × mean Λ*``) are compared with those of the library's
``Λ*`` (all examples): top-10 overlap and Spearman per query, and recall of the reference top 10 in
the variant's top 20. The ``all`` variant (the same examples, float16 factors) is the noise floor;
``both`` variants take the eigenbases from the sample too (what a smaller fit set would give).

    python -m benchmarks.correction_sample            # writes benchmarks/results/correction_sample.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import width  # noqa: E402
from benchmarks.common import spearman_rows  # noqa: E402
from benchmarks.fidelity import make_setup  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.methods import DEFAULT_DAMPING  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner, load_full_preconditioner  # noqa: E402
from gradindex.precondition.factors import sample_rows  # noqa: E402

HERE = Path(__file__).resolve().parent


def _lambdas(ft: list, Q_S, Q_A, members: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``Λ* = mean_n (Q_Sᵀ G_n Q_A)²`` over each member set (a boolean mask over the training examples)."""
    sums = {k: torch.zeros(Q_S.shape[1], Q_A.shape[1], dtype=torch.float64) for k in members}
    first = 0
    for a, g in ft:
        R2 = width.rotated(a, g, Q_S, Q_A).double().square_()
        for k, m in members.items():
            sums[k] += R2[torch.from_numpy(m[first:first + len(R2)])].sum(0)
        first += len(R2)
    return {k: sums[k].numpy() / int(members[k].sum()) for k in members}


def _scores(fq: list, ft: list, Q_S, Q_A, lams: dict[str, np.ndarray], damping: float) -> dict[str, np.ndarray]:
    """``[Q, N]`` full-space EK-FAC scores of one layer in the basis ``Q_S, Q_A`` for each ``Λ*``."""
    Rq = torch.cat([width.rotated(a, g, Q_S, Q_A) for a, g in fq])
    Rq = Rq.reshape(len(Rq), -1)
    wq = {k: Rq * torch.from_numpy((1.0 / (lam + damping * lam.mean())).ravel().astype(np.float32))
          for k, lam in lams.items()}
    cols = {k: [] for k in lams}
    for a, g in ft:
        R = width.rotated(a, g, Q_S, Q_A).reshape(len(a), -1)
        for k in lams:
            cols[k].append((wq[k] @ R.T).double())
    return {k: torch.cat(v, 1).numpy() for k, v in cols.items()}


def _sample_basis(ft: list, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenbases of the token-mean ``A`` and ``S`` over the examples of mask ``m`` (float64 eigh)."""
    A = S = None
    first = 0
    for a, g in ft:
        sel = torch.from_numpy(m[first:first + len(a)])
        first += len(a)
        a2, g2 = a[sel].double().reshape(-1, a.shape[-1]), g[sel].double().reshape(-1, g.shape[-1])
        A = a2.T @ a2 if A is None else A + a2.T @ a2
        S = g2.T @ g2 if S is None else S + g2.T @ g2
    return torch.linalg.eigh(S)[1].float(), torch.linalg.eigh(A)[1].float()


def variant_scores(model, layers, queries, train, pad, curv, samples: dict[str, np.ndarray],
                   both: dict[str, np.ndarray],
                   damping: float) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """variant → ``[Q, N]`` scores: ``library`` (the fit's ``Λ*``), ``all`` (recomputed, float16 factors),
    ``correction <k>/seed<s>`` (the library's eigenbases, ``Λ*`` over a sample) and ``both <k>/seed<s>``
    (eigenbases and ``Λ*`` over a sample); and per variant in the library's basis the largest relative
    difference of its ``Λ*`` from the library's."""
    widths = width._full_shapes(model, layers)
    tokens = sum(len(x) for x in train.input_ids) + sum(len(x) for x in queries.input_ids)
    n = len(train)
    members = {"all": np.ones(n, bool), **{f"correction {k}": np.isin(np.arange(n), r) for k, r in samples.items()}}
    out: dict[str, np.ndarray] = {}
    lam_diff = dict.fromkeys(members, 0.0)
    for group in width.layer_groups(layers, widths, tokens):
        fq = width.token_factors(model, group, queries, pad, 8)
        ft = width.token_factors(model, group, train, pad, 8)
        for name in group:
            Q_S = torch.from_numpy(curv[name]["Q_S"]).float()
            Q_A = torch.from_numpy(curv[name]["Q_A"]).float()
            lams = {"library": np.clip(curv[name]["Lambda"], 0, None), **_lambdas(ft[name], Q_S, Q_A, members)}
            for k in members:
                lam_diff[k] = max(lam_diff[k], float(np.abs(lams[k] - lams["library"]).max() / lams["library"].max()))
            parts = _scores(fq[name], ft[name], Q_S, Q_A, lams, damping)
            for k, rows in both.items():
                m = np.isin(np.arange(n), rows)
                qs, qa = _sample_basis(ft[name], m)
                parts[f"both {k}"] = _scores(fq[name], ft[name], qs, qa, _lambdas(ft[name], qs, qa, {"s": m}),
                                             damping)["s"]
            for k, v in parts.items():
                out[k] = v if k not in out else out[k] + v
        del fq, ft
    return out, lam_diff


def compare(score: np.ndarray, ref: np.ndarray) -> dict:
    top = np.argsort(-score, 1)
    rtop = np.argsort(-ref, 1)[:, :10]
    top10 = [len(set(a[:10]) & set(b)) / 10 for a, b in zip(top, rtop, strict=True)]
    rec20 = [len(set(a[:20]) & set(b)) / 10 for a, b in zip(top, rtop, strict=True)]
    return {"top10": round(float(np.mean(top10)), 4), "min_top10": float(np.min(top10)),
            "recall_top10_at_20": round(float(np.mean(rec20)), 4),
            "spearman": round(float(spearman_rows(score, ref).mean()), 5)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("CORRECTION_WORK", "/tmp/gradindex-correction")))
    ap.add_argument("--samples", default="512,256,128,64")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--both", default="512,256,128", help="sample sizes whose eigenbases also come from the sample")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "correction_sample.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    a.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    shape = width.SHAPES["gpt2-4x256"]
    cfg = shape.data
    setup = make_setup(cfg, cfg.corpora[0])
    tok = setup.tokenizer
    model, train_s = width.load_or_train(shape, setup, len(tok), a.work)
    train, data_id = width.file_data(setup, tok, cfg.max_tokens, a.work, shape.name)
    idx = a.work / "idx"
    t0 = time.perf_counter()
    if not (idx / "manifest.json").exists():
        bcfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4), full_factors=True, max_length=cfg.max_tokens)
        build_index(model, tok, train, idx, bcfg, data_id=data_id, progress=False)
    if "ekfac" not in json.loads((idx / "manifest.json").read_text()).get("full_space", {}):
        fit_preconditioner(idx, FitConfig(method="ekfac", space="full", damping=DAMPING), model=model, tokenizer=tok,
                           data=train)
    fit_s = time.perf_counter() - t0
    curv = load_full_preconditioner(idx, "ekfac").curvature
    n = len(train)
    samples = {f"{k}/seed{s}": sample_rows(n, int(k), int(s)) for k in a.samples.split(",") for s in a.seeds.split(",")
               if int(k) < n}
    both = {f"{k}/seed0": sample_rows(n, int(k), 0) for k in a.both.split(",") if a.both and int(k) < n}
    t0 = time.perf_counter()
    scores, lam_diff = variant_scores(model, list(curv), setup.query, train, tok.pad_token_id, curv, samples, both,
                                      DAMPING)
    ref = scores["library"]
    res = {"model": "GPT-2 4x256 (benchmarks/width.py's, trained on stdlib paragraphs)", "examples": n,
           "queries": len(setup.query), "damping": DAMPING,
           "reference": "exhaustive full-space EK-FAC scores with the library's Λ* (correction over all examples)",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": round(load, 2),
                       "load_after": round(os.getloadavg()[0], 2)},
           "seconds": {"train_or_load": round(train_s, 1), "index_and_full_fit": round(fit_s, 1),
                       "scores": round(time.perf_counter() - t0, 1)},
           "variants": {k: {"fit_examples": n if k == "all" else int(k.split()[1].split("/")[0]), **compare(v, ref),
                            **({"lambda_max_rel_diff": round(lam_diff[k], 5)} if k in lam_diff else {})}
                        for k, v in scores.items() if k != "library"}}
    print(json.dumps(res["variants"], indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return res


DAMPING = DEFAULT_DAMPING

if __name__ == "__main__":
    main()
