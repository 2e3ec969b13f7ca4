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
from benchmarks.common import example_losses, lds_per_query, query_gradients, spearman_rows, train_model
from benchmarks.fidelity import CORPORA, DEFAULT_WORK, FidelityConfig, Setup, make_setup, new_model
from fixtures.tiny import save_model_dir
from gradindex.capture import ProjectionSpec
from gradindex.data import Tokenized, records_from_texts, tokenize_records
from gradindex.index import build_indices
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.refine import RefineConfig
from gradindex.query.scores import score_matrix


@dataclass(frozen=True)
class PretrainConfig:
    """The base model every run fine-tunes from: trained on the corpus's paragraphs that are neither training
    nor query rows (so a retraining is a fine-tune from one trained model, as on Bergson's board, not a
    chaotic run from scratch)."""

    steps: int = 1500
    batch: int = 32
    lr: float = 3e-3


@dataclass(frozen=True)
class ProtocolConfig:
    """One run; ``fidelity`` fixes the corpus, model and the fine-tuning recipe (``steps`` of ``batch`` at ``lr``
    from the pretrained model, the same for the full model and every retraining)."""

    fidelity: FidelityConfig = FidelityConfig(n_query=64, steps=48, batch=16, lr=1e-3)
    pretrain: PretrainConfig = PretrainConfig()
    val_queries: int = 16
    """The first queries choose the damping (LDS over halves, plain EK-FAC); every reported figure is over the rest."""
    dampings: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    halves: int = 16
    """Random 50% subsets (LDS over halves)."""
    drops: int = 64
    """Retrainings leaving out a random ``drop_frac`` of the examples (LDS over 1% drops)."""
    drop_frac: float = 0.01
    ceiling_drops: int = 16
    """The first 1%-drop retrainings repeated with another batch order: the LDS's noise ceiling (Spearman of the
    two orders' losses over those drops, per test query)."""
    qld_queries: int = 4
    """Test queries whose loss rise after removing each method's top ``drop_frac`` is measured."""
    qld_methods: tuple[str, ...] = ("ekfac (default index)", "ekfac refined, 4 steps", "ekfac refined, ggn 2 steps",
                                    "graddot", "bm25", "repsim", "trackstar")
    refine_steps: tuple[int, ...] = (1, 2, 4)
    refine_sample: int = 256
    refine_method: str = "cg"
    refine_curvature: str = "sampled"
    """The cheap Monte-Carlo Gauss-Newton (the sample's gradients captured once), within the cost target."""
    extra_refine: tuple[tuple[str, int, int], ...] = (("ggn", 2, 64), ("fisher", 1, 256))
    """Other (curvature, steps, sample) refinements scored for comparison (exact GGN products: ~10x the time)."""
    study_dampings: tuple[float, ...] = (0.01, 1.0)
    """Validation-query study: plain vs GGN-refined (2 steps) EK-FAC on the raw index at these dampings."""
    cost_queries: int = 16
    corpora: tuple[str, ...] = ("stdlib", "gnu-info")

    def key(self, corpus: str) -> str:
        d = asdict(self.fidelity) | {"corpus": corpus, "torch": torch.__version__, "recipe": "pretrain-finetune-v1",
                                     "pretrain": asdict(self.pretrain)}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


QUICK = ProtocolConfig(fidelity=FidelityConfig(n_train=32, n_query=8, max_tokens=48, vocab=300, n_embd=32, steps=8,
                                               batch=8, lr=1e-3, n_facts=2, corpora=("stdlib",)),
                       pretrain=PretrainConfig(steps=30, batch=16), val_queries=2, dampings=(0.01, 0.1),
                       halves=4, drops=4, drop_frac=0.05, qld_queries=1, refine_steps=(2,), refine_sample=8,
                       extra_refine=(("sampled", 1, 8),), cost_queries=2, corpora=("stdlib",), ceiling_drops=2,
                       study_dampings=(0.1,),
                       qld_methods=("ekfac (default index)", "ekfac refined, 2 steps", "bm25"))


def pretrain_pool(fc: FidelityConfig, corpus: str, setup: Setup) -> Tokenized:
    """The corpus's paragraphs that :func:`~benchmarks.fidelity.make_setup` made neither training nor query rows."""
    paras = CORPORA[corpus][0]()
    order = np.random.default_rng(0).permutation(len(paras))  # make_setup's permutation
    rest = [paras[i] for i in order[fc.n_train + fc.n_query:]]
    return tokenize_records(records_from_texts(rest), setup.tokenizer, fc.max_tokens)


def unigram_loss(train: Tokenized, query: Tokenized, vocab: int) -> float:
    """Per-token loss on the queries' targets of the training targets' unigram distribution (add-one smoothed)."""
    counts = np.ones(vocab)
    for y in train.labels:
        np.add.at(counts, [t for t in y[1:] if t >= 0], 1)
    logp = np.log(counts / counts.sum())
    tgt = [t for y in query.labels for t in y[1:] if t >= 0]
    return float(-logp[tgt].mean())


def pretrained_init(pc: ProtocolConfig, corpus: str, setup: Setup, work: Path, log=print) -> dict:
    """The base model's state (cached in ``work``): :class:`PretrainConfig` steps on :func:`pretrain_pool`."""
    path = work / "pretrained.pt"
    if path.exists():
        return torch.load(path)
    pool = pretrain_pool(pc.fidelity, corpus, setup)
    model = new_model(pc.fidelity, len(setup.tokenizer))
    t0 = time.perf_counter()
    train_model(model, pool.input_ids, pc.pretrain, seed=7)
    log(f"[{corpus}] pretrained on {len(pool)} paragraphs, {pc.pretrain.steps} steps "
        f"({time.perf_counter() - t0:.0f} s)")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, path)
    return state


_W: dict = {}


def _init(cfg: FidelityConfig, setup: Setup, init: dict) -> None:
    torch.set_num_threads(1)
    _W.update(cfg=cfg, setup=setup, init=init)


def _job(job: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
    name, keep = job
    cfg, setup = _W["cfg"], _W["setup"]
    model = new_model(cfg, len(setup.tokenizer))
    model.load_state_dict(_W["init"])
    seed = int(name.split("@seed")[1]) if "@seed" in name else 1000  # "drop3@seed1001": another batch order
    train_model(model, setup.train.input_ids, cfg, seed=seed, keep=keep)
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


def choose_damping(pc: ProtocolConfig, raw: Path, q: dict, masks: np.ndarray, losses: np.ndarray) -> tuple[float, dict]:
    """The damping of :attr:`ProtocolConfig.dampings` with the best plain EK-FAC LDS over halves on the
    validation queries only (the first ``val_queries``; the raw index scores any damping at query time)."""
    v = pc.val_queries
    qv = {n: g[:v] for n, g in q.items()}
    lds = {d: float(lds_per_query(score_matrix(raw, qv, "ekfac", damping=d, device="cpu"), masks, losses[:, :v]).mean())
           for d in pc.dampings}
    return max(lds, key=lds.get), lds


def damping_study(pc: ProtocolConfig, raw: Path, model_dir: Path, data: Path, ids, labels, sets: dict) -> dict:
    """Validation queries only: plain and GGN-refined (2 steps) EK-FAC on the raw index (damping applied at query
    time) at each of ``study_dampings``; ``sets``: protocol → ``(masks, losses [M, Q])``."""
    v, out = pc.val_queries, {}
    rc = RefineConfig(method=pc.refine_method, steps=2, sample=64, curvature="ggn")
    with QueryEngine(raw, model_dir, device="cpu", data=data) as e:
        for d in pc.study_dampings:
            row = {}
            for name, r in (("plain", False), ("ggn 2 steps", rc)):
                sc = e.scores(_records(ids[:v], labels[:v]), method="ekfac", damping=d, refine=r)
                row[name] = {p: round(float(lds_per_query(sc, m, L[:, :v]).mean()), 4) for p, (m, L) in sets.items()}
            out[str(d)] = row
    return out


def _refines(pc: ProtocolConfig) -> dict[str, RefineConfig]:
    out = {f"ekfac refined, {s} steps": RefineConfig(method=pc.refine_method, steps=s, sample=pc.refine_sample,
                                                      curvature=pc.refine_curvature) for s in pc.refine_steps}
    for curv, s, n in pc.extra_refine:
        out[f"ekfac refined, {curv} {s} steps"] = RefineConfig(method=pc.refine_method, steps=s, sample=n,
                                                               curvature=curv)
    return out


def method_scores(pc: ProtocolConfig, setup: Setup, model, opt, work: Path, sets: dict,
                  log=print) -> tuple[dict, dict, Path, dict]:
    """method → ``[Q + F, N]`` scores (queries, then fact queries); seconds per method; the default index; the
    damping choice and study (``sets``: protocol → ``(masks, losses)``; the halves choose the damping)."""
    masks, losses = sets["halves"]
    fc = pc.fidelity
    model_dir = save_model_dir(model, setup.tokenizer, work / "model")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup.train_texts))
    ids = setup.query.input_ids + setup.fact_query.input_ids
    labels = setup.query.labels + setup.fact_query.labels
    out, secs = {}, {}
    raw_cfg = BuildConfig.raw(projection=ProjectionSpec(kind="none"), batch_size=16, precondition="ekfac",
                          max_length=fc.max_tokens)
    raw = _build(model, setup, work / "raw", model_dir, data, raw_cfg)
    q = query_gradients(model, setup.tokenizer, Tokenized(ids, labels, 0, "text"), raw_cfg)
    damping, sweep = choose_damping(pc, raw, q, masks, losses)
    log(f"  damping {damping:g} (validation LDS over halves {sweep})")
    t0 = time.perf_counter()
    study = damping_study(pc, raw, model_dir, data, ids, labels, sets)
    log(f"  validation study ({time.perf_counter() - t0:.0f} s): {study}")
    for m in ("graddot", "kfac", "ekfac"):
        t0 = time.perf_counter()
        out[m] = score_matrix(raw, q, m, damping=damping, device="cpu")
        secs[m] = time.perf_counter() - t0
    default = _build(model, setup, work / "default", model_dir, data,
                     BuildConfig(projection=ProjectionSpec(), budget="auto", batch_size=16, precondition="ekfac",
                                 transcode="ekfac", storage="int4", max_length=fc.max_tokens, damping=damping))
    build_indices(default, progress=False)
    with QueryEngine(default, model_dir, device="cpu", data=data) as e:
        t0 = time.perf_counter()
        out["ekfac (default index)"] = e.scores(_records(ids, labels), method="ekfac", damping=damping)
        secs["ekfac (default index)"] = time.perf_counter() - t0
        for name, rc in _refines(pc).items():
            t0 = time.perf_counter()
            out[name] = e.scores(_records(ids, labels), method="ekfac", damping=damping, refine=rc)
            secs[name] = time.perf_counter() - t0
            log(f"  {name}: {secs[name]:.0f} s")
    for name, fn in (("bm25", lambda: B.bm25_scores(setup.train.input_ids, ids, labels)),
                     ("repsim", lambda: B.repsim_scores(model, setup.train.input_ids, ids))):
        t0 = time.perf_counter()
        out[name] = fn()
        secs[name] = time.perf_counter() - t0
    from benchmarks._study import capture_full

    t0 = time.perf_counter()
    model.requires_grad_(True)
    G, _, _, _ = capture_full(model, setup.train.input_ids, setup.train.labels, setup.tokenizer.pad_token_id)
    Gq, _, _, _ = capture_full(model, ids, labels, setup.tokenizer.pad_token_id)
    model.requires_grad_(False)
    out["trackstar"] = B.trackstar_scores(G, Gq, B.adam_second_moments(model, opt, list(G)))
    secs["trackstar"] = time.perf_counter() - t0
    return out, secs, default, {"chosen": damping, "validation_lds_halves": sweep, "validation_study": study}


# -- metrics ---------------------------------------------------------------------------------------
def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def fact_ranks(score: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """``[F]`` 1-based rank of each fact's planted row under its query (ties: the row's best place)."""
    return np.array([1 + int((s > s[r]).sum()) for s, r in zip(score, rows, strict=True)])


def cost(pc: ProtocolConfig, default: Path, work: Path, setup: Setup, damping: float) -> dict:
    """p50/p95 seconds per query, one at a time, plain and refined (4 steps or the largest), fresh engine."""
    steps = 4 if 4 in pc.refine_steps else max(pc.refine_steps)
    rc = RefineConfig(method=pc.refine_method, steps=steps, sample=pc.refine_sample, curvature=pc.refine_curvature)
    n = min(pc.cost_queries, len(setup.query))
    recs = _records(setup.query.input_ids[:n], setup.query.labels[:n])
    out = {"queries": n, "refine_steps": steps, "refine_sample": pc.refine_sample, "curvature": pc.refine_curvature}
    with QueryEngine(default, work / "model", device="cpu", data=work / "train.jsonl") as e:
        e.query(recs[0], k=10, method="ekfac", damping=damping, texts=False)  # warm: FAISS read, first capture
        t0 = time.perf_counter()
        e.query(recs[0], k=10, method="ekfac", damping=damping, texts=False, refine=replace(rc, seed=rc.seed + 1))
        out["first_refined_query_s"] = time.perf_counter() - t0  # captures the sample (another seed: uncached)
        e.query(recs[0], k=10, method="ekfac", damping=damping, texts=False, refine=rc)  # this seed's sample
        for name, r in (("plain", False), ("refined", rc)):
            ts = []
            for rec in recs[1:]:
                t0 = time.perf_counter()
                e.query(rec, k=10, method="ekfac", damping=damping, texts=False, refine=r)
                ts.append(time.perf_counter() - t0)
            out[name] = {"p50_s": float(np.percentile(ts, 50)), "p95_s": float(np.percentile(ts, 95))}
    out["ratio_p50"] = out["refined"]["p50_s"] / out["plain"]["p50_s"]
    out["ratio_p95"] = out["refined"]["p95_s"] / out["plain"]["p95_s"]
    return out


def _masks(pc: ProtocolConfig, N: int) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(0)
    k_drop = max(1, math.ceil(pc.drop_frac * N))
    halves = np.zeros((pc.halves, N), bool)
    for m in range(pc.halves):
        halves[m, rng.permutation(N)[: N // 2]] = True
    drops = np.ones((pc.drops, N), bool)
    for m in range(pc.drops):
        drops[m, rng.choice(N, k_drop, replace=False)] = False
    return halves, drops, k_drop


def _qld(pc: ProtocolConfig, S: dict, N: int, k_drop: int) -> dict[str, np.ndarray]:
    """Retraining jobs without each QLD method's top ``k_drop`` for the first ``qld_queries`` test queries."""
    v, jobs = pc.val_queries, {}
    for meth in pc.qld_methods:
        top = np.argsort(-S[meth][v: v + pc.qld_queries], axis=1, kind="stable")[:, :k_drop]
        for j in range(pc.qld_queries):
            keep = np.ones(N, bool)
            keep[top[j]] = False
            jobs[f"qld|{meth}|{v + j}|" + ",".join(map(str, sorted(top[j])))] = keep
    return jobs


def run_corpus(pc: ProtocolConfig, corpus: str, work_root: Path, workers: int, log=print) -> dict:
    fc, v = pc.fidelity, pc.val_queries
    work = work_root / f"refine-{corpus}-{pc.key(corpus)}"
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(fc, corpus)
    N, Q = fc.n_train, len(setup.query)
    vocab = len(setup.tokenizer)
    init = pretrained_init(pc, corpus, setup, work, log)
    model, opts = new_model(fc, vocab), []
    model.load_state_dict(init)
    ntok = sum(len(x) - 1 for x in setup.query.input_ids)
    loss_pre = float(example_losses(model, setup.query).sum() / ntok)
    t0 = time.perf_counter()
    train_model(model, setup.train.input_ids, fc, seed=1000, optimizer_out=opts)
    t_train = time.perf_counter() - t0
    base = example_losses(model, setup.query)
    losses_tok = {"unigram": unigram_loss(setup.train, setup.query, vocab), "pretrained": loss_pre,
                  "fine_tuned": float(base.sum() / ntok)}
    log(f"[{corpus}] query loss/token: unigram {losses_tok['unigram']:.3f}, pretrained {loss_pre:.3f}, fine-tuned "
        f"{losses_tok['fine_tuned']:.3f} ({t_train:.1f} s)")
    halves, drops, k_drop = _masks(pc, N)
    nc = min(pc.ceiling_drops, pc.drops)
    jobs = ({f"half{m}": halves[m] for m in range(pc.halves)} | {f"drop{m}": drops[m] for m in range(pc.drops)}
            | {f"drop{m}@seed1001": drops[m] for m in range(nc)})
    losses = retrain(jobs, fc, setup, init, work / "retrain.npz", workers, log)
    L_h = np.stack([losses[f"half{m}"] for m in range(pc.halves)])  # [M, Q]
    L_d = np.stack([losses[f"drop{m}"] for m in range(pc.drops)])
    L_c = np.stack([losses[f"drop{m}@seed1001"] for m in range(nc)])
    ceiling = spearman_rows(-L_d[:nc, v:].T, -L_c[:, v:].T)  # [test Q]: two batch orders over the same drops
    S, secs, default, damping = method_scores(pc, setup, model, opts[0], work,
                                              {"halves": (halves, L_h), "drop": (drops, L_d)}, log)
    qld_jobs = _qld(pc, S, N, k_drop)
    qld_losses = retrain(qld_jobs, fc, setup, init, work / "retrain.npz", workers, log)
    table = {}
    for meth, s in S.items():
        sq, sf = s[v:Q], s[Q:]
        lh, ld = lds_per_query(sq, halves, L_h[:, v:]), lds_per_query(sq, drops, L_d[:, v:])
        ranks = fact_ranks(sf, setup.fact_rows)
        row = {"lds_halves": _mean_se(lh), "lds_drop": _mean_se(ld), "lds_halves_per_query": lh.round(4).tolist(),
               "lds_drop_per_query": ld.round(4).tolist(),
               "fact_recall": float(np.mean(ranks == 1)), "fact_mrr": float(np.mean(1.0 / ranks)),
               "fact_ranks": ranks.tolist(), "seconds": round(secs[meth], 2)}
        if meth in pc.qld_methods:
            rises = [qld_losses[n][int(n.split("|")[2])] - base[int(n.split("|")[2])] for n in qld_jobs
                     if n.split("|")[1] == meth]
            row["qld"] = _mean_se(np.array(rises))
        table[meth] = row
    tq = slice(v, v + pc.qld_queries)
    out = {"n_train": N, "n_query": Q, "val_queries": v, "test_queries": Q - v, "drop_examples": k_drop,
           "retrainings": len(jobs) + len(qld_jobs), "train_seconds": round(t_train, 1), "loss_per_token": losses_tok,
           "damping": damping, "noise_ceiling_drop": _mean_se(ceiling), "ceiling_drops": nc,
           "methods": table, "qld_random": _mean_se((L_d[:, tq] - base[None, tq]).mean(0)),
           "cost": cost(pc, default, work, setup, damping["chosen"])}
    log(format_corpus(corpus, out))
    return out


def format_corpus(corpus: str, r: dict) -> str:
    lines = [f"== {corpus}: N={r['n_train']}, test queries {r['test_queries']}, 1% = {r['drop_examples']} examples; "
             f"damping {r['damping']['chosen']:g}; QLD random {r['qld_random'][0]:+.3f}; 1%-drop noise ceiling "
             f"{r['noise_ceiling_drop'][0]:.3f} (two batch orders, {r['ceiling_drops']} drops)",
             f"{'method':<26}{'LDS halves':>16}{'LDS 1%-drop':>16}{'QLD':>16}{'facts@1':>9}{'MRR':>6}{'s':>7}"]
    for m, row in r["methods"].items():
        qld = f"{row['qld'][0]:+.3f}±{row['qld'][1]:.3f}" if "qld" in row else ""
        lines.append(f"{m:<26}{row['lds_halves'][0]:>9.3f}±{row['lds_halves'][1]:.3f}"
                     f"{row['lds_drop'][0]:>9.3f}±{row['lds_drop'][1]:.3f}{qld:>16}{row['fact_recall']:>9.2f}"
                     f"{row['fact_mrr']:>6.2f}{row['seconds']:>7.1f}")
    c = r["cost"]
    lines.append(f"cost per query (one at a time, {c['queries'] - 1} queries, {c['curvature']}): plain p50 "
                 f"{c['plain']['p50_s']:.3f} s / p95 "
                 f"{c['plain']['p95_s']:.3f} s; refined ({c['refine_steps']} steps, sample {c['refine_sample']}) p50 "
                 f"{c['refined']['p50_s']:.3f} s / p95 {c['refined']['p95_s']:.3f} s: {c['ratio_p50']:.1f}x / "
                 f"{c['ratio_p95']:.1f}x")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    """benchmarks/README.md's table (LDS halves / 1%-drop, QLD, facts) and cost lines from a results dict."""
    cs = list(res["corpora"])
    head = "| method | " + " | ".join(f"{c}: LDS halves | LDS 1%-drop | QLD | facts@1 / MRR" for c in cs) + " |"
    lines = [head, "| --- " * (1 + 4 * len(cs)) + "|"]
    for m in res["corpora"][cs[0]]["methods"]:
        cells = []
        for c in cs:
            r = res["corpora"][c]["methods"][m]
            ranks = r["fact_ranks"]
            cells += [f"{r['lds_halves'][0]:.3f} ± {r['lds_halves'][1]:.3f}", f"{r['lds_drop'][0]:.3f} ± "
                      f"{r['lds_drop'][1]:.3f}", f"{r['qld'][0]:+.2f} ± {r['qld'][1]:.2f}" if "qld" in r else "—",
                      f"{sum(x == 1 for x in ranks)}/{len(ranks)} / {r['fact_mrr']:.2f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    for c in cs:
        r, k = res["corpora"][c], res["corpora"][c]["cost"]
        lines.append(f"\n{c}: loss/token unigram {r['loss_per_token']['unigram']:.2f}, pretrained "
                     f"{r['loss_per_token']['pretrained']:.2f}, fine-tuned {r['loss_per_token']['fine_tuned']:.2f}; "
                     f"damping {r['damping']['chosen']:g}; 1%-drop noise ceiling {r['noise_ceiling_drop'][0]:.3f} ± "
                     f"{r['noise_ceiling_drop'][1]:.3f}; QLD of a random 1% {r['qld_random'][0]:+.2f}; cost per query "
                     f"({k['curvature']}, {k['refine_steps']} steps, sample {k['refine_sample']}): plain p50 "
                     f"{1e3 * k['plain']['p50_s']:.0f} ms / p95 {1e3 * k['plain']['p95_s']:.0f} ms, refined p50 "
                     f"{1e3 * k['refined']['p50_s']:.0f} ms / p95 {1e3 * k['refined']['p95_s']:.0f} ms "
                     f"({k['ratio_p50']:.1f}x / {k['ratio_p95']:.1f}x); validation study "
                     f"{r['damping']['validation_study']}")
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict:
    """One results dict from per-corpus runs (each ``--corpora X --out F``)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    return {"benchmark": "refine", "config": parts[0]["config"],
            "corpora": {c: r for p in parts for c, r in p["corpora"].items()},
            "seconds_total": round(sum(p["seconds_total"] for p in parts), 1), "merged_from": len(parts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--corpora", help="comma-separated (stdlib, gnu-info, linux-man)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/refine.json (none with --quick)")
    ap.add_argument("--merge", nargs="+", type=Path, help="merge per-corpus results files into --out, then stop")
    ap.add_argument("--markdown", type=Path, help="print benchmarks/README.md's table of a results file, then stop")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return 0
    if a.merge:
        out = a.out or Path("benchmarks/results/refine.json")
        out.write_text(json.dumps(merge(a.merge), indent=2, default=float) + "\n")
        print(f"wrote {out}")
        return 0
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
