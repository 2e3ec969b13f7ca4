"""Fidelity: the linear datamodeling score (LDS) of GradDot, cosine, K-FAC and EK-FAC attribution.

Setup (all local, CPU), per corpus. A byte-level BPE tokenizer and a small GPT-2 (built from a
config) are trained on prose paragraphs of the Python standard library's docstrings, or of the GNU
info manuals of Debian's essential packages (``fixtures/corpus.py``), with planted facts. The
model trained on all N training examples is indexed with the library end to end
(``build_store`` with ``precondition="ekfac"`` → ``score_matrix``); query gradients come from
``batch_gradients`` under a ``GradientCapture`` with the build's projection and layers.

Ground truth: M random 50% subsets of the training set; for each, R models are retrained from the
same initialization with the same recipe and steps (retraining seed r fixes the batch order),
and each held-out query's loss (sum of next-token cross-entropy over its tokens) is measured.

LDS of a method, per query q: the Spearman correlation over subsets m between the predicted
``Σ_{i ∈ S_m} score(q, i)`` and the measured ``-loss_q(θ_{S_m})`` (averaged over the R seeds).
Sign convention: ``score = ⟨H⁻¹ g_q, g_i⟩``; positive means including example i *lowers* the
query's loss, hence the minus sign. The figure is the mean over queries.

Spread: projected methods are run for several projection seeds and the LDS is also computed
against each retraining seed's losses alone; ``seed_spread`` is the standard deviation over those
(projection seed × retraining seed) runs. ``query_se`` is the standard error over queries, and
``diff_vs_graddot`` the paired difference to GradDot (same projection and seed) with its
standard error over queries. ``noise_ceiling`` is the LDS a perfect predictor of one seed's losses
could reach against another seed's: the Spearman correlation between two retraining seeds.

Retrained losses are cached in ``--work-dir`` (keyed by everything that determines them but M
and R), so a rerun with other methods, projections or dampings, or a larger M or R, retrains only
what is missing. Results and their reading: benchmarks/README.md, "Fidelity".

Usage::

    python -m benchmarks.fidelity               # both corpora + the compression study; writes
                                                # benchmarks/results/fidelity.json and fidelity-bytes.png
    python -m benchmarks.fidelity --quick       # a smoke run of a few seconds (stdlib, a handful of codecs)
    # EK-FAC against its self-normalized form, on raw rows and on the default index (issue 31):
    python -m benchmarks.fidelity --corpora stdlib --methods ekfac,ekfac-selfnorm --projections none,16,default \
        --damping 0.001 --dampings 0.001 --proj-seeds 1 --no-study --no-baselines \
        --out benchmarks/results/selfnorm-stdlib.json

Baselines: every table also has BM25 (on the model's tokens), Rep-Sim, TrackStar (``baselines.py``) and
EK-FAC refined against the model's Gauss-Newton matrix (``gradindex.query.refine``), in the unprojected
column; Bergson's 1%-drop LDS and QLD are measured by ``refine.py``.

Planted facts: each corpus gets ``n_facts`` unusual sentences (``fixtures.corpus.FACTS``) as training
examples; each has a query (its prompt, loss on its completion); ``fact_recall`` is the share of
those queries whose planted example ranks first, ``fact_mrr`` the mean reciprocal rank of that example and
``fact_ranks`` each one's rank; a ``-selfnorm`` method's ``diff_vs_plain`` is its paired LDS difference to the
method without it. ``top{k}_overlap`` and ``lds_share`` compare with
full-space EK-FAC at ``damping``. The compression study (``_study.py``, codecs in
``reference.py``) simulates stored codes on full-space gradients (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy's BLAS: one thread
    os.environ.setdefault(_v, "1")  # (--threads sets torch's); only effective before numpy loads

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402

import gradindex  # noqa: E402
from benchmarks.common import (  # noqa: E402
    evaluate,
    example_losses,
    fact_recall,
    lds_per_query,  # noqa: F401  (re-exported: scripts written before benchmarks.common)
    noise_ceiling,
    overlap_at_k,
    query_gradients,
    spearman_rows,  # noqa: F401  (re-exported, as lds_per_query)
    top_indices,
    train_model,
)
from fixtures.corpus import (  # noqa: E402
    FACTS,
    corpus_hash,
    fact_document,
    gnu_info_paragraphs,
    linux_man_paragraphs,
    stdlib_paragraphs,
)
from fixtures.tiny import save_model_dir, tiny_gpt2, train_tokenizer  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import Tokenized, records_from_texts, tokenize_records  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402

METHODS = ("graddot", "cosine", "kfac", "ekfac")
FITTED = ("kfac", "ekfac")
DEFAULT_INDEX = "default"
"""The projection column of the library's default index (``default_scorer``), scored through the query engine."""


@dataclass(frozen=True)
class FidelityConfig:
    """What one fidelity run measures; the fields that shape the retrained losses make the cache key."""

    n_train: int = 256
    """Training examples (paragraphs), each at most ``max_tokens`` tokens."""
    n_query: int = 96
    """Held-out query examples."""
    max_tokens: int = 48
    """Paragraphs are truncated to this many tokens."""
    vocab: int = 512
    """BPE vocabulary size (tokenizer trained on the whole corpus)."""
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    init_seed: int = 0
    """Seed of the shared initialization."""
    steps: int = 200
    """AdamW steps, the same for the full model and every subset model; 200 is about where the full
    model's held-out loss bottoms out (benchmarks/README.md, "Fidelity")."""
    batch: int = 32
    lr: float = 3e-3
    """Peak learning rate: linear warm-up over 10% of the steps, then linear decay to zero."""
    n_subsets: int = 20
    """M: random 50% subsets of the training set (32 with R=2 gives a tighter ground truth, ~3× the time)."""
    retrain_seeds: int = 1
    """R: retrainings per subset (batch order), averaged for the LDS; R ≥ 2 also gives the noise ceiling."""
    subset_seed: int = 0
    projections: tuple[str, ...] = ("4", "8", "16", "32", "64", "none")
    """Projection sizes (``K``, ``KAxKG`` or ``none``) to index with."""
    proj_seeds: int = 3
    """Projection seeds per projected size."""
    dampings: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0)
    """Relative dampings swept for K-FAC / EK-FAC."""
    damping: float = 0.1
    """Damping of the headline table (the library default)."""
    methods: tuple[str, ...] = METHODS
    corpora: tuple[str, ...] = ("stdlib", "gnu-info")
    """Corpora (``CORPORA``), each measured alone: its own tokenizer, model and retrainings."""
    n_facts: int = 8
    """Planted facts per corpus (``fixtures.corpus.FACTS``): training examples counted in ``n_train``."""
    top_k: int = 10
    """Top-k overlap with the reference (full-space EK-FAC at ``damping``)."""
    study: bool = True
    """Run the compression study (``reference.py``) on full-space gradients."""
    study_seeds: int = 2
    """Projection seeds per random codec of the study."""
    study_grid: str = "full"
    """``full``, ``quick`` (a handful of codecs) or ``default`` (the library's default codes and their nearest
    alternatives): the study's compressions (``_study.grid``)."""
    baselines: bool = True
    """Also score BM25, Rep-Sim and TrackStar (benchmarks/baselines.py) and refined EK-FAC (unprojected column)."""
    refine_steps: int = 4
    """CG steps of the refined EK-FAC row (``gradindex.query.refine``)."""
    refine_sample: int = 64
    """Training examples of its Gauss-Newton products."""
    study_dampings: tuple[float, ...] = ()
    """Rerun the study's grid at each of these relative dampings too, on the same gradients and retrainings
    (``study.by_damping``; ``damping`` is always measured)."""

    def retrain_key(self, corpus: str) -> str:
        keys = ("n_train", "n_query", "max_tokens", "vocab", "n_layer", "n_embd", "n_head", "init_seed",
                "steps", "batch", "lr", "subset_seed", "n_facts")  # not M, R: a larger run extends the cache
        d = {k: getattr(self, k) for k in keys} | {"corpus": corpus, "torch": torch.__version__}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


DEFAULT_WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradindex" / "fidelity"
QUICK = FidelityConfig(n_train=32, n_query=8, max_tokens=24, vocab=300, n_embd=32, steps=24, batch=16,
                       n_subsets=5, retrain_seeds=2, projections=("8", "none"), proj_seeds=1,
                       dampings=(0.1,), corpora=("stdlib",), n_facts=2, top_k=5, study_grid="quick",
                       refine_steps=2, refine_sample=8)
CORPORA = {
    "stdlib": (stdlib_paragraphs, "prose paragraphs of Python standard library docstrings (fixtures/corpus.py)"),
    "gnu-info": (gnu_info_paragraphs, "prose paragraphs of the GNU info manuals of Debian's essential packages "
                                      "(coreutils, diffutils, findutils, grep, sed, gzip; fixtures/corpus.py)"),
    "linux-man": (linux_man_paragraphs, "prose paragraphs of 48 section-7 overview pages of the Linux man-pages "
                                        "project (Debian's manpages package; fixtures/corpus.py)"),
}


# -- data and training -----------------------------------------------------------------------------
@dataclass
class Setup:
    tokenizer: object
    train: Tokenized
    query: Tokenized
    corpus: str
    """Content hash of the training and query texts (facts included); part of the retraining cache key."""
    name: str = "stdlib"
    facts: tuple = ()
    """Planted ``(prompt, completion)`` pairs."""
    fact_rows: tuple[int, ...] = ()
    """Training row of each planted fact."""
    fact_query: Tokenized | None = None
    """One query per fact: its prompt, with the loss on the completion only."""
    paragraphs_hash: str = ""
    train_texts: tuple[str, ...] = ()
    """The training texts (facts included), in row order (benchmarks/refine.py writes them as the index's data)."""


def fact_positions(n_train: int, n_facts: int) -> list[int]:
    """Training rows of the planted facts: evenly spread, never the first or last row."""
    return [(j + 1) * n_train // (n_facts + 1) for j in range(n_facts)]


def make_setup(cfg: FidelityConfig, corpus: str = "stdlib") -> Setup:
    """Tokenizer on the whole corpus (facts included); disjoint train / query paragraphs by a fixed
    permutation; ``n_facts`` planted fact documents take training rows :func:`fact_positions`."""
    paras = CORPORA[corpus][0]()
    if cfg.n_train + cfg.n_query > len(paras):
        raise ValueError(f"the corpus {corpus!r} has {len(paras)} paragraphs; asked for "
                         f"n_train + n_query = {cfg.n_train + cfg.n_query}")
    facts = FACTS[corpus][: cfg.n_facts]
    if len(facts) < cfg.n_facts:
        raise ValueError(f"corpus {corpus!r} has {len(FACTS[corpus])} planted facts; asked for {cfg.n_facts}")
    docs = [fact_document(p, c) for p, c in facts]
    tok = train_tokenizer(paras + docs, vocab_size=cfg.vocab)
    order = np.random.default_rng(0).permutation(len(paras))
    tr = [paras[i] for i in order[: cfg.n_train - len(facts)]]
    rows = fact_positions(cfg.n_train, len(facts))
    for r, d in zip(rows, docs, strict=True):
        tr.insert(r, d)
    qu = [paras[i] for i in order[cfg.n_train: cfg.n_train + cfg.n_query]]
    train = tokenize_records(records_from_texts(tr), tok, cfg.max_tokens)
    query = tokenize_records(records_from_texts(qu), tok, cfg.max_tokens)
    fq = tokenize_records(datasets.Dataset.from_dict({"prompt": [p for p, _ in facts],
                                                      "completion": [c for _, c in facts]}),
                          tok, max(cfg.max_tokens, 64)) if facts else None  # never cut a fact's answer off
    return Setup(tok, train, query, corpus_hash([corpus] + tr + ["\0query"] + qu), corpus, tuple(facts),
                 tuple(rows), fq, corpus_hash(paras), tuple(tr))


def new_model(cfg: FidelityConfig, vocab: int) -> torch.nn.Module:
    return tiny_gpt2(vocab_size=vocab, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                     n_positions=max(64, cfg.max_tokens), seed=cfg.init_seed)


def subset_masks(cfg: FidelityConfig) -> np.ndarray:
    """``[M, N]`` bool: each row holds exactly half of the training examples."""
    rng = np.random.default_rng(cfg.subset_seed)
    masks = np.zeros((cfg.n_subsets, cfg.n_train), dtype=bool)
    for m in range(cfg.n_subsets):
        masks[m, rng.permutation(cfg.n_train)[: cfg.n_train // 2]] = True
    return masks


_WORKER: dict = {}


def _init_worker(cfg: FidelityConfig, setup: Setup, init: dict, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER.update(cfg=cfg, setup=setup, init=init)


def _retrain(job: tuple[int, int, np.ndarray]) -> tuple[int, int, np.ndarray]:
    m, r, mask = job
    cfg, setup = _WORKER["cfg"], _WORKER["setup"]
    model = new_model(cfg, len(setup.tokenizer))
    model.load_state_dict(_WORKER["init"])
    seqs = [s for s, keep in zip(setup.train.input_ids, mask, strict=True) if keep]
    train_model(model, seqs, cfg, seed=1000 + r)
    return m, r, example_losses(model, setup.query)


def retrained_losses(cfg: FidelityConfig, setup: Setup, init: dict, work: Path, workers: int,
                     threads: int, log=print) -> tuple[np.ndarray, np.ndarray, float]:
    """``(masks [M, N], losses [M, R, Q], seconds)``; resumes from / writes the cache in ``work``.

    Subset m and seed r do not depend on M and R, so the cache keeps every (m, r) ever computed.
    """
    masks = subset_masks(cfg)
    path = work / f"retrain-{cfg.retrain_key(setup.corpus)}.npz"
    M, R = cfg.n_subsets, cfg.retrain_seeds
    seconds = 0.0
    if path.exists():
        z = np.load(path)
        old, seconds = z["losses"], float(z["seconds"])
        M, R = max(M, old.shape[0]), max(R, old.shape[1])
    losses = np.full((M, R, cfg.n_query), np.nan)
    if path.exists():
        losses[: old.shape[0], : old.shape[1]] = old
    masks_all = subset_masks(replace(cfg, n_subsets=M))
    jobs = [(m, r, masks[m]) for m in range(cfg.n_subsets) for r in range(cfg.retrain_seeds)
            if np.isnan(losses[m, r]).any()]
    if not jobs:
        return masks, losses[: cfg.n_subsets, : cfg.retrain_seeds], seconds
    log(f"retraining {len(jobs)} models ({cfg.steps} steps each, {workers} worker(s)); cache {path}")
    t0, done = time.perf_counter(), 0
    ctx = mp.get_context("fork")
    args = (cfg, setup, init, threads)
    pool = ctx.Pool(workers, _init_worker, args) if workers > 1 else None
    if pool is None:
        _init_worker(*args)
    results = pool.imap_unordered(_retrain, jobs) if pool else map(_retrain, jobs)
    try:
        for m, r, q in results:
            losses[m, r] = q
            done += 1
            if done % max(1, len(jobs) // 8) == 0 or done == len(jobs):
                el = time.perf_counter() - t0
                log(f"  {done}/{len(jobs)} retrained, {el:.0f} s")
                np.savez(path, losses=losses, masks=masks_all, seconds=seconds + el)
    finally:
        if pool:
            pool.terminate()
    return masks, losses[: cfg.n_subsets, : cfg.retrain_seeds], seconds + time.perf_counter() - t0


# -- attribution -------------------------------------------------------------------------------------
def scores(index_dir: Path, qgrads: dict[str, np.ndarray], method: str, damping: float) -> np.ndarray:
    """``[Q, N]`` attribution scores from the library."""
    s = score_matrix(index_dir, qgrads, method, damping=damping, device="cpu")
    return np.asarray(s, dtype=np.float64)


class _RawScorer:
    """Scores of a raw-rows index (:func:`build_for`): the queries' and fact queries' projected gradients
    captured once, scored per method by ``score_matrix``."""

    def __init__(self, model, setup: Setup, idx: Path, bcfg: BuildConfig):
        self.idx = idx
        self.q = query_gradients(model, setup.tokenizer, setup.query, bcfg)
        self.dims = int(sum(v.shape[1] for v in self.q.values()))
        self.rows = {"query": self.q}
        if setup.facts:
            self.rows["facts"] = query_gradients(model, setup.tokenizer, setup.fact_query, bcfg)

    def __call__(self, which: str, method: str, damping: float) -> np.ndarray:
        return scores(self.idx, self.rows[which], method, damping)

    def close(self) -> None:
        pass


_raw_scorer = _RawScorer


class _EngineScorer:
    """Scores of an index through ``QueryEngine.scores`` (what a user's query computes), queries as token ids."""

    def __init__(self, model, setup: Setup, idx: Path):
        from gradindex.query import QueryEngine

        self.engine = QueryEngine(idx, model=model, tokenizer=setup.tokenizer, device="cpu")
        self.records = {"query": _records(setup.query)}
        if setup.facts:
            self.records["facts"] = _records(setup.fact_query)

    def __call__(self, which: str, method: str, damping: float) -> np.ndarray:
        return np.asarray(self.engine.scores(self.records[which], method=method, damping=damping), np.float64)

    def close(self) -> None:
        self.engine.close()


def _records(t: Tokenized) -> list[dict]:
    return [{"input_ids": x, "labels": y} for x, y in zip(t.input_ids, t.labels, strict=True)]


def default_scorer(cfg: FidelityConfig, setup: Setup, model, out: Path) -> tuple[_EngineScorer, list[str], int, float]:
    """The library's default index (``gradindex build``'s defaults: auto budget, EK-FAC fitted, rows transcoded to
    its whitened eigenbasis as int4) at damping ``cfg.damping``: ``(scorer, the methods of cfg.methods it answers,
    stored numbers per example, build seconds)``."""
    from gradindex.methods import methods_of
    from gradindex.spec.manifest import read_manifest

    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    bcfg = BuildConfig(projection=ProjectionSpec(), budget="auto", batch_size=16, precondition="ekfac",
                       transcode="ekfac", storage="int4", max_length=max(cfg.max_tokens, 64), damping=cfg.damping)
    # (max_length: the fact queries' own, make_setup's; the training rows come tokenized at cfg.max_tokens)
    build_index(model, setup.tokenizer, setup.train, out, bcfg, model_id="fidelity", progress=False)
    secs = time.perf_counter() - t0
    m = read_manifest(out)
    answers = set(methods_of(m, out, selfnorm=True))
    dims = int(sum(v["rows"] * v["cols"] for v in m["build"]["layers"].values()))
    return _EngineScorer(model, setup, out), [x for x in cfg.methods if x in answers], dims, secs


def fact_ranks(score: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """``[F]`` rank of each planted fact's training row for its query (1 = first; ties counted against it)."""
    own = score[np.arange(len(rows)), list(rows)]
    return (score >= own[:, None]).sum(axis=1)


def fact_mrr(score: np.ndarray, rows: tuple[int, ...]) -> float:
    """Mean reciprocal rank of the planted rows (:func:`fact_ranks`)."""
    return float(np.mean(1.0 / fact_ranks(score, rows)))


def build_for(model, setup: Setup, spec: ProjectionSpec, out: Path, max_tokens: int = 512) -> tuple[BuildConfig, float]:
    """Store + K-FAC/EK-FAC factors for one projection; returns the config and seconds spent. ``max_tokens``:
    the training texts' truncation (so that the engine re-tokenizes ``setup.train_texts`` to the same rows)."""
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)  # measure this library version, never a stale store
    bcfg = BuildConfig.raw(projection=spec, batch_size=16, precondition="ekfac", max_length=max_tokens)
    build_index(model, setup.tokenizer, setup.train, out, bcfg, model_id="fidelity", progress=False)
    return bcfg, time.perf_counter() - t0


def curvature_diagnostics(index_dir: Path, qgrads: dict[str, np.ndarray]) -> dict:
    """Why GradDot and EK-FAC differ, per layer: how concentrated the EK-FAC spectrum is, and
    how well GradDot's score is reproduced by its part in the top 1% of those eigendirections."""
    from gradindex.precondition import load_preconditioner
    from gradindex.store import Store

    P = load_preconditioner(index_dir, "ekfac")
    out = {}
    with Store(index_dir) as st:
        for n in st.layers:
            Lam = P.curvature[n]["Lambda"]  # [k_g, k_a]
            k = max(1, Lam.size // 100)
            top = np.argsort(Lam.ravel())[::-1][:k]
            Q_S, Q_A = P.curvature[n]["Q_S"], P.curvature[n]["Q_A"]
            k_g, k_a = Lam.shape
            rq = (Q_S.T @ qgrads[n].reshape(-1, k_g, k_a) @ Q_A).reshape(len(qgrads[n]), -1)  # [Q, D]
            t = np.concatenate([b[n] for _, b in st.iter_blocks([n])]).astype(np.float64)
            rt = (Q_S.T @ t.reshape(-1, k_g, k_a) @ Q_A).reshape(len(t), -1)  # [N, D]
            out[n] = {"eigen_mass_top1pct": float(np.sort(Lam.ravel())[::-1][:k].sum() / Lam.sum()),
                      "graddot_corr_with_top1pct_part": float(np.corrcoef(
                          (rq @ rt.T).ravel(), (rq[:, top] @ rt[:, top].T).ravel())[0, 1]),
                      "mean_sq_norm": float((t**2).sum(1).mean())}
    return out


def summarize(runs: list[dict], base: list[dict] | None, kfac: list[dict] | None = None) -> dict:
    """Aggregate one method × projection × damping over projection seeds.

    ``base``: GradDot's runs at that projection; ``kfac``: K-FAC's at the same damping, for the
    paired EK-FAC − K-FAC difference.
    """
    lds = np.array([r["per_query"].mean() for r in runs])
    seeds = np.array([v for r in runs for v in r["per_seed"]])
    pq = np.mean([r["per_query"] for r in runs], axis=0)  # [Q]
    n = len(pq)
    out = {"lds": float(lds.mean()), "seed_spread": float(seeds.std(ddof=1)) if len(seeds) > 1 else 0.0,
           "proj_seed_std": float(lds.std(ddof=1)) if len(lds) > 1 else 0.0,
           "per_proj_seed": lds.round(4).tolist(), "per_retrain_seed_and_proj_seed": seeds.round(4).tolist(),
           "query_se": float(pq.std(ddof=1) / np.sqrt(n)), "per_query": pq.round(4).tolist()}
    if base:  # (the default index answers no graddot: its rows are whitened)
        diff = pq - np.mean([b["per_query"] for b in base], axis=0)
        out |= {"diff_vs_graddot": float(diff.mean()), "diff_se": float(diff.std(ddof=1) / np.sqrt(n))}
    if kfac:
        dk = pq - np.mean([k["per_query"] for k in kfac], axis=0)
        out |= {"diff_vs_kfac": float(dk.mean()), "diff_vs_kfac_se": float(dk.std(ddof=1) / np.sqrt(n))}
    return out


# -- driver ------------------------------------------------------------------------------------------
def train_full_model(cfg: FidelityConfig, setup: Setup, work: Path, log=print):
    """``(model, init state, info dict)``: the model trained on the whole training set."""
    vocab = len(setup.tokenizer)
    init = {k: v.clone() for k, v in new_model(cfg, vocab).state_dict().items()}
    t0 = time.perf_counter()
    model = new_model(cfg, vocab)
    model.load_state_dict(init)
    opts: list = []
    train_model(model, setup.train.input_ids, cfg, seed=1000, optimizer_out=opts)
    t_train = time.perf_counter() - t0
    save_model_dir(model, setup.tokenizer, work / f"model-{setup.name}")
    full_train_loss = example_losses(model, setup.train)
    full_query_loss = example_losses(model, setup.query)
    tok_train = sum(len(x) - 1 for x in setup.train.input_ids)
    tok_query = sum(len(x) - 1 for x in setup.query.input_ids)
    info = {"parameters": int(sum(p.numel() for p in model.parameters())),
            "train_loss_per_token": float(full_train_loss.sum() / tok_train),
            "query_loss_per_token": float(full_query_loss.sum() / tok_query),
            "train_tokens": tok_train, "query_tokens": tok_query, "seconds": round(t_train, 1)}
    log(f"[{setup.name}] model: {info['parameters']} parameters, trained in {t_train:.1f} s; loss/token "
        f"train {info['train_loss_per_token']:.3f}, query {info['query_loss_per_token']:.3f}")
    info["optimizer"] = opts[0]  # its final second moments: TrackStar (benchmarks/baselines.py); not in the JSON
    return model, init, info


def run_corpus(cfg: FidelityConfig, corpus: str, work: Path, workers: int = 1, threads: int = 1,
               log=print, retrain_only: bool = False) -> dict:
    """One corpus: train, retrain (cached), score every method × projection with the library, then
    (``cfg.study``) the compression study on full-space gradients. Returns the corpus's results."""
    torch.set_num_threads(threads)
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(cfg, corpus)
    model, init, model_info = train_full_model(cfg, setup, work, log)
    masks, losses, t_retrain = retrained_losses(cfg, setup, init, work, workers, threads, log)
    ceiling = noise_ceiling(losses)
    log(f"[{corpus}] retrained {losses.shape[0]}x{losses.shape[1]} models ({t_retrain:.0f} s); seed-to-seed "
        f"ceiling {ceiling if ceiling is None else round(ceiling, 3)}")
    if retrain_only:
        return {}

    torch.set_num_threads(threads)
    raw: dict[tuple[str, str, float], list[dict]] = {}
    diagnostics: dict = {}
    build_s: dict[str, float] = {}
    dims: dict[str, int] = {}
    ref_top = None
    projections = sorted(cfg.projections, key=lambda p: p != "none")  # the reference first
    for proj in projections:
        n_seeds = 1 if proj == "none" else cfg.proj_seeds
        for ps in range(n_seeds):
            idx = work / f"index-{proj}-s{ps}-{cfg.retrain_key(setup.corpus)}"
            if proj == DEFAULT_INDEX:
                score, methods, dims[proj], secs = default_scorer(cfg, setup, model, idx)
            else:
                bcfg, secs = build_for(model, setup, ProjectionSpec.parse(proj, seed=ps), idx, cfg.max_tokens)
                score, methods = _raw_scorer(model, setup, idx, bcfg), cfg.methods
                dims[proj] = score.dims
            build_s[proj] = build_s.get(proj, 0.0) + secs
            if proj == "none":
                diagnostics = curvature_diagnostics(idx, score.q)
                if cfg.baselines:
                    _extra_rows(raw, cfg, setup, model, model_info, idx, work, masks, losses)
            for method in methods:
                fitted = method.removesuffix("-selfnorm") in FITTED and proj != DEFAULT_INDEX  # (default: baked)
                for d in (cfg.dampings if fitted else (cfg.damping,)):
                    s = score("query", method, d)
                    ev = evaluate(s, masks, losses)
                    ev["top"] = top_indices(s, cfg.top_k)
                    if proj == "none" and method == "ekfac" and d == cfg.damping:
                        ref_top = ev["top"]
                    if setup.facts and d == cfg.damping:
                        f = score("facts", method, d)
                        ev["fact_recall"] = fact_recall(f, setup.fact_rows)
                        ev["fact_mrr"] = fact_mrr(f, setup.fact_rows)
                        ev["fact_ranks"] = fact_ranks(f, setup.fact_rows).tolist()
                        if method != "cosine" and not method.endswith("-selfnorm"):
                            ev["fact_recall_selfnorm"] = fact_recall(score("facts", method + "-selfnorm", d),
                                                                     setup.fact_rows)
                    raw.setdefault((method, proj, d), []).append(ev)
            score.close()
            shutil.rmtree(idx)  # rebuilt on every run anyway; the full-space ones are large
        log(f"[{corpus}] projection {proj}: indexed and scored ({build_s[proj]:.1f} s)")

    table: dict[str, dict[str, dict]] = {}
    sweep: dict[str, dict[str, dict]] = {}
    ref_lds = None
    if ("ekfac", "none", cfg.damping) in raw:
        ref_lds = float(raw[("ekfac", "none", cfg.damping)][0]["per_query"].mean())
    for (method, proj, d), runs in raw.items():
        summ = summarize(runs, raw.get(("graddot", proj, cfg.damping)),
                         raw.get(("kfac", proj, d)) if method == "ekfac" else None)
        summ["bytes_per_example"] = 4 * dims[proj]
        if ref_top is not None:
            summ[f"top{cfg.top_k}_overlap"] = float(np.mean([overlap_at_k(r["top"], ref_top).mean() for r in runs]))
        if ref_lds:
            summ["lds_share"] = summ["lds"] / ref_lds
        plain = raw.get((method.removesuffix("-selfnorm"), proj, d)) if method.endswith("-selfnorm") else None
        if plain:  # the paired difference to the same method without self-normalization, same rows and queries
            dp = np.mean([r["per_query"] for r in runs], axis=0) - np.mean([r["per_query"] for r in plain], axis=0)
            summ |= {"diff_vs_plain": float(dp.mean()), "diff_vs_plain_se": float(dp.std(ddof=1) / np.sqrt(len(dp)))}
        for key in ("fact_recall", "fact_recall_selfnorm", "fact_mrr"):
            if key in runs[0]:
                summ[key] = float(np.mean([r[key] for r in runs]))
        if "fact_ranks" in runs[0]:
            summ["fact_ranks"] = [r["fact_ranks"] for r in runs]  # per projection seed, per fact (1 = first)
        summ["build_and_fit_seconds"] = round(build_s[proj] / len(runs), 2)
        if d == cfg.damping:
            table.setdefault(method, {})[proj] = summ
        if method.removesuffix("-selfnorm") in FITTED and proj != DEFAULT_INDEX:
            sweep.setdefault(method, {}).setdefault(proj, {})[str(d)] = summ["lds"]
    out = {
        "corpus": {"source": CORPORA[corpus][1], "paragraphs_hash": setup.paragraphs_hash,
                   "data_hash": setup.corpus, "train_tokens": model_info["train_tokens"],
                   "query_tokens": model_info["query_tokens"],
                   "facts": [{"prompt": p, "completion": c, "train_row": r}
                             for (p, c), r in zip(setup.facts, setup.fact_rows, strict=True)]},
        "model": {k: model_info[k] for k in ("parameters", "train_loss_per_token", "query_loss_per_token")},
        "noise_ceiling": ceiling,
        "diagnostics_full_space": diagnostics,
        "lds": table,
        "damping_sweep": sweep,
        "seconds": {"train_full_model": model_info["seconds"],
                    "retrain_total": round(t_retrain, 1),  # all retrainings, summed over the runs that cached them
                    "build_and_fit": {k: round(v, 1) for k, v in build_s.items()}},
    }
    if cfg.study:
        from benchmarks._study import run_study

        out["study"] = run_study(model, setup, masks, losses, cfg, log=log)
    return out


def _extra_rows(raw: dict, cfg: FidelityConfig, setup: Setup, model, model_info: dict, idx: Path, work: Path,
                masks: np.ndarray, losses: np.ndarray) -> None:
    """The baselines (BM25, Rep-Sim, TrackStar) and refined EK-FAC at ``cfg.damping``, as rows of the unprojected
    column of the table."""
    from benchmarks.baselines import baseline_scores, refined_scores
    from gradindex.query.refine import RefineConfig

    F = setup.fact_query if setup.facts else None
    ids = setup.query.input_ids + (F.input_ids if F else [])
    labels = setup.query.labels + (F.labels if F else [])
    Q = len(setup.query)
    found = baseline_scores(model, model_info["optimizer"], setup.train.input_ids, setup.train.labels, ids, labels,
                            setup.tokenizer.pad_token_id)
    data = work / f"train-{setup.name}.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in setup.train_texts))
    found["ekfac-refined"] = refined_scores(idx, model, setup.tokenizer, data, ids, labels, cfg.damping,
                                            RefineConfig(steps=cfg.refine_steps, sample=cfg.refine_sample,
                                                         damping=None))
    for name, s in found.items():
        ev = evaluate(s[:Q], masks, losses)
        ev["top"] = top_indices(s[:Q], cfg.top_k)
        if F:
            ev["fact_recall"] = fact_recall(s[Q:], setup.fact_rows)
        raw[(name, "none", cfg.damping)] = [ev]


def run(cfg: FidelityConfig, work: Path, workers: int = 1, threads: int = 1, log=print,
        retrain_only: bool = False) -> dict:
    """The whole benchmark over ``cfg.corpora``; returns the results dictionary (what ``--out`` gets)."""
    t_start = time.perf_counter()
    corpora = {c: run_corpus(cfg, c, work, workers, threads, log, retrain_only) for c in cfg.corpora}
    return {
        "benchmark": "fidelity",
        "config": asdict(cfg),
        "library_version": gradindex.__version__,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "numpy": np.__version__, "threads": threads, "workers": workers},
        "sign_convention": "score = <H^-1 g_query, g_train> (positive: including the example lowers the "
                           "query loss); LDS correlates subset sums of scores with MINUS the query loss",
        "reference": f"full-space EK-FAC at relative damping {cfg.damping}: lds_share and top{cfg.top_k}_overlap "
                     "are relative to it",
        "corpora": corpora,
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }


def merge_results(results: list[dict]) -> dict:
    """One results dictionary from runs that differ only in their corpora (checked)."""
    base = dict(results[0])
    strip = lambda r: {k: v for k, v in r["config"].items() if k != "corpora"}  # noqa: E731
    for r in results[1:]:
        if strip(r) != strip(base):
            raise ValueError("results to merge must share their configuration except the corpora")
    base["corpora"] = {c: v for r in results for c, v in r["corpora"].items()}
    base["config"] = {**base["config"], "corpora": list(base["corpora"])}
    base["seconds_total"] = sum(r["seconds_total"] for r in results)
    base["merged_from"] = len(results)
    return base


def format_table(result: dict) -> str:
    """Per corpus, the library's table: rows = methods, columns = projections, cells = LDS ± seed spread
    / share of full-space EK-FAC / top-k overlap / fact recall@1; then the study's table."""
    cfg = result["config"]
    projs, k = list(cfg["projections"]), cfg["top_k"]
    lines = []
    for corpus, res in result["corpora"].items():
        if not res:
            continue
        lines += [f"== {corpus}: LDS (damping {cfg['damping']}; mean ± seed spread; noise ceiling "
                  f"{res['noise_ceiling'] and round(res['noise_ceiling'], 3)}) | share of full-space EK-FAC | "
                  f"top-{k} overlap | fact recall@1",
                  "method         " + "".join(f"{p:>34}" for p in projs)]
        for method, row in res["lds"].items():
            cells = "".join(f"{row[p]['lds']:>9.3f}±{row[p]['seed_spread']:.3f} {row[p].get('lds_share', 0):5.2f} "
                            f"{row[p].get(f'top{k}_overlap', 0):5.2f} {row[p].get('fact_recall', 0):5.2f}"
                            if p in row else " " * 34 for p in projs)  # baselines: the unprojected column only
            lines.append(f"{method:<15}" + cells)
        for method, per in res.get("damping_sweep", {}).items():
            for p, vals in per.items():
                lines.append(f"sweep {method:<6}{p:>5}: " + ", ".join(f"δ={d}: {v:.3f}" for d, v in vals.items()))
        if res.get("study"):
            from benchmarks._study import format_study

            lines.append(format_study(res["study"], k))
            if res["study"].get("by_damping"):
                from benchmarks._study import format_damping

                lines.append(format_damping(res["study"], k))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK,
                    help=f"model, indices and the retrained-loss cache (default {DEFAULT_WORK})")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default benchmarks/results/fidelity.json; none with --quick)")
    ap.add_argument("--subsets", type=int, help="M, random 50%% subsets")
    ap.add_argument("--retrain-seeds", type=int, help="R, retrainings per subset")
    ap.add_argument("--steps", type=int, help="training steps")
    ap.add_argument("--projections", help=f"comma-separated, e.g. 8,16,none,{DEFAULT_INDEX} ({DEFAULT_INDEX}: the "
                                          "library's default index, scored through the query engine)")
    ap.add_argument("--proj-seeds", type=int)
    ap.add_argument("--refine-steps", type=int, help="CG steps of the refined EK-FAC row (default 4)")
    ap.add_argument("--dampings", help="comma-separated relative dampings for K-FAC/EK-FAC")
    ap.add_argument("--damping", type=float, help="the headline damping (fact recall, the default index's build; "
                                                  f"default {FidelityConfig.damping})")
    ap.add_argument("--methods", help=f"comma-separated library methods (default {','.join(METHODS)}; "
                                      "e.g. graddot,ekfac,ekfac-selfnorm); graddot is always scored")
    ap.add_argument("--no-baselines", action="store_true", help="skip BM25, Rep-Sim, TrackStar and refined EK-FAC")
    ap.add_argument("--workers", type=int, default=1, help="retraining processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--corpora", help=f"comma-separated, of {list(CORPORA)}")
    ap.add_argument("--no-study", action="store_true", help="skip the compression study")
    ap.add_argument("--study-grid", choices=("full", "quick", "default"),
                    help="the study's codecs (default: full; quick with --quick; default: the library's default "
                         "codes and their nearest alternatives)")
    ap.add_argument("--study-dampings", help="comma-separated relative dampings to rerun the study at "
                                             "(e.g. 0.001,0.01,0.1; results in study.by_damping)")
    ap.add_argument("--retrain-only", action="store_true", help="only fill the retrained-loss cache")
    ap.add_argument("--plot", type=Path, default=None,
                    help="LDS share vs bytes plot (default benchmarks/results/fidelity-bytes.png; none with --quick "
                         "or a study grid other than full)")
    ap.add_argument("--merge", nargs="+", type=Path,
                    help="merge results files of the same configuration run on different corpora, then "
                         "write --out and --plot (no measuring)")
    a = ap.parse_args(argv)
    if a.merge:
        result = merge_results([json.loads(p.read_text()) for p in a.merge])
    cfg = QUICK if a.quick else FidelityConfig()
    over = {"n_subsets": a.subsets, "retrain_seeds": a.retrain_seeds, "steps": a.steps,
            "proj_seeds": a.proj_seeds, "refine_steps": a.refine_steps,
            "projections": tuple(a.projections.split(",")) if a.projections else None,
            "dampings": tuple(float(x) for x in a.dampings.split(",")) if a.dampings else None,
            "corpora": tuple(a.corpora.split(",")) if a.corpora else None,
            "study": False if a.no_study else None, "study_grid": a.study_grid, "damping": a.damping,
            "baselines": False if a.no_baselines else None,
            "methods": tuple(dict.fromkeys(["graddot"] + a.methods.split(","))) if a.methods else None,
            "study_dampings": tuple(float(x) for x in a.study_dampings.split(",")) if a.study_dampings else None}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    if not a.merge:
        result = run(cfg, a.work_dir, a.workers, a.threads, retrain_only=a.retrain_only)
    if a.retrain_only:
        return 0
    print(format_table(result))
    out = a.out or (None if a.quick else Path("benchmarks/results/fidelity.json"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    full_grid = result["config"].get("study_grid", "full") == "full"
    plot = a.plot or (None if a.quick or not full_grid else Path("benchmarks/results/fidelity-bytes.png"))
    if plot and result["config"].get("study", True):
        from benchmarks._study import plot_study

        plot_study(result, plot)
        print(f"wrote {plot}")
    if out and any((r.get("study") or {}).get("by_damping") for r in result["corpora"].values()):
        from benchmarks._study import plot_damping

        dplot = out.with_suffix(".png") if out.stem.endswith("damping") else out.with_name(out.stem + "-damping.png")
        plot_damping(result, dplot)
        print(f"wrote {dplot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
