"""Refined EK-FAC queries and the field's baselines under the field's protocols.

Per corpus (``fidelity.py``'s corpora and planted facts, a smaller recipe so that the retrainings fit
two shared cores): a GPT-2 trained on all N examples is indexed with the library twice, the default
index (``gradindex build``'s defaults: budgeted projection, EK-FAC, rows transcoded to the whitened
eigenbasis as int4) and an unprojected raw float32 index (GradDot, K-FAC, EK-FAC). Methods: those,
EK-FAC refined (``QueryEngine.scores(..., refine=RefineConfig(...))``, CG on the model's Gauss-Newton
matrix over a training sample) at a few step counts, and the baselines of ``baselines.py`` (BM25 on
the same tokens, Rep-Sim, TrackStar).

Ground truth, every model retrained from the same initialization with the same recipe and the same
batch order over the kept examples (the full set's shuffled order with the left-out rows skipped, so a
retraining differs from the full model only by what it leaves out):

* ``lds_halves``: LDS over ``halves`` random 50% subsets (as fidelity.py);
* ``lds_drop``: LDS over ``drops`` retrainings that each leave out a random 1% of the examples
  (Bergson's protocol);
* ``qld``: query-loss rise after retraining without the method's top 1% for the query (the first
  ``qld_queries`` queries), against ``random``: the mean rise over the 1%-drop retrainings;
* ``fact_recall`` / ``fact_mrr``: rank of each planted fact's training row for its query.

Cost: one query at a time through ``QueryEngine.query`` on the default index (FAISS built), plain and
refined, p50/p95 seconds (the first refined query, which captures nothing extra but sets up the
sample, is timed apart).

Usage: ``python -m benchmarks.refine`` (writes benchmarks/results/refine.json); ``--quick`` for a smoke
run of seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines as B
from benchmarks.common import example_losses, lds_per_query, query_gradients, train_model
from benchmarks.fidelity import DEFAULT_WORK, FidelityConfig, Setup, make_setup, new_model
from fixtures.tiny import save_model_dir
from gradindex.capture import ProjectionSpec
from gradindex.data import Tokenized
from gradindex.index import build_indices
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.refine import RefineConfig
from gradindex.query.scores import score_matrix


@dataclass(frozen=True)
class ProtocolConfig:
    """One run; ``fidelity`` fixes the corpus, model and recipe (smaller than fidelity.py's: 100 steps of 16)."""

    fidelity: FidelityConfig = FidelityConfig(n_query=48, steps=100, batch=16)
    halves: int = 16
    """Random 50% subsets (LDS over halves)."""
    drops: int = 24
    """Retrainings leaving out a random ``drop_frac`` of the examples (LDS over 1% drops)."""
    drop_frac: float = 0.01
    qld_queries: int = 4
    """Queries whose loss rise after removing each method's top ``drop_frac`` is measured."""
    qld_methods: tuple[str, ...] = ("ekfac (default index)", "ekfac refined, 4 steps", "graddot", "bm25", "repsim",
                                    "trackstar")
    refine_steps: tuple[int, ...] = (2, 4, 8)
    refine_sample: int = 64
    refine_method: str = "cg"
    cost_queries: int = 16
    corpora: tuple[str, ...] = ("stdlib", "gnu-info")
    damping: float = 0.001

    def key(self, corpus: str) -> str:
        d = asdict(self.fidelity) | {"corpus": corpus, "torch": torch.__version__, "recipe": "fixed-order-v1"}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


QUICK = ProtocolConfig(fidelity=FidelityConfig(n_train=32, n_query=6, max_tokens=48, vocab=300, n_embd=32, steps=20,
                                               batch=8, n_facts=2, corpora=("stdlib",)),
                       halves=4, drops=4, drop_frac=0.05, qld_queries=1, refine_steps=(2,), refine_sample=8,
                       cost_queries=2, corpora=("stdlib",),
                       qld_methods=("ekfac (default index)", "ekfac refined, 2 steps", "bm25"))


_W: dict = {}


def _init(cfg: FidelityConfig, setup: Setup, init: dict) -> None:
    torch.set_num_threads(1)
    _W.update(cfg=cfg, setup=setup, init=init)


def _job(job: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
    name, keep = job
    cfg, setup = _W["cfg"], _W["setup"]
    model = new_model(cfg, len(setup.tokenizer))
    model.load_state_dict(_W["init"])
    train_model(model, setup.train.input_ids, cfg, seed=1000, keep=keep)
    return name, example_losses(model, setup.query)


def retrain(jobs: dict[str, np.ndarray], cfg: FidelityConfig, setup: Setup, init: dict, cache: Path, workers: int,
            log=print) -> dict[str, np.ndarray]:
    """name → ``[Q]`` query losses of the model retrained on ``keep``; cached by name in ``cache`` (npz)."""
    have = dict(np.load(cache)) if cache.exists() else {}
    todo = [(n, k) for n, k in jobs.items() if n not in have]
    if todo:
        log(f"  retraining {len(todo)} models ({cfg.steps} steps of {cfg.batch}, {workers} workers)")
        t0 = time.perf_counter()
        pool = mp.get_context("fork").Pool(workers, _init, (cfg, setup, init)) if workers > 1 else None
        if pool is None:
            _init(cfg, setup, init)
        try:
            for i, (n, q) in enumerate((pool.imap_unordered if pool else map)(_job, todo)):
                have[n] = q
                if (i + 1) % 8 == 0 or i + 1 == len(todo):
                    np.savez(cache, **have)
                    log(f"    {i + 1}/{len(todo)} ({time.perf_counter() - t0:.0f} s)")
        finally:
            if pool:
                pool.terminate()
    return {n: have[n] for n in jobs}


# -- scores ----------------------------------------------------------------------------------------
def _records(ids: list[list[int]], labels: list[list[int]]) -> list[dict]:
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)]


def _build(model, setup: Setup, out: Path, model_dir: Path, data: Path, cfg: BuildConfig) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    build_index(model, setup.tokenizer, setup.train, out, cfg, model_id=str(model_dir), data_id=str(data),
                progress=False)
    return out


def method_scores(pc: ProtocolConfig, setup: Setup, model, opt, work: Path, log=print) -> tuple[dict, dict, Path]:
    """method → ``[Q + F, N]`` scores (queries, then fact queries); seconds per method; the default index."""
    fc = pc.fidelity
    model_dir = save_model_dir(model, setup.tokenizer, work / "model")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup.train_texts))
    ids = setup.query.input_ids + setup.fact_query.input_ids
    labels = setup.query.labels + setup.fact_query.labels
    out, secs = {}, {}
    default = _build(model, setup, work / "default", model_dir, data,
                     BuildConfig(projection=ProjectionSpec(), budget="auto", batch_size=16, precondition="ekfac",
                                 transcode="ekfac", storage="int4", max_length=fc.max_tokens, damping=pc.damping))
    build_indices(default, progress=False)
    raw_cfg = BuildConfig.raw(projection=ProjectionSpec(kind="none"), batch_size=16, precondition="ekfac",
                          max_length=fc.max_tokens, damping=pc.damping)
    raw = _build(model, setup, work / "raw", model_dir, data, raw_cfg)
    q = query_gradients(model, setup.tokenizer, Tokenized(ids, labels, 0, "text"), raw_cfg)
    for m in ("graddot", "kfac", "ekfac"):
        t0 = time.perf_counter()
        out[m] = score_matrix(raw, q, m, damping=pc.damping, device="cpu")
        secs[m] = time.perf_counter() - t0
    with QueryEngine(default, model_dir, device="cpu", data=data) as e:
        t0 = time.perf_counter()
        out["ekfac (default index)"] = e.scores(_records(ids, labels), method="ekfac", damping=pc.damping)
        secs["ekfac (default index)"] = time.perf_counter() - t0
        for s in pc.refine_steps:
            rc = RefineConfig(method=pc.refine_method, steps=s, sample=pc.refine_sample)
            t0 = time.perf_counter()
            out[f"ekfac refined, {s} steps"] = e.scores(_records(ids, labels), method="ekfac", damping=pc.damping,
                                                        refine=rc)
            secs[f"ekfac refined, {s} steps"] = time.perf_counter() - t0
            log(f"  refined {s} steps: {secs[f'ekfac refined, {s} steps']:.0f} s")
    t0 = time.perf_counter()
    out["bm25"] = B.bm25_scores(setup.train.input_ids, ids, labels)
    secs["bm25"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["repsim"] = B.repsim_scores(model, setup.train.input_ids, ids)
    secs["repsim"] = time.perf_counter() - t0
    from benchmarks._study import capture_full

    t0 = time.perf_counter()
    model.requires_grad_(True)
    G, _, _, _ = capture_full(model, setup.train.input_ids, setup.train.labels, setup.tokenizer.pad_token_id)
    Gq, _, _, _ = capture_full(model, ids, labels, setup.tokenizer.pad_token_id)
    model.requires_grad_(False)
    out["trackstar"] = B.trackstar_scores(G, Gq, B.adam_second_moments(model, opt, list(G)))
    secs["trackstar"] = time.perf_counter() - t0
    return out, secs, default


# -- metrics ---------------------------------------------------------------------------------------
def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def fact_ranks(score: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """``[F]`` 1-based rank of each fact's planted row under its query (ties: the row's best place)."""
    return np.array([1 + int((s > s[r]).sum()) for s, r in zip(score, rows, strict=True)])


def cost(pc: ProtocolConfig, default: Path, work: Path, setup: Setup) -> dict:
    """p50/p95 seconds per query, one at a time, plain and refined (4 steps or the largest), fresh engine."""
    steps = 4 if 4 in pc.refine_steps else max(pc.refine_steps)
    rc = RefineConfig(method=pc.refine_method, steps=steps, sample=pc.refine_sample)
    n = min(pc.cost_queries, len(setup.query))
    recs = _records(setup.query.input_ids[:n], setup.query.labels[:n])
    out = {"queries": n, "refine_steps": steps, "refine_sample": pc.refine_sample}
    with QueryEngine(default, work / "model", device="cpu", data=work / "train.jsonl") as e:
        e.query(recs[0], k=10, method="ekfac", texts=False)  # warm: FAISS read, first capture
        t0 = time.perf_counter()
        e.query(recs[0], k=10, method="ekfac", texts=False, refine=replace(rc, seed=rc.seed + 1))
        out["first_refined_query_s"] = time.perf_counter() - t0  # builds the sample's batches
        for name, r in (("plain", False), ("refined", rc)):
            ts = []
            for rec in recs:
                t0 = time.perf_counter()
                e.query(rec, k=10, method="ekfac", texts=False, refine=r)
                ts.append(time.perf_counter() - t0)
            out[name] = {"p50_s": float(np.percentile(ts, 50)), "p95_s": float(np.percentile(ts, 95))}
    out["ratio_p50"] = out["refined"]["p50_s"] / out["plain"]["p50_s"]
    out["ratio_p95"] = out["refined"]["p95_s"] / out["plain"]["p95_s"]
    return out


def run_corpus(pc: ProtocolConfig, corpus: str, work_root: Path, workers: int, log=print) -> dict:
    fc = pc.fidelity
    work = work_root / f"refine-{corpus}-{pc.key(corpus)}"
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(fc, corpus)
    N, Q = fc.n_train, len(setup.query)
    vocab = len(setup.tokenizer)
    init = {k: v.clone() for k, v in new_model(fc, vocab).state_dict().items()}
    model, opts = new_model(fc, vocab), []
    model.load_state_dict(init)
    t0 = time.perf_counter()
    train_model(model, setup.train.input_ids, fc, seed=1000, optimizer_out=opts)
    t_train = time.perf_counter() - t0
    base = example_losses(model, setup.query)
    log(f"[{corpus}] model trained ({t_train:.0f} s); query loss/token "
        f"{base.sum() / sum(len(x) - 1 for x in setup.query.input_ids):.3f}")
    rng = np.random.default_rng(0)
    k_drop = max(1, math.ceil(pc.drop_frac * N))
    halves = np.zeros((pc.halves, N), bool)
    for m in range(pc.halves):
        halves[m, rng.permutation(N)[: N // 2]] = True
    drops = np.ones((pc.drops, N), bool)
    for m in range(pc.drops):
        drops[m, rng.choice(N, k_drop, replace=False)] = False
    jobs = {f"half{m}": halves[m] for m in range(pc.halves)} | {f"drop{m}": drops[m] for m in range(pc.drops)}
    losses = retrain(jobs, fc, setup, init, work / "retrain.npz", workers, log)
    L_h = np.stack([losses[f"half{m}"] for m in range(pc.halves)])  # [M, Q]
    L_d = np.stack([losses[f"drop{m}"] for m in range(pc.drops)])
    S, secs, default = method_scores(pc, setup, model, opts[0], work, log)
    qld_jobs = {}
    for meth in pc.qld_methods:
        top = np.argsort(-S[meth][: pc.qld_queries], axis=1, kind="stable")[:, :k_drop]
        for j in range(pc.qld_queries):
            keep = np.ones(N, bool)
            keep[top[j]] = False
            qld_jobs[f"qld|{meth}|{j}|" + ",".join(map(str, sorted(top[j])))] = keep
    qld_losses = retrain(qld_jobs, fc, setup, init, work / "retrain.npz", workers, log)
    table = {}
    for meth, s in S.items():
        sq, sf = s[:Q], s[Q:]
        lh, ld = lds_per_query(sq, halves, L_h), lds_per_query(sq, drops, L_d)
        ranks = fact_ranks(sf, setup.fact_rows)
        row = {"lds_halves": _mean_se(lh), "lds_drop": _mean_se(ld),
               "fact_recall": float(np.mean(ranks == 1)), "fact_mrr": float(np.mean(1.0 / ranks)),
               "fact_ranks": ranks.tolist(), "seconds": round(secs[meth], 2)}
        if meth in pc.qld_methods:
            rises = [qld_losses[n][int(n.split("|")[2])] - base[int(n.split("|")[2])] for n in qld_jobs
                     if n.split("|")[1] == meth]
            row["qld"] = _mean_se(np.array(rises))
        table[meth] = row
    random_rise = (L_d[:, : pc.qld_queries] - base[None, : pc.qld_queries]).mean(0)
    out = {"n_train": N, "n_query": Q, "drop_examples": k_drop, "retrainings": len(jobs) + len(qld_jobs),
           "train_seconds": round(t_train, 1), "methods": table, "qld_random": _mean_se(random_rise),
           "cost": cost(pc, default, work, setup)}
    log(format_corpus(corpus, out))
    return out


def format_corpus(corpus: str, r: dict) -> str:
    lines = [f"== {corpus}: N={r['n_train']}, Q={r['n_query']}, 1% = {r['drop_examples']} examples; "
             f"QLD random {r['qld_random'][0]:+.3f}",
             f"{'method':<26}{'LDS halves':>16}{'LDS 1%-drop':>16}{'QLD':>16}{'facts@1':>9}{'MRR':>6}{'s':>7}"]
    for m, row in r["methods"].items():
        qld = f"{row['qld'][0]:+.3f}±{row['qld'][1]:.3f}" if "qld" in row else ""
        lines.append(f"{m:<26}{row['lds_halves'][0]:>9.3f}±{row['lds_halves'][1]:.3f}"
                     f"{row['lds_drop'][0]:>9.3f}±{row['lds_drop'][1]:.3f}{qld:>16}{row['fact_recall']:>9.2f}"
                     f"{row['fact_mrr']:>6.2f}{row['seconds']:>7.1f}")
    c = r["cost"]
    lines.append(f"cost per query (one at a time, {c['queries']} queries): plain p50 {c['plain']['p50_s']:.3f} s / p95 "
                 f"{c['plain']['p95_s']:.3f} s; refined ({c['refine_steps']} steps, sample {c['refine_sample']}) p50 "
                 f"{c['refined']['p50_s']:.3f} s / p95 {c['refined']['p95_s']:.3f} s: {c['ratio_p50']:.1f}x / "
                 f"{c['ratio_p95']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--corpora", help="comma-separated (stdlib, gnu-info, linux-man)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/refine.json (none with --quick)")
    a = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    pc = QUICK if a.quick else ProtocolConfig()
    if a.corpora:
        pc = replace(pc, corpora=tuple(a.corpora.split(",")))
    t0 = time.perf_counter()
    res = {"benchmark": "refine", "config": asdict(pc),
           "corpora": {c: run_corpus(pc, c, a.work_dir, a.workers) for c in pc.corpora}}
    res["seconds_total"] = round(time.perf_counter() - t0, 1)
    out = a.out or (None if a.quick else Path("benchmarks/results/refine.json"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2, default=float) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
