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
    ceiling_drops: int = 64
    ceiling_seeds: tuple[int, ...] = (1001, 1002)
    """Batch orders (training seeds) the first ``ceiling_drops`` drops are repeated with (the full model's: 1000)."""
    """The first 1%-drop retrainings repeated with another batch order: the LDS's noise ceiling (Spearman of the
    two orders' losses over those drops, per test query)."""
    qld_queries: int = 4
    """Test queries whose loss rise after removing each method's top ``drop_frac`` is measured."""
    qld_methods: tuple[str, ...] = ("ekfac (default index)", "ekfac refined, ggn 2 steps",
                                    "ekfac refined, ggn 1 steps (sample 32)", "graddot", "bm25", "repsim", "trackstar")
    refine_steps: tuple[int, ...] = (1, 2, 4)
    refine_sample: int = 256
    refine_method: str = "cg"
    refine_curvature: str = "sampled"
    """The cheap Monte-Carlo Gauss-Newton (the sample's gradients captured once), within the cost target."""
    extra_refine: tuple[tuple[str, int, int], ...] = (("ggn", 2, 64), ("ggn", 1, 32), ("ggn", 1, 64), ("ggn", 4, 64),
                                                      ("ggn", 2, 256), ("fisher", 1, 256))
    """Other (curvature, steps, sample) refinements scored for comparison (exact GGN products: a forward and three
    backward passes over the sample per product, ``steps + 1`` products per query); named with ``(sample n)``
    where the sample is not 64."""
    study_dampings: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    """Validation-query study: plain vs refined EK-FAC (each of ``study_refines``) on the raw index at these
    dampings; the best (damping, setting) by validation LDS over halves is then scored on the test queries on a
    default index built at that damping (row ``ekfac refined, validation-chosen``)."""
    study_refines: tuple[tuple[str, int, int], ...] = (("ggn", 2, 64), ("ggn", 1, 32), ("ggn", 2, 256))
    cost_queries: int = 16
    cost_variant_queries: int = 6
    """Timed queries per :attr:`extra_refine` setting (exact GGN products take seconds each)."""
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
                       ceiling_seeds=(1001, 1002),
                       study_dampings=(0.1,), study_refines=(("ggn", 2, 8),),
                       qld_methods=("ekfac (default index)", "ekfac refined, 2 steps", "bm25"))
PRESETS = {"full": ProtocolConfig(), "quick": QUICK}


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
    """Validation queries only: plain and refined EK-FAC (each of ``study_refines``) on the raw index (damping applied
    at query time) at each of ``study_dampings``; ``sets``: protocol → ``(masks, losses [M, Q])``."""
    v, out = pc.val_queries, {}
    settings = {"plain": False} | {refine_name(c, s, n): RefineConfig(method=pc.refine_method, steps=s, sample=n,
                                                                      curvature=c, damping=None)
                                           for c, s, n in pc.study_refines}
    with QueryEngine(raw, model_dir, device="cpu", data=data) as e:
        for d in pc.study_dampings:
            row = {}
            for name, r in settings.items():
                sc = e.scores(_records(ids[:v], labels[:v]), method="ekfac", damping=d, refine=r)
                row[name] = {p: round(float(lds_per_query(sc, m, L[:, :v]).mean()), 4) for p, (m, L) in sets.items()}
            out[str(d)] = row
    return out


def joint_choice(study: dict) -> tuple[float, str, float] | None:
    """``(damping, setting, validation LDS over halves)`` of the study's best entry, plain included; None if empty."""
    best = max(((float(d), name, r["halves"]) for d, row in study.items() for name, r in row.items()),
               key=lambda t: t[2], default=None)
    return best


def refine_name(curvature: str, steps: int, sample: int) -> str:
    return f"ekfac refined, {curvature} {steps} steps" + ("" if sample == 64 else f" (sample {sample})")


def _refines(pc: ProtocolConfig) -> dict[str, RefineConfig]:
    out = {f"ekfac refined, {s} steps": RefineConfig(method=pc.refine_method, steps=s, sample=pc.refine_sample,
                                                      curvature=pc.refine_curvature, damping=None)
           for s in pc.refine_steps}
    for curv, s, n in pc.extra_refine:
        out[refine_name(curv, s, n)] = RefineConfig(method=pc.refine_method, steps=s, sample=n,
                                                               curvature=curv, damping=None)
    return out


def raw_setup(pc: ProtocolConfig, setup: Setup, model, work: Path, halves: tuple[np.ndarray, np.ndarray],
              log=print) -> tuple:
    """``(model_dir, data, ids, labels, raw, q, damping, sweep)``: the model and training data saved for the engine,
    the query rows (queries, then fact queries), the raw index and their gradients on it, and the damping chosen on
    the validation queries (:func:`choose_damping`; ``halves``: ``(masks, losses)``)."""
    model_dir = save_model_dir(model, setup.tokenizer, work / "model")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup.train_texts))
    ids = setup.query.input_ids + setup.fact_query.input_ids
    labels = setup.query.labels + setup.fact_query.labels
    raw_cfg = BuildConfig.raw(projection=ProjectionSpec(kind="none"), batch_size=16, precondition="ekfac",
                          max_length=pc.fidelity.max_tokens)
    raw = _build(model, setup, work / "raw", model_dir, data, raw_cfg)
    q = query_gradients(model, setup.tokenizer, Tokenized(ids, labels, 0, "text"), raw_cfg)
    damping, sweep = choose_damping(pc, raw, q, *halves)
    log(f"  damping {damping:g} (validation LDS over halves {sweep})")
    return model_dir, data, ids, labels, raw, q, damping, sweep


def default_index(pc: ProtocolConfig, setup: Setup, model, out: Path, model_dir: Path, data: Path,
                  damping: float) -> Path:
    """The default index (``gradindex build``'s defaults) built at ``damping``."""
    return _build(model, setup, out, model_dir, data,
                  BuildConfig(projection=ProjectionSpec(), budget="auto", batch_size=16, precondition="ekfac",
                              transcode="ekfac", storage="int4", max_length=pc.fidelity.max_tokens, damping=damping))


def method_scores(pc: ProtocolConfig, setup: Setup, model, opt, work: Path, sets: dict,
                  log=print) -> tuple[dict, dict, Path, dict]:
    """method → ``[Q + F, N]`` scores (queries, then fact queries); seconds per method; the default index; the
    damping choice and study (``sets``: protocol → ``(masks, losses)``; the halves choose the damping)."""
    model_dir, data, ids, labels, raw, q, damping, sweep = raw_setup(pc, setup, model, work, sets["halves"], log)
    out, secs = {}, {}
    t0 = time.perf_counter()
    study = damping_study(pc, raw, model_dir, data, ids, labels, sets)
    log(f"  validation study ({time.perf_counter() - t0:.0f} s): {study}")
    for m in ("graddot", "kfac", "ekfac"):
        t0 = time.perf_counter()
        out[m] = score_matrix(raw, q, m, damping=damping, device="cpu")
        secs[m] = time.perf_counter() - t0
    default = default_index(pc, setup, model, work / "default", model_dir, data, damping)
    build_indices(default, progress=False)
    choice = joint_choice(study)
    if choice is not None and choice[1] != "plain":
        d_r, name_r = choice[0], choice[1]
        idx_r = default if d_r == damping else default_index(pc, setup, model, work / "default-chosen", model_dir,
                                                               data, d_r)
        rc = next(_refines(replace(pc, refine_steps=(), extra_refine=(t,))) for t in pc.study_refines
                  if refine_name(*t) == name_r)
        with QueryEngine(idx_r, model_dir, device="cpu", data=data) as e:
            t0 = time.perf_counter()
            out["ekfac refined, validation-chosen"] = e.scores(_records(ids, labels), method="ekfac", damping=d_r,
                                                               refine=next(iter(rc.values())))
            secs["ekfac refined, validation-chosen"] = time.perf_counter() - t0
        log(f"  validation-chosen: {name_r} at damping {d_r:g} ({secs['ekfac refined, validation-chosen']:.0f} s)")
    with QueryEngine(default, model_dir, device="cpu", data=data) as e:
        t0 = time.perf_counter()
        out["ekfac (default index)"] = e.scores(_records(ids, labels), method="ekfac", damping=damping)
        secs["ekfac (default index)"] = time.perf_counter() - t0
        for name, rc in _refines(pc).items():
            t0 = time.perf_counter()
            out[name] = e.scores(_records(ids, labels), method="ekfac", damping=damping, refine=rc)
            secs[name] = time.perf_counter() - t0
            log(f"  {name}: {secs[name]:.0f} s")
    for name in [n for n in out if n == "ekfac refined, validation-chosen"]:  # after the other refinements
        out[name] = out.pop(name)
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
    return out, secs, default, {"chosen": damping, "validation_lds_halves": sweep, "validation_study": study,
                                "joint_choice": None if choice is None else
                                {"damping": choice[0], "setting": choice[1], "validation_lds_halves": choice[2]}}


# -- metrics ---------------------------------------------------------------------------------------
def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def fact_ranks(score: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """``[F]`` 1-based rank of each fact's planted row under its query (ties: the row's best place)."""
    return np.array([1 + int((s > s[r]).sum()) for s, r in zip(score, rows, strict=True)])


def cost(pc: ProtocolConfig, default: Path, work: Path, setup: Setup, damping: float) -> dict:
    """p50/p95 seconds per query, one at a time, plain and refined (4 steps or the largest), fresh engine."""
    steps = 4 if 4 in pc.refine_steps else max(pc.refine_steps)
    rc = RefineConfig(method=pc.refine_method, steps=steps, sample=pc.refine_sample, curvature=pc.refine_curvature,
                      damping=None)
    n = min(pc.cost_queries, len(setup.query))
    recs = _records(setup.query.input_ids[:n], setup.query.labels[:n])
    out = {"queries": n, "refine_steps": steps, "refine_sample": pc.refine_sample, "curvature": pc.refine_curvature,
           "loadavg_before": list(os.getloadavg())}
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
    out["variants"] = variant_cost(pc, default, work, recs, damping, out["plain"])
    out["loadavg_after"] = list(os.getloadavg())
    return out


def remeasure_cost(pc: ProtocolConfig, corpus: str, work_root: Path, results: Path) -> dict:
    """Re-time :func:`cost` on a finished run's default index (its work directory) into ``results``."""
    res = json.loads(results.read_text())
    r = res["corpora"][corpus]
    work = work_root / f"refine-{corpus}-{pc.key(corpus)}"
    r["cost"] = cost(pc, work / "default", work, make_setup(pc.fidelity, corpus), r["damping"]["chosen"])
    results.write_text(json.dumps(res, indent=2, default=float) + "\n")
    return r["cost"]


def variant_cost(pc: ProtocolConfig, default: Path, work: Path, recs: list[dict], damping: float, plain: dict) -> dict:
    """p50/p95 seconds per query of each :attr:`ProtocolConfig.extra_refine` setting (``cost_variant_queries``
    queries after a warm one that captures its sample), and the ratio to ``plain`` (measured just before)."""
    out = {}
    for curv, steps, n in pc.extra_refine:
        rc = RefineConfig(method=pc.refine_method, steps=steps, sample=n, curvature=curv, damping=None)
        with QueryEngine(default, work / "model", device="cpu", data=work / "train.jsonl") as e:
            e.query(recs[0], k=10, method="ekfac", damping=damping, texts=False, refine=rc)
            ts = []
            for rec in recs[1: 1 + pc.cost_variant_queries]:
                t0 = time.perf_counter()
                e.query(rec, k=10, method="ekfac", damping=damping, texts=False, refine=rc)
                ts.append(time.perf_counter() - t0)
        p50, p95 = float(np.percentile(ts, 50)), float(np.percentile(ts, 95))
        out[f"{curv} {steps} steps, sample {n}"] = {"queries": len(ts), "p50_s": p50, "p95_s": p95,
                                                   "ratio_p50": p50 / plain["p50_s"], "ratio_p95": p95 / plain["p95_s"]}
    return out


def ceiling_study(S: dict, v: int, Q: int, masks: np.ndarray, L: np.ndarray) -> dict:
    """How much of the 1%-drop LDS is retraining noise, on the drops retrained with several batch orders (``L``
    ``[K, M, test Q]``, order 0 the full model's). ``r``: two orders' agreement (mean over pairs; the noise
    ceiling quoted); ``sqrt_r``: the classical-test-theory bound on a predictor of the order-averaged effect scored
    against one order; ``mean_reliability``: Spearman-Brown ``K r / (1 + (K-1) r)``, the reliability of the K
    orders' mean. Per method, LDS on these drops against order 0 (``order_a``), the mean of all orders
    (``mean_all``) and the mean of the other orders (``mean_others``: not the order the model was trained in)."""
    K = len(L)
    pairs = [spearman_rows(-L[a].T, -L[b].T) for a in range(K) for b in range(a + 1, K)]
    r = np.mean(pairs, axis=0)
    rm = float(r.mean())
    out = {"drops": len(masks), "orders": K, "r": _mean_se(r), "sqrt_r": math.sqrt(max(rm, 0.0)),
           "mean_reliability": K * rm / (1 + (K - 1) * rm), "methods": {}}
    for m, s in S.items():
        sq = s[v:Q]
        out["methods"][m] = {k: _mean_se(lds_per_query(sq, masks, x)) for k, x in
                             (("order_a", L[0]), ("mean_all", L.mean(0)), ("mean_others", L[1:].mean(0)))}
    return out


HYBRID_SIZES = (1, 2, 5, 10, 20, 40)


def interleave(lists: list[np.ndarray], c: int) -> np.ndarray:
    """The first ``c`` distinct rows taking one from each ranked list in turn (equal candidate count)."""
    seen, out, pos = set(), [], [0] * len(lists)
    while len(out) < c and any(p < len(x) for p, x in zip(pos, lists, strict=True)):
        for i, x in enumerate(lists):
            while pos[i] < len(x) and int(x[pos[i]]) in seen:
                pos[i] += 1
            if pos[i] < len(x) and len(out) < c:
                seen.add(int(x[pos[i]]))
                out.append(int(x[pos[i]]))
    return np.array(out)


def hybrid_study(S: dict, v: int, Q: int, fact_rows, first: str = "ekfac (default index)",
                 exact: tuple[str, ...] = ("ekfac", "ekfac refined, ggn 2 steps"),
                 others: tuple[str, ...] = ("bm25", "repsim"), sizes: tuple[int, ...] = HYBRID_SIZES,
                 k: int = 10) -> dict:
    """A hybrid first stage, from the score matrices: ``C`` candidates from the default index (``first``) alone, or
    interleaved with BM25's / Rep-Sim's ranking (same ``C``), re-ranked by an exact scorer. Per (re-ranker, stage,
    C): recall of the exact scorer's exhaustive top ``k`` among the candidates (test queries) and the planted facts'
    recall@1 / MRR after the re-rank (a fact not among the candidates counts rank ∞)."""
    out = {}
    for ex in (e for e in exact if e in S):
        E = S[ex]
        for stage in ("gradient",) + tuple(f"gradient+{o}" for o in others if o in S):
            srcs = [S[first]] + ([S[stage.split("+")[1]]] if "+" in stage else [])
            for c in sizes:
                rec, rr = [], []
                for j in range(v, Q + len(fact_rows)):
                    cand = interleave([np.argsort(-x[j], kind="stable") for x in srcs], c)
                    if j < Q:
                        top = np.argsort(-E[j], kind="stable")[:k]
                        rec.append(len(set(top) & set(cand.tolist())) / k)
                    else:
                        f = fact_rows[j - Q]
                        rr.append(1.0 / (1 + int((E[j, cand] > E[j, f]).sum())) if f in cand else 0.0)
                rr = np.array(rr)
                out[f"{ex} | {stage} | C={c}"] = {"topk_recall": float(np.mean(rec)), "fact_mrr": float(np.mean(rr)),
                                                  "fact_recall": float(np.mean(rr == 1))}
    return out


def add_hybrid(work: Path, results: Path, corpus: str, v: int, Q: int) -> dict:
    """:func:`hybrid_study` of a run's saved scores (``work/scores.npz``) written into ``results``' corpus entry."""
    z = np.load(work / "scores.npz")
    S = {k[2:]: z[k] for k in z.files if k.startswith("S|")}
    res = json.loads(results.read_text())
    res["corpora"][corpus]["hybrid"] = hybrid_study(S, v, Q, [int(r) for r in z["fact_rows"]])
    results.write_text(json.dumps(res, indent=2, default=float) + "\n")
    return res["corpora"][corpus]["hybrid"]


def add_refine_at(pc: ProtocolConfig, corpus: str, work_root: Path, results: Path, damping: float,
                  setting: tuple[str, int, int] = ("ggn", 2, 256)) -> dict:
    """Score ``setting`` on a finished run's default index (built at the damping chosen for plain EK-FAC) with
    ``RefineConfig(damping=damping)``, the refined system at its own damping; added to ``results`` as a method row
    (LDS both protocols, facts), from the run's saved masks and losses."""
    res = json.loads(results.read_text())
    r = res["corpora"][corpus]
    work = work_root / f"refine-{corpus}-{pc.key(corpus)}"
    setup = make_setup(pc.fidelity, corpus)
    z = np.load(work / "scores.npz")
    v, Q = r["val_queries"], r["n_query"]
    ids = setup.query.input_ids + setup.fact_query.input_ids
    labels = setup.query.labels + setup.fact_query.labels
    rc = RefineConfig(method=pc.refine_method, steps=setting[1], sample=setting[2], curvature=setting[0],
                      damping=damping)
    t0 = time.perf_counter()
    with QueryEngine(work / "default", work / "model", device="cpu", data=work / "train.jsonl") as e:
        s = e.scores(_records(ids, labels), method="ekfac", damping=r["damping"]["chosen"], refine=rc)
    lh = lds_per_query(s[v:Q], z["halves"], z["L_h"][:, v:])
    ld = lds_per_query(s[v:Q], z["drops"], z["L_d"][:, v:])
    ranks = fact_ranks(s[Q:], tuple(int(x) for x in z["fact_rows"]))
    name = refine_name(*setting) + f", refine damping {damping:g}"
    r["methods"][name] = {"lds_halves": _mean_se(lh), "lds_drop": _mean_se(ld), "lds_halves_per_query":
                          lh.round(4).tolist(), "lds_drop_per_query": ld.round(4).tolist(),
                          "fact_recall": float(np.mean(ranks == 1)), "fact_mrr": float(np.mean(1.0 / ranks)),
                          "fact_ranks": ranks.tolist(), "seconds": round(time.perf_counter() - t0, 2),
                          "index_damping": r["damping"]["chosen"]}
    results.write_text(json.dumps(res, indent=2, default=float) + "\n")
    return r["methods"][name]


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


def fine_tuned(pc: ProtocolConfig, corpus: str, work_root: Path, log=print) -> dict:
    """A run's shared start: its work directory, setup, base model (cached), the full model fine-tuned on all N
    examples (with its optimizer, for TrackStar) and its query losses."""
    fc = pc.fidelity
    work = work_root / f"refine-{corpus}-{pc.key(corpus)}"
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(fc, corpus)
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
    return {"work": work, "setup": setup, "init": init, "model": model, "opt": opts[0], "base": base,
            "t_train": t_train, "losses_tok": losses_tok}


def run_corpus(pc: ProtocolConfig, corpus: str, work_root: Path, workers: int, log=print) -> dict:
    fc, v = pc.fidelity, pc.val_queries
    ft = fine_tuned(pc, corpus, work_root, log)
    work, setup, init, model, base = ft["work"], ft["setup"], ft["init"], ft["model"], ft["base"]
    t_train, losses_tok = ft["t_train"], ft["losses_tok"]
    N, Q = fc.n_train, len(setup.query)
    halves, drops, k_drop = _masks(pc, N)
    nc = min(pc.ceiling_drops, pc.drops)
    jobs = ({f"half{m}": halves[m] for m in range(pc.halves)} | {f"drop{m}": drops[m] for m in range(pc.drops)}
            | {f"drop{m}@seed{sd}": drops[m] for sd in pc.ceiling_seeds for m in range(nc)})
    losses = retrain(jobs, fc, setup, init, work / "retrain.npz", workers, log)
    L_h = np.stack([losses[f"half{m}"] for m in range(pc.halves)])  # [M, Q]
    L_d = np.stack([losses[f"drop{m}"] for m in range(pc.drops)])
    L_c = np.stack([np.stack([losses[f"drop{m}@seed{sd}"] for m in range(nc)]) for sd in pc.ceiling_seeds])
    ceiling = spearman_rows(-L_d[:nc, v:].T, -L_c[0, :, v:].T)  # [test Q]: two batch orders over the same drops
    S, secs, default, damping = method_scores(pc, setup, model, ft["opt"], work,
                                              {"halves": (halves, L_h), "drop": (drops, L_d)}, log)
    np.savez(work / "scores.npz", **{f"S|{m}": x for m, x in S.items()}, halves=halves, drops=drops, L_h=L_h, L_d=L_d,
             L_c=L_c, base=base, fact_rows=np.array(setup.fact_rows))
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
           "ceiling_study": ceiling_study(S, v, Q, drops[:nc], np.concatenate([L_d[None, :nc, v:], L_c[:, :, v:]])),
           "hybrid": hybrid_study(S, v, Q, list(setup.fact_rows)),
           "methods": table, "qld_random": _mean_se((L_d[:, tq] - base[None, tq]).mean(0)),
           "cost": cost(pc, default, work, setup, damping["chosen"])}
    log(format_corpus(corpus, out))
    return out


# -- solve study: how far an iHVP against the Gauss-Newton matrix goes ----------------------------------------------
SOLVE_STEPS = (1, 2, 4, 8, 16, 32)
SOLVE_DAMPINGS = (1.0, 10.0, 100.0)
SOLVE_CHEAP = (("ggn", 1, 32), ("ggn", 1, 64), ("ggn", 2, 32))
SOLVE_CHEAP_DAMPING = 10.0
SOLVE_COST = (("ggn", 1, 32), ("ggn", 1, 64), ("ggn", 2, 32), ("ggn", 2, 256), ("ggn", 4, 256))


class _SolveRecorder:
    """While active, :func:`gradindex.query.refine.refine_solve` (as the engine's refiner calls it) records each
    query's ``‖g‖`` in the captured space and takes its curvature products through a memo: CG from the same start is
    the same arithmetic whatever its step count, so the solves of ``k`` steps after one of more steps on the same query
    and sample (the memo cleared between queries and samples) cost no product; ``misses`` counts the products taken."""

    def __init__(self) -> None:
        self.memo: dict[bytes, dict] = {}
        self.gnorms: list[float] = []
        self.misses = 0

    def _hvp(self, hvp):
        def memo(x):
            h = hashlib.blake2b()
            for n in sorted(x):
                h.update(n.encode())
                h.update(x[n].detach().cpu().numpy().tobytes())
            key = h.digest()
            if key not in self.memo:
                self.misses += 1
                self.memo[key] = hvp(x)
            return self.memo[key]
        return memo

    def __enter__(self) -> _SolveRecorder:
        from gradindex.query import refine as R

        self._orig = orig = R.refine_solve

        def solve(g, curv, hvp, steps, method="cg", alpha=0.0):
            self.gnorms.append(sum(float((v * v).sum()) for v in g.values()) ** 0.5)
            return orig(g, curv, self._hvp(hvp), steps, method, alpha)

        R.refine_solve = solve
        return self

    def __exit__(self, *exc) -> None:
        from gradindex.query import refine as R

        R.refine_solve = self._orig


def _score_row(s: np.ndarray, v: int, Q: int, masks: dict, fact_rows) -> dict:
    """LDS (both protocols, test queries) and fact ranks of one setting's ``[test Q + F, N]`` scores."""
    T = Q - v
    lh = lds_per_query(s[:T], *masks["halves"])
    ld = lds_per_query(s[:T], *masks["drop"])
    ranks = fact_ranks(s[T:], fact_rows)
    return {"lds_drop": _mean_se(ld), "lds_halves": _mean_se(lh), "fact_recall": float(np.mean(ranks == 1)),
            "fact_mrr": float(np.mean(1.0 / ranks)), "fact_ranks": ranks.tolist(),
            "lds_drop_per_query": ld.round(4).tolist()}


def solve_study(pc: ProtocolConfig, corpus: str, work_root: Path, workers: int, steps: tuple[int, ...] = SOLVE_STEPS,
                dampings: tuple[float, ...] = SOLVE_DAMPINGS, cheap: tuple = SOLVE_CHEAP,
                cheap_damping: float = SOLVE_CHEAP_DAMPING, cost_settings: tuple = SOLVE_COST, log=print) -> dict:
    """Test queries (a normal run's setup, retrainings and split; the damping chosen as there): plain EK-FAC on the
    default index against exact-GGN CG refinement over ``pc.refine_sample`` examples at each refine damping
    (``RefineConfig.damping``) and step count, with the relative residual ``‖(H + δ'I) x_k − g‖ / ‖g‖`` of every
    iterate (CG's recursive residual, mean / median / max over test queries) so that convergence is shown; and the
    ``cheap`` (curvature, steps, sample) settings at ``cheap_damping``; cost per query as :func:`cost` times it."""
    fc, v = pc.fidelity, pc.val_queries
    t_start = time.perf_counter()
    ft = fine_tuned(pc, corpus, work_root, log)
    work, setup, model = ft["work"], ft["setup"], ft["model"]
    N, Q = fc.n_train, len(setup.query)
    halves, drops, k_drop = _masks(pc, N)
    jobs = {f"half{m}": halves[m] for m in range(pc.halves)} | {f"drop{m}": drops[m] for m in range(pc.drops)}
    losses = retrain(jobs, fc, setup, ft["init"], work / "retrain.npz", workers, log)
    L_h = np.stack([losses[f"half{m}"] for m in range(pc.halves)])
    L_d = np.stack([losses[f"drop{m}"] for m in range(pc.drops)])
    model_dir, data, ids, labels, _, _, damping, sweep = raw_setup(pc, setup, model, work, (halves, L_h), log)
    default = default_index(pc, setup, model, work / "default", model_dir, data, damping)
    build_indices(default, progress=False)
    masks = {"halves": (halves, L_h[:, v:]), "drop": (drops, L_d[:, v:])}
    recs = _records(ids[v:], labels[v:])  # test queries, then fact queries
    T, fr = Q - v, tuple(setup.fact_rows)
    n = min(pc.refine_sample, N)
    methods, residuals, secs = {}, {}, {}
    with QueryEngine(default, model_dir, device="cpu", data=data) as e:
        t0 = time.perf_counter()
        methods["ekfac (default index)"] = _score_row(e.scores(recs, method="ekfac", damping=damping), v, Q, masks, fr)
        secs["ekfac (default index)"] = time.perf_counter() - t0
        for curv, k, m in cheap:
            name = refine_name(curv, k, m) + f", refine damping {cheap_damping:g}"
            t0 = time.perf_counter()
            rc = RefineConfig(method="cg", steps=k, sample=m, curvature=curv, damping=cheap_damping)
            methods[name] = _score_row(e.scores(recs, method="ekfac", damping=damping, refine=rc), v, Q, masks, fr)
            methods[name]["setting"] = [curv, k, m]
            secs[name] = time.perf_counter() - t0
            log(f"  {name}: drop {methods[name]['lds_drop'][0]:.3f}, halves {methods[name]['lds_halves'][0]:.3f} "
                f"({secs[name]:.0f} s)")
        last = max(steps)
        for d in dampings:
            S = {k: np.zeros((len(recs), N)) for k in steps}
            rel = np.full((len(recs), last + 1), np.nan)
            t0 = time.perf_counter()
            with _SolveRecorder() as rec:
                for j, r in enumerate(recs):
                    rec.memo.clear()
                    for k in sorted(steps) + [last + 1]:  # the last solve only gives the residual of x_last
                        rc = RefineConfig(method="cg", steps=k, sample=n, curvature="ggn", damping=d)
                        s = e.scores([r], method="ekfac", damping=damping, refine=rc)
                        if k in S:
                            S[k][j] = s[0]
                    res = e.refiner.last_residuals[0]  # ‖r_0‖ … ‖r_last‖ (fewer if CG stopped early)
                    rel[j, : len(res)] = np.array(res) / rec.gnorms[-1]
                    if j == 0 or (j + 1) % 8 == 0:
                        el = time.perf_counter() - t0
                        log(f"    damping {d:g}: {j + 1}/{len(recs)} queries, {rec.misses} products "
                            f"({el:.0f} s, ~{el / (j + 1) * (len(recs) - j - 1):.0f} s to go)")
            secs[f"damping {d:g}"] = time.perf_counter() - t0
            rel = np.where(np.isnan(rel), 0.0, rel)  # CG stopped (exactly converged)
            residuals[f"{d:g}"] = {str(k): {"mean": float(rel[:T, k].mean()), "median": float(np.median(rel[:T, k])),
                                            "max": float(rel[:T, k].max())} for k in (0, *steps)}
            for k in steps:
                name = refine_name("ggn", k, n) + f", refine damping {d:g}"
                methods[name] = _score_row(S[k], v, Q, masks, fr) | {"rel_residual": residuals[f"{d:g}"][str(k)],
                                                                      "setting": ["ggn", k, n]}
                log(f"  {name}: drop {methods[name]['lds_drop'][0]:.3f}, halves "
                    f"{methods[name]['lds_halves'][0]:.3f}, facts {methods[name]['fact_recall']:.2f}, residual "
                    f"{residuals[f'{d:g}'][str(k)]['mean']:.2e}")
            log(f"  refine damping {d:g}: {secs[f'damping {d:g}']:.0f} s, {rec.misses} products")
    t0 = time.perf_counter()
    cpc = replace(pc, refine_steps=(cheap[0][1],), refine_sample=cheap[0][2], refine_curvature=cheap[0][0],
                  extra_refine=cost_settings)
    c = cost(cpc, default, work, setup, damping)
    log(f"  cost ({time.perf_counter() - t0:.0f} s): plain p50 {c['plain']['p50_s']:.3f} s; "
        + "; ".join(f"{k} {x['ratio_p50']:.1f}x" for k, x in c["variants"].items()))
    out = {"n_train": N, "n_query": Q, "val_queries": v, "test_queries": T, "drop_examples": k_drop,
           "damping": {"chosen": damping, "validation_lds_halves": sweep}, "refine_sample": n,
           "refine_dampings": list(dampings), "steps": list(steps), "cheap_damping": cheap_damping,
           "methods": methods, "residuals": residuals, "cost": c, "seconds": {k: round(x, 1) for k, x in secs.items()},
           "seconds_total": round(time.perf_counter() - t_start, 1)}
    log(format_solve(corpus, out))
    return out


def format_solve(corpus: str, r: dict) -> str:
    """The solve study's table: per setting LDS 1%-drop / halves, facts@1, relative residual, p50 cost ratio."""
    p = r["methods"]["ekfac (default index)"]["lds_drop"][0]
    ratio = {k: x["ratio_p50"] for k, x in r["cost"]["variants"].items()}  # "ggn 2 steps, sample 256"
    lines = [f"== {corpus} solve study: test queries {r['test_queries']}, damping {r['damping']['chosen']:g}, "
             f"sample {r['refine_sample']}",
             f"{'setting':<58}{'LDS 1%-drop':>14}{'vs plain':>9}{'LDS halves':>14}{'facts@1':>8}{'resid':>10}"
             f"{'cost':>7}"]
    for m, row in r["methods"].items():
        key = "{} {} steps, sample {}".format(*row["setting"]) if "setting" in row else None
        key = key if key in ratio else None
        res = f"{row['rel_residual']['mean']:.1e}" if "rel_residual" in row else ""
        lines.append(f"{m:<58}{row['lds_drop'][0]:>8.3f}±{row['lds_drop'][1]:.3f}{row['lds_drop'][0] - p:>+9.3f}"
                     f"{row['lds_halves'][0]:>8.3f}±{row['lds_halves'][1]:.3f}{row['fact_recall']:>8.2f}{res:>10}"
                     + (f"{ratio[key]:>6.1f}x" if key else ""))
    return "\n".join(lines)


def format_corpus(corpus: str, r: dict) -> str:
    lines = [f"== {corpus}: N={r['n_train']}, test queries {r['test_queries']}, 1% = {r['drop_examples']} examples; "
             f"damping {r['damping']['chosen']:g}; QLD random {r['qld_random'][0]:+.3f}; 1%-drop noise ceiling "
             f"{r['noise_ceiling_drop'][0]:.3f} (two batch orders, {r['ceiling_drops']} drops)",
             f"{'method':<42}{'LDS halves':>16}{'LDS 1%-drop':>16}{'QLD':>16}{'facts@1':>9}{'MRR':>6}{'s':>7}"]
    for m, row in r["methods"].items():
        qld = f"{row['qld'][0]:+.3f}±{row['qld'][1]:.3f}" if "qld" in row else ""
        lines.append(f"{m:<42}{row['lds_halves'][0]:>9.3f}±{row['lds_halves'][1]:.3f}"
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
    by_size = sorted(cs, key=lambda c: -len(res["corpora"][c]["methods"]))
    for m in dict.fromkeys(m for c in by_size for m in res["corpora"][c]["methods"]):
        cells = []
        for c in cs:
            r = res["corpora"][c]["methods"].get(m)
            if r is None:  # not run on this corpus
                cells += ["—"] * 4
                continue
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
                     f"({k['ratio_p50']:.1f}x / {k['ratio_p95']:.1f}x)")
    return "\n".join(lines)


def _pm(x) -> str:
    return f"{x[0]:.3f} ± {x[1]:.3f}"


def markdown_notes(res: dict, plain: str = "ekfac (default index)",
                   refined: tuple[str, ...] = ("ekfac refined, ggn 2 steps", "ekfac refined, ggn 1 steps (sample 32)",
                                               "ekfac refined, validation-chosen")) -> str:
    """Per corpus: the noise-ceiling study, the share of the headroom each refinement closes, refinement cost per
    query against plain, the validation-chosen setting; then the hybrid first stage's table."""
    lines = []
    for c, r in res["corpora"].items():
        cs, meth = r.get("ceiling_study"), r["methods"]
        if cs is None:
            continue
        p = meth[plain]["lds_drop"][0]
        ceil = cs["r"][0]
        heads = [f"{m.removeprefix('ekfac refined, ')}: {meth[m]['lds_drop'][0] - p:+.3f} "
                 f"({(meth[m]['lds_drop'][0] - p) / (ceil - p):.0%} of the headroom)" for m in refined if m in meth]
        vs = "; ".join(f"{m.removeprefix('ekfac refined, ')} {_pm(cs['methods'][m]['order_a'])} → "
                       f"{_pm(cs['methods'][m]['mean_all'])} (other orders only {_pm(cs['methods'][m]['mean_others'])})"
                       for m in (plain,) + refined if m in cs["methods"])
        lines.append(f"- **{c}**: 1%-drop noise ceiling r = {_pm(cs['r'])} ({cs['orders']} batch orders over "
                     f"{cs['drops']} drops; √r = {cs['sqrt_r']:.3f}, the bound for a predictor of the order-averaged "
                     f"effect scored against one order; the {cs['orders']}-order mean's reliability "
                     f"{cs['mean_reliability']:.3f}). Headroom above plain EK-FAC ({p:.3f}) to r: {ceil - p:.3f}; "
                     f"refinement gains {'; '.join(heads)}. LDS on those drops against one order → against the "
                     f"{cs['orders']} orders' mean: {vs}.")
        k = r["cost"]
        var = "; ".join(f"{n}: p50 {1e3 * v['p50_s']:.0f} ms / p95 {1e3 * v['p95_s']:.0f} ms ({v['ratio_p50']:.1f}x / "
                        f"{v['ratio_p95']:.1f}x)" for n, v in k.get("variants", {}).items())
        jc = r["damping"].get("joint_choice")
        lines.append(f"  Cost per query against plain (p50 {1e3 * k['plain']['p50_s']:.0f} ms / p95 "
                     f"{1e3 * k['plain']['p95_s']:.0f} ms; {k['queries'] - 1} queries, variants "
                     f"{next(iter(k.get('variants', {}).values()), {}).get('queries', 0)}): {var}."
                     + (f" Validation-chosen refinement: {jc['setting']} at damping {jc['damping']:g} (validation "
                        f"LDS over halves {jc['validation_lds_halves']:.3f}; plain at the chosen damping "
                        f"{r['damping']['validation_lds_halves'][str(r['damping']['chosen'])]:.3f})." if jc else ""))
    for c, r in res["corpora"].items():
        st = r["damping"].get("validation_study") or {}
        names = list(dict.fromkeys(n for row in st.values() for n in row))
        if st:
            lines += ["", f"{c}, validation queries (raw index, damping at query time), LDS halves / 1%-drop:", "",
                      "| damping | " + " | ".join(n.removeprefix("ekfac refined, ") for n in names) + " |",
                      "| --- " * (1 + len(names)) + "|"]
            lines += [f"| {d} | " + " | ".join(f"{row[n]['halves']:.3f} / {row[n]['drop']:.3f}" for n in names) + " |"
                      for d, row in st.items()]
    hy = [(c, r["hybrid"]) for c, r in res["corpora"].items() if "hybrid" in r]
    if hy:
        stages = ("gradient", "gradient+bm25", "gradient+repsim")
        lines += ["", "| corpus, re-rank | C | " + " | ".join(f"{s}: top-10 recall / facts@1" for s in stages) + " |",
                  "| --- " * (2 + len(stages)) + "|"]
        for c, h in hy:
            for ex in dict.fromkeys(k.split(" | ")[0] for k in h):
                for C in (1, 10, 20, 40):
                    hs = [h[f"{ex} | {s} | C={C}"] for s in stages if f"{ex} | {s} | C={C}" in h]
                    cells = [f"{x['topk_recall']:.2f} / {x['fact_recall']:.2f}" for x in hs]
                    lines.append(f"| {c}, {ex} | {C} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict:
    """One results dict from per-corpus runs (each ``--corpora X --out F``)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    return {"benchmark": "refine", "config": parts[0]["config"],
            "corpora": {c: {"config": p["config"]} | r for p in parts for c, r in p["corpora"].items()},
            "seconds_total": round(sum(p["seconds_total"] for p in parts), 1), "merged_from": len(parts)}


def solve_main(a: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    pc = QUICK if a.quick else ProtocolConfig()
    steps = tuple(int(x) for x in a.solve_steps.split(",")) if a.solve_steps else (
        (1, 2, 4) if a.quick else SOLVE_STEPS)
    dampings = tuple(float(x) for x in a.solve_dampings.split(",")) if a.solve_dampings else SOLVE_DAMPINGS
    kw = {"cheap": (("ggn", 1, 4), ("ggn", 2, 4)), "cost_settings": (("ggn", 1, 4), ("ggn", 2, 8))} if a.quick else {}
    out = a.out or (None if a.quick else Path("benchmarks/results/refine_solve.json"))
    res = json.loads(out.read_text()) if out and out.exists() else {"benchmark": "refine_solve", "corpora": {}}
    for c in (a.corpora.split(",") if a.corpora else pc.corpora):
        res["corpora"][c] = solve_study(pc, c, a.work_dir, a.workers, steps, dampings, **kw) | {
            "config": asdict(pc)}
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=2, default=float) + "\n")
            print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--corpora", help="comma-separated (stdlib, gnu-info, linux-man)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/refine.json (none with --quick)")
    ap.add_argument("--merge", nargs="+", type=Path, help="merge per-corpus results files into --out, then stop")
    ap.add_argument("--markdown", type=Path, help="print benchmarks/README.md's table of a results file, then stop")
    ap.add_argument("--hybrid", type=Path, metavar="WORK", help="add the hybrid first-stage study of a run's saved "
                    "scores (its work directory) to --out's --corpora entry, then stop")
    ap.add_argument("--cost-only", action="store_true", help="re-time the cost per query of --out's --corpora entry "
                    "on its run's saved default index, then stop")
    ap.add_argument("--refine-at", type=float, metavar="D", help="add a row to --out's --corpora entry: ggn 2 steps "
                    "over 256 at refine damping D on the run's saved default index (RefineConfig.damping), then stop")
    ap.add_argument("--solve-study", action="store_true", help="the solve study of --corpora (converged and cheap "
                    "exact-GGN refinements on the test queries, solve_study) into --out (default "
                    "benchmarks/results/refine_solve.json, none with --quick; other corpora there are kept), then stop")
    ap.add_argument("--solve-steps", help="comma-separated CG step counts of the solve study (default "
                    f"{','.join(map(str, SOLVE_STEPS))})")
    ap.add_argument("--solve-dampings", help="comma-separated refine dampings of the solve study (default "
                    f"{','.join(f'{d:g}' for d in SOLVE_DAMPINGS)})")
    a = ap.parse_args(argv)
    if a.solve_study:
        return solve_main(a)
    if a.refine_at:
        torch.set_num_threads(1)
        row = add_refine_at(QUICK if a.quick else ProtocolConfig(), a.corpora, a.work_dir, a.out, a.refine_at)
        print({k: row[k] for k in ("lds_halves", "lds_drop", "fact_ranks", "seconds")})
        return 0
    if a.cost_only:
        torch.set_num_threads(1)
        c = remeasure_cost(QUICK if a.quick else ProtocolConfig(), a.corpora, a.work_dir, a.out)
        print(json.dumps(c, indent=1))
        return 0
    if a.hybrid:
        r = json.loads(a.out.read_text())["corpora"][a.corpora]
        for key, row in add_hybrid(a.hybrid, a.out, a.corpora, r["val_queries"], r["n_query"]).items():
            print(f"{key:<60} top-10 recall {row['topk_recall']:.3f}  facts@1 {row['fact_recall']:.2f}  "
                  f"MRR {row['fact_mrr']:.2f}")
        return 0
    if a.markdown:
        res = json.loads(a.markdown.read_text())
        print(markdown(res) + "\n\n" + markdown_notes(res))
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
