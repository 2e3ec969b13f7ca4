"""LDS at LLM width: the default two-stage index against unprojected full-space EK-FAC (issue 16).

The GPT-2 4x256 shape of ``benchmarks/width.py`` (1,024 training examples of the stdlib corpus with
its planted facts, 3,154,944 hooked numbers, so the default budget projects), more held-out queries
for the LDS. Ground truth as ``benchmarks/refine.py``: every model retrained from the same
initialization with the same recipe (400 AdamW steps of 16) and the same batch order over the kept
examples (the full set's shuffled order with the left-out rows skipped), on random halves
(``fidelity.subset_masks``); a second batch order (seed 1001) on the first subsets gives the noise
ceiling (Spearman over subsets between the two orders' query losses). LDS per query: Spearman over
subsets between ``Σ_{i∈S} score_i`` and minus the retrained query loss (``common.lds_per_query``).

Scores, each for every training example:

* ``full-space ekfac``: the reference, exhaustive full-space EK-FAC from the library's full-space fit
  (the one the default build makes where it projects, ``--space full``), rotated per example as
  ``width.streamed_scores`` does (checked against the engine's exact re-rank scores);
* ``first stage``: the default index's own scores (``width.library_rows_scores``);
* ``two-stage``: the default query (``--rerank-full auto``: the first stage's top C = 100 re-ranked by
  the engine's exact full-space EK-FAC scores); the other N - C examples keep their first-stage score
  times one per-query factor, the least-squares fit of the exact scores on the first-stage scores over
  the C candidates (so the re-ranked head and the first-stage tail are on one scale). Also reported:
  ``two-stage (head only)``, the rest scored 0;
* ``graddot (full space)``: the plain gradient inner product, for context.

    python -m benchmarks.width_lds retrain          # the retrainings (resumable; run under nice)
    python -m benchmarks.width_lds evaluate         # scores + LDS; writes benchmarks/results/width-lds.json
    python -m benchmarks.width_lds markdown         # its table (benchmarks/README.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import width as W  # noqa: E402
from benchmarks.common import example_losses, lds_per_query, spearman_rows, train_model  # noqa: E402
from benchmarks.fidelity import make_setup, subset_masks  # noqa: E402
from gradindex.data import Tokenized  # noqa: E402

HERE = Path(__file__).resolve().parent
SHAPE = W.SHAPES["gpt2-4x256"]
N_QUERY = 64
"""Held-out queries of the LDS (width.py's agreement figures use the first 16 of the same paragraphs)."""
SEEDS = (1000, 1001)
"""Batch orders: 1000 is the full model's; 1001 only for the noise ceiling."""
PROTOCOL = ("every model retrained from the full model's initialization with its recipe (400 AdamW steps of 16) "
            "and batch order over the kept examples (the full set's shuffled order, left-out rows skipped), on random "
            "halves; LDS per held-out query: Spearman over subsets between the summed scores of the kept examples and "
            "minus the retrained query loss; mean over queries, se = standard error over queries")
TWO_STAGE = ("the two-stage query (rerank_full=100: the first stage's top C = 100 re-ranked by the engine's exact "
             "full-space EK-FAC scores) gives those C candidates their exact scores; the other N - C examples keep "
             "their first-stage score times one per-query factor, the least-squares fit of the exact scores on the "
             "first-stage scores over the C candidates. 'head only': the other N - C scored 0. "
             "two_stage_by_C: the same with the head's exact scores taken from the reference (equal to the engine's "
             "to round-off, engine_vs_reference_max_rel_diff) for other C")
DEFAULT_WORK = Path("/work/tmp/width/lds") if Path("/work/tmp").exists() else \
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradindex" / "width-lds"


def lds_setup():
    """``(setup, queries)``: width.py's 4x256 data with :data:`N_QUERY` held-out queries (same training
    rows), ``queries`` the held-out ones followed by the planted-fact queries."""
    setup = make_setup(replace(SHAPE.data, n_query=N_QUERY), SHAPE.data.corpora[0])
    queries = Tokenized(setup.query.input_ids + setup.fact_query.input_ids,
                        setup.query.labels + setup.fact_query.labels, 0, setup.query.field)
    return setup, queries


def masks(m: int) -> np.ndarray:
    """``[m, N]`` the random halves (the first rows do not depend on ``m``)."""
    return subset_masks(replace(SHAPE.data, n_subsets=m))


def job_order(n_subsets: int, ceiling: int) -> list[tuple[int, int]]:
    """``(subset, seed)`` in run order: 16 halves, then the ceiling's second seed on the first
    ``ceiling`` of them, then the remaining halves."""
    first = min(16, n_subsets)
    return ([(m, SEEDS[0]) for m in range(first)] + [(m, SEEDS[1]) for m in range(ceiling)]
            + [(m, SEEDS[0]) for m in range(first, n_subsets)])


def load_cache(work: Path) -> dict[str, np.ndarray]:
    """Every retraining's losses so far: the union of ``work/retrain*.npz`` (one file per worker)."""
    out: dict[str, np.ndarray] = {}
    for p in sorted(work.glob("retrain*.npz")):
        z = dict(np.load(p))
        out["_seconds"] = np.concatenate([out.get("_seconds", np.array([])), z.pop("_seconds", np.array([]))])
        out |= z
    return out


def retrain(work: Path, n_subsets: int, ceiling: int, worker: str = "", log=print) -> None:
    """Train the full model (``width.load_or_train``'s checkpoint), then every job of :func:`job_order`
    that no worker has done or claimed (``work/claims/<job>``, taken atomically): ``"m{subset}@{seed}"`` →
    ``[Q + F]`` query losses (summed tokens), written to ``work/retrain{worker}.npz``. Several workers
    (``--worker 1``, ``--worker 2``, ...) share the jobs."""
    setup, queries = lds_setup()
    vocab = len(setup.tokenizer)
    model, secs = W.load_or_train(SHAPE, setup, vocab, work)
    log(f"full model ready ({secs:.0f} s)", flush=True)
    cache, claims = work / f"retrain{worker}.npz", work / "claims"
    claims.mkdir(exist_ok=True)
    mine = dict(np.load(cache)) if cache.exists() else {}
    mine.setdefault("full@1000", example_losses(model, queries))
    mk = masks(n_subsets)
    times = list(mine.get("_seconds", []))
    for m, seed in job_order(n_subsets, ceiling):
        key = f"m{m}@{seed}"
        if key in load_cache(work):
            continue
        try:
            os.close(os.open(claims / key, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        t0 = time.perf_counter()
        net = W.new_model(SHAPE, vocab)
        train_model(net, setup.train.input_ids, SHAPE.data, seed=seed, keep=mk[m])
        mine[key] = example_losses(net, queries)
        times.append(time.perf_counter() - t0)
        mine["_seconds"] = np.array(times)
        np.savez(cache, **mine)
        log(f"  {key}: {times[-1]:.0f} s (load {os.getloadavg()[0]:.1f}); {len(times)} done", flush=True)


# -- scores -----------------------------------------------------------------------------------------
def graddot_scores(model, layers: list[str], queries: Tokenized, train: Tokenized, pad: int) -> np.ndarray:
    """``[Q, N]`` full-space GradDot ``Σ_l ⟨G_q, G_t⟩`` from per-token factors (``G = Σ_t g_t a_tᵀ``),
    one block of layers at a time (``width.layer_groups``)."""
    widths = W._full_shapes(model, layers)
    tokens = sum(len(x) for x in train.input_ids) + sum(len(x) for x in queries.input_ids)
    out = np.zeros((len(queries), len(train)))
    for group in W.layer_groups(layers, widths, tokens):
        fq, ft = W.token_factors(model, group, queries, pad, 8), W.token_factors(model, group, train, pad, 8)
        for n in group:
            Gq = torch.cat([(g.float().transpose(1, 2) @ a.float()).flatten(1) for a, g in fq[n]])
            out += torch.cat([(Gq @ (g.float().transpose(1, 2) @ a.float()).flatten(1).T).double()
                              for a, g in ft[n]], 1).numpy()
        del fq, ft
    return out


def engine_two_stage(model, tok, idx: Path, queries: Tokenized, first: np.ndarray, log=print) -> dict:
    """The two-stage query (``rerank_full=EXACT_STAGE_C``) through :class:`QueryEngine`, ``k = C`` so that every
    re-ranked candidate's exact score comes back: ``{"C", "ids" [Q, C], "exact" [Q, C], "seconds" [Q]}``;
    also checks that the candidates are the first stage's top C."""
    from gradindex.index import IndexConfig, build_indices
    from gradindex.query import QueryEngine
    from gradindex.query.full import EXACT_STAGE_C

    build_indices(idx, IndexConfig(), progress=False)
    ids, exact, secs = [], [], []
    with QueryEngine(idx, model=model, tokenizer=tok) as e:
        C = EXACT_STAGE_C
        for j in range(len(queries)):
            rec = {"input_ids": queries.input_ids[j], "labels": queries.labels[j]}
            t0 = time.perf_counter()
            r = e.query(rec, k=C, method="ekfac", damping=W.DAMPING, texts=False, rerank_full=C)
            secs.append(time.perf_counter() - t0)
            ids.append([h.id for h in r.hits])
            exact.append([h.full_score for h in r.hits])
    ids_a = np.array(ids)
    C = ids_a.shape[1]  # (at most the training set)
    same = [len(set(a) & set(np.argsort(-f)[:C].tolist())) / C for a, f in zip(ids_a, first, strict=True)]
    log(f"  engine: C = {C}, p50 {np.median(secs):.2f} s, candidates = first-stage top C: {np.mean(same):.3f}",
        flush=True)
    return {"C": C, "ids": ids_a, "exact": np.array(exact, np.float64), "seconds": np.array(secs),
            "candidates_match_first_stage": float(np.mean(same))}


def two_stage_scores(first: np.ndarray, ids: np.ndarray, exact: np.ndarray, tail: bool = True) -> np.ndarray:
    """``[Q, N]`` the two-stage result as scores of every example: ``exact`` for the candidates ``ids``,
    the rest their first-stage score times the per-query least-squares factor of ``exact`` on
    ``first`` over the candidates (``tail=False``: 0)."""
    out = np.zeros_like(first)
    for q, (c, x) in enumerate(zip(ids, exact, strict=True)):
        f = first[q, c]
        if tail:
            out[q] = first[q] * (float(f @ x) / max(float(f @ f), 1e-300))
        out[q, c] = x
    return out


def head_from(first: np.ndarray, ref: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, exact)`` of a re-rank of the first stage's top ``C`` taken from the reference's scores
    (what the engine's exact re-rank returns, to round-off: the C sweep of the results)."""
    ids = np.argsort(-first, 1)[:, :C]
    return ids, np.take_along_axis(ref, ids, 1)


# -- LDS --------------------------------------------------------------------------------------------
def retrained(work: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(masks [M, N], losses [M, Q+F] at seed 1000, ceiling)`` from ``work/retrain.npz``; ``ceiling``
    has the subsets retrained at both seeds and their losses."""
    have = load_cache(work)
    subs = sorted(int(k[1:].split("@")[0]) for k in have if k.startswith("m") and k.endswith(f"@{SEEDS[0]}"))
    if len(subs) < 4:
        raise SystemExit(f"only {len(subs)} retrained subsets in {work}; run `retrain` first")
    mk = masks(max(subs) + 1)[subs]
    losses = np.stack([have[f"m{m}@{SEEDS[0]}"] for m in subs])
    both = [i for i, m in enumerate(subs) if f"m{m}@{SEEDS[1]}" in have]
    second = np.stack([have[f"m{subs[i]}@{SEEDS[1]}"] for i in both]) if both else None
    secs = have.get("_seconds", np.array([]))
    return mk, losses, {"rows": both, "second": second, "subsets": subs,
                        "retrain_seconds": [float(secs.mean()) if len(secs) else None, float(secs.sum())]}


def lds_row(score: np.ndarray, mk: np.ndarray, losses: np.ndarray, ref_q: np.ndarray | None) -> dict:
    """LDS mean and standard error over the held-out queries; with ``ref_q`` (the reference's per-query
    LDS) also the share of it and the paired standard error of the difference."""
    q = lds_per_query(score[:N_QUERY], mk, losses[:, :N_QUERY])
    row = {"lds": float(q.mean()), "se": float(q.std(ddof=1) / np.sqrt(len(q)))}
    if ref_q is not None:
        d = q - ref_q
        row |= {"share_of_reference": float(q.mean() / ref_q.mean()),
                "minus_reference": float(d.mean()), "minus_reference_se": float(d.std(ddof=1) / np.sqrt(len(d)))}
    return row


def agreement(score: np.ndarray, ref: np.ndarray, fact_rows) -> dict:
    """Top-10 overlap and Spearman with the reference (held-out queries), planted fact at rank 1."""
    a = W.agreement(score[:N_QUERY], ref[:N_QUERY])
    return a | {"fact_rank1": W.fact_rank1(score[N_QUERY:], fact_rows)}


def scores_all(work: Path, log=print) -> tuple[dict, dict, dict]:
    """``(scores name → [Q+F, N], engine, info)``: build the default index (kept in ``work`` for a rerun),
    score every method; cached in ``work/scores.npz``."""
    setup, queries = lds_setup()
    tok = setup.tokenizer
    model, _ = W.load_or_train(SHAPE, setup, len(tok), work)
    train, data_id = W.file_data(setup, tok, SHAPE.data.max_tokens, work, SHAPE.name)
    idx, cache = work / f"{SHAPE.name}-default", work / "scores.npz"
    info_path = work / "scores-info.json"
    if cache.exists() and info_path.exists():
        z = dict(np.load(cache))
        eng = {k[7:]: z.pop(k) for k in list(z) if k.startswith("engine_")}
        return z, eng, json.loads(info_path.read_text())
    bcfg = replace(W.default_config(8), rerank_fit=True)  # (the exact stage's full-space fit, in the build)
    build_s, man = W.timed_build(model, tok, train, idx, bcfg, data_id)
    layers = list(man["build"]["layers"])
    info = {"default_build_seconds": build_s, "bytes_per_example": W.row_bytes(man),
            "default_numbers": int(sum(v["rows"] * v["cols"] for v in man["build"]["layers"].values())),
            "hooked_numbers": int(sum(np.prod(v) for v in W._full_shapes(model, layers).values())),
            "full_fit_seconds": round(man["full_space"]["ekfac"]["seconds"], 1),
            "full_fit_examples": man["full_space"]["ekfac"].get("fit", {}).get("examples"),
            "query_token_loss": W.mean_token_loss(model, setup.query),
            "unigram_token_loss": W.unigram_loss(train, setup.query, len(tok)), "fact_rows": list(setup.fact_rows)}
    log(f"  default build {build_s} s: {info['bytes_per_example']} B/example", flush=True)
    first = W.library_rows_scores(model, setup, idx, queries, bcfg)
    curv = W.load_full_preconditioner(idx, "ekfac").curvature
    t0 = time.perf_counter()
    ref = W.streamed_scores(model, layers, queries, train, tok.pad_token_id, curv, {})[0]
    info["reference_seconds"] = round(time.perf_counter() - t0, 1)
    del curv
    gd = graddot_scores(model, layers, queries, train, tok.pad_token_id)
    eng = engine_two_stage(model, tok, idx, queries, first, log)
    info["engine_vs_reference_max_rel_diff"] = float(np.max(
        np.abs(eng["exact"] - np.take_along_axis(ref, eng["ids"], 1)) / np.abs(ref).max(1, keepdims=True)))
    sc = {"reference": ref, "first": first, "graddot": gd}
    np.savez(cache, **sc, **{f"engine_{k}": v for k, v in eng.items()})
    info_path.write_text(json.dumps(info, indent=1))
    return sc, eng, info


def evaluate(args) -> int:
    """Scores (:func:`scores_all`), then LDS over the retrained subsets so far; writes ``args.out``."""
    load0 = os.getloadavg()
    sc, eng, info = scores_all(args.work_dir)
    mk, losses, ceil = retrained(args.work_dir)
    ref, first, facts = sc["reference"], sc["first"], info["fact_rows"]
    C = int(eng["C"])
    methods = {"full-space ekfac (reference)": ref, "default first stage": first,
               "default two-stage": two_stage_scores(first, eng["ids"], eng["exact"]),
               "default two-stage, head only": two_stage_scores(first, eng["ids"], eng["exact"], tail=False),
               "graddot (full space)": sc["graddot"]}
    ref_q = lds_per_query(ref[:N_QUERY], mk, losses[:, :N_QUERY])
    rows = {n: lds_row(s, mk, losses, None if s is ref else ref_q) | agreement(s, ref, facts)
            for n, s in methods.items()}
    sweep = {str(c): lds_row(two_stage_scores(first, *head_from(first, ref, c)), mk, losses, ref_q)
             | agreement(two_stage_scores(first, *head_from(first, ref, c)), ref, facts)
             for c in (20, 50, 100, 200)}
    out = {"what": __doc__.split("\n\n")[0], "shape": SHAPE.name, "protocol": PROTOCOL, "two_stage_scores": TWO_STAGE,
           "damping": W.DAMPING, "queries": N_QUERY, "fact_queries": len(facts), "subsets": len(mk),
           "steps": SHAPE.data.steps, "retrain_seconds_mean_total": ceil["retrain_seconds"], **info,
           "engine": {"C": C, "queries": len(eng["seconds"]), "p50_s": float(np.percentile(eng["seconds"], 50)),
                      "p95_s": float(np.percentile(eng["seconds"], 95)),
                      "candidates_match_first_stage": float(eng["candidates_match_first_stage"])},
           "rows": rows, "two_stage_by_C (reference scores for the head)": sweep}
    if ceil["second"] is not None and len(ceil["rows"]) >= 4:
        r = ceil["rows"]
        nc = spearman_rows(-ceil["second"][:, :N_QUERY].T, -losses[r, :N_QUERY].T)
        out["noise_ceiling"] = {"subsets": len(r), "spearman_between_batch_orders": float(nc.mean()),
                                "se": float(nc.std(ddof=1) / np.sqrt(len(nc))),
                                "lds_on_these_subsets": {n: float(lds_per_query(s[:N_QUERY], mk[r],
                                                                                losses[r, :N_QUERY]).mean())
                                                         for n, s in methods.items()}}
    out["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                      "threads": args.threads, "loadavg_before": load0, "loadavg_after": os.getloadavg()}
    args.out.write_text(json.dumps(out, indent=1))
    for n, r in rows.items():
        print(f"{n:32s} LDS {r['lds']:.3f} ± {r['se']:.3f}  share {r.get('share_of_reference', 1):.3f}  "
              f"top10 {r['top10']:.2f}  spearman {r['spearman']:.3f}  facts@1 {r['fact_rank1']:.2f}")
    print(f"wrote {args.out} ({len(mk)} subsets)")
    return 0


def markdown(res: dict) -> str:
    """The results as benchmarks/README.md's table (``python -m benchmarks.width_lds markdown``)."""
    lines = [f"{res['subsets']} halves, {res['queries']} held-out queries, {res['fact_queries']} planted facts; "
             f"held-out token loss {res['query_token_loss']:.2f} (unigram {res['unigram_token_loss']:.2f}); the "
             f"engine's candidates = the first stage's top {res['engine']['C']}: "
             f"{res['engine']['candidates_match_first_stage']:.2f}",
             "", "| scores | LDS ± se | share of full-space EK-FAC's | minus it (paired se) | top 10 | Spearman "
             "| facts at rank 1 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = dict(res["rows"]) | {f"two-stage at C = {c} (reference head)": r
                                for c, r in res["two_stage_by_C (reference scores for the head)"].items() if c != "100"}
    for n, r in rows.items():
        share = f"{r['share_of_reference']:.3f}" if "share_of_reference" in r else "1"
        diff = f"{r['minus_reference']:+.3f} ({r['minus_reference_se']:.3f})" if "minus_reference" in r else "—"
        lines.append(f"| {n} | {r['lds']:.3f} ± {r['se']:.3f} | {share} | {diff} | {r['top10']:.2f} | "
                     f"{r['spearman']:.3f} | {r['fact_rank1']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("retrain", "evaluate", "markdown"))
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--subsets", type=int, default=64, help="random halves to retrain on (at most)")
    ap.add_argument("--ceiling", type=int, default=8, help="halves retrained with a second batch order")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "width-lds.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", default="", help="retrain: this worker's name (its own cache file); "
                    "several workers share the jobs")
    ap.add_argument("--quick", action="store_true", help="a 1-layer smoke run of minutes (width.QUICK's shape)")
    args = ap.parse_args()
    if args.quick:
        global SHAPE, N_QUERY
        SHAPE, N_QUERY = W.QUICK[SHAPE.name], 6
        args.work_dir = args.work_dir.with_name(args.work_dir.name + "-quick")
        if args.out == ap.get_default("out"):
            args.out = args.work_dir / "width-lds.json"
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.mode == "markdown":
        print(markdown(json.loads(args.out.read_text())))
        return 0
    if args.mode == "retrain":
        retrain(args.work_dir, args.subsets, args.ceiling, args.worker)
        return 0
    return evaluate(args)


if __name__ == "__main__":
    raise SystemExit(main())
