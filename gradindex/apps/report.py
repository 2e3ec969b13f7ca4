"""The audit report: per query the most helpful and most harmful training examples with token heatmaps,
the examples that matter most across queries, outliers, duplicate groups and score plots, written as
JSONL and one static HTML page (inline CSS, JS and images: no server, no network).

Files in the output directory: ``queries.jsonl`` (a line per query: its results with every token's
term, both sides), ``summary.json`` (examples across queries, outliers, duplicate groups, figures)
and ``report.html``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gradindex.apps.dedup import DedupConfig, find_duplicates
from gradindex.apps.explain import Explainer
from gradindex.apps.html import LEGEND, heatmap, page, table
from gradindex.apps.outliers import engine_outliers
from gradindex.heap import bound_heap
from gradindex.index.space import query_vectors
from gradindex.methods import DEFAULT_DAMPING, all_methods, parse_method, row_base
from gradindex.query import QueryEngine
from gradindex.query.inputs import as_records, describe
from gradindex.spec.manifest import row_basis

log = logging.getLogger("gradindex")

METHODS = all_methods("audit", selfnorm=False)
"""Methods of a report (scores, explanations, self-influence and dedup all take them): the registry's
``audit`` methods (:data:`gradindex.methods.REGISTRY`)."""


@dataclass(frozen=True)
class ReportConfig:
    k: int = 10
    """Most helpful and most harmful examples per query."""
    method: str | None = None
    """``graddot``, ``kfac`` or ``ekfac`` (scores, explanations and self-influence); None: the index's
    default (``ekfac`` where it answers it, else ``graddot``)."""
    damping: float = DEFAULT_DAMPING
    layers: tuple[str, ...] | None = None
    outliers: int = 20
    """Examples shown by self-influence."""
    dedup: bool = True
    """Search for duplicate groups."""
    dedup_threshold: float | None = None
    """Gradient cosine of near-duplicates (``None``: ``gradindex dedup``'s default for the method)."""
    sample: int = 20000
    """Training rows whose scores make each query's score distribution (all of them when fewer)."""
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in all_methods("audit", selfnorm=False):
            raise ValueError(f"the report's method is one of {', '.join(all_methods('audit', selfnorm=False))}, "
                             f"not {self.method!r}")
        if self.k < 1 or self.outliers < 0 or self.sample < 1:
            raise ValueError(f"k and sample must be >= 1 and outliers >= 0 (got k={self.k}, "
                             f"outliers={self.outliers}, sample={self.sample})")


SAMPLE_BLOCK_BYTES = 64 << 20
"""Bytes of float32 rows the score sample reads at once (each layer's also as float64, one at a time)."""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(scores: np.ndarray, labels: list[str], self_inf: np.ndarray, flagged: np.ndarray) -> dict[str, str]:
    """Base64 PNGs: each query's score distribution over the sampled rows; self-influence's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for j in range(min(len(scores), 8)):
        s = scores[j]
        ax.hist(s, bins=min(60, max(10, len(s) // 4)), histtype="step", label=labels[j][:40])
    ax.set_xlabel("score over training examples")
    ax.set_ylabel("examples")
    ax.set_title("Score distributions" + (" (first 8 queries)" if len(scores) > 8 else ""))
    ax.legend(fontsize=7)
    out["scores"] = _png(fig)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    pos = self_inf[self_inf > 0]
    if len(pos):
        lv = np.log10(pos)
        ax.hist(lv, bins=min(60, max(10, len(lv) // 4)), color="#668")
        if flagged.any():
            ax.axvline(np.log10(self_inf[flagged].min()), color="#c33", ls="--", label="outliers shown")
            ax.legend(fontsize=7)
    ax.set_xlabel("log10 self-influence")
    ax.set_ylabel("examples")
    ax.set_title("Self-influence distribution")
    out["self_influence"] = _png(fig)
    plt.close(fig)
    return out


def _score_sample(engine: QueryEngine, grads: dict[str, torch.Tensor], cfg: ReportConfig,
                  layers: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Sampled training ids and ``[Q, S]`` exact scores (the engine's exact re-rank, on every sampled row).

    The method names the influence asked for; on rows stored in a whitened basis the operation on the
    rows is another (:func:`gradindex.methods.row_base`: ``ekfac`` on EK-FAC-whitened rows is their
    plain inner product), so the preconditioner is not applied a second time.
    """
    rng = np.random.default_rng(0)
    ids = np.arange(engine.n) if engine.n <= cfg.sample else np.sort(rng.choice(engine.n, cfg.sample, replace=False))
    base = row_base(parse_method(cfg.method)[0], row_basis(engine.manifest), cfg.method)
    m, _, _ = query_vectors(engine.indices.space, engine.pre, base, cfg.damping, {n: grads[n] for n in layers})
    out = np.zeros((len(next(iter(m.values()))), len(ids)))
    width = sum(engine.store.dims[n] for n in layers)
    step = max(1, min(4096, SAMPLE_BLOCK_BYTES // (4 * width)))  # (4096 rows of 400 KB were 1.6 GB a block)
    for s in range(0, len(ids), step):
        rows = engine.store.read_rows(ids[s:s + step], layers)
        for n in layers:
            out[:, s:s + step] += m[n] @ rows[n].astype(np.float64).T
    return ids, out


def _hit_row(rank: int, h, e, kind: str) -> dict:
    return {"rank": rank, "kind": kind, "id": h.id, "score": h.score, "text": h.text,
            "tokens": e.train.tokens, "token_scores": e.train.scores, "query_token_scores": e.query.scores}


def build_report(engine: QueryEngine, queries: list, out_dir: str | os.PathLike,
                 cfg: ReportConfig = ReportConfig()) -> dict:
    """Answer ``queries``, explain their results, rank outliers and duplicates; write the report files.

    Returns the summary (also written to ``summary.json``).
    """
    bound_heap()  # freed blocks go back to the OS: the phases' peaks do not stack up (gradindex.heap)
    t0 = time.perf_counter()
    if cfg.method is None:
        cfg = replace(cfg, method=engine.base_method())  # (self-influence ranks outliers: ekfac itself)
    out = Path(out_dir)
    # a query file mixing forms gives every record every field, None where absent
    records = [{f: v for f, v in r.items() if v is not None} for r in as_records(queries, cfg.text_field)]
    layers = engine.select_layers(list(cfg.layers) if cfg.layers else None)
    tokens = engine.tokenize(records, cfg.text_field)
    out.mkdir(parents=True, exist_ok=True)  # (after the queries are read: a query refused writes nothing)
    grads, loss, ntok = engine.gradients(tokens)
    results = engine.search(grads, k=cfg.k, lowest=cfg.k, method=cfg.method, damping=cfg.damping, layers=layers)
    for j, r in enumerate(results):
        r.num_tokens, r.loss = int(ntok[j]), float(loss[j])
        if tokens.truncated[j]:
            r.notes.append("truncated to the index's max length")
    t_query = time.perf_counter() - t0
    ex = Explainer(engine)
    per_query = []
    for rec, r in zip(records, results, strict=True):
        hits = r.hits + r.lowest
        exps = ex.explain(rec, [h.id for h in hits], cfg.method, cfg.damping, layers, cfg.text_field)
        q_tokens = exps[0].query.tokens if exps else []
        per_query.append({
            "query": rec, "text": describe(rec, cfg.text_field, sep="‖"), "num_tokens": r.num_tokens, "loss": r.loss,
            "query_tokens": q_tokens, "notes": r.notes,
            "hits": [_hit_row(j + 1, h, e, "top") for j, (h, e) in enumerate(zip(r.hits, exps, strict=False))],
            "lowest": [_hit_row(j + 1, h, e, "lowest")
                       for j, (h, e) in enumerate(zip(r.lowest, exps[len(r.hits):], strict=True))]})
    t_explain = time.perf_counter() - t0 - t_query
    with open(out / "queries.jsonl", "w") as f:
        for q in per_query:
            f.write(json.dumps(q) + "\n")

    overall = _overall(per_query)
    _, sample = _score_sample(engine, grads, cfg, layers)
    ranking = engine_outliers(engine, cfg.method, cfg.damping, layers)
    top_out, flagged = _top_outliers(engine, ranking, cfg.outliers)
    dcfg = DedupConfig(threshold=cfg.dedup_threshold, method=cfg.method, damping=cfg.damping)
    groups = _duplicate_groups(engine, dcfg, layers) if cfg.dedup else []
    plots = _plots(sample, [q["text"] for q in per_query], ranking.self_influence, flagged)
    summary = {"index": str(getattr(engine, "home", engine.dir)), "examples": engine.n, "queries": len(per_query),
               "config": {**asdict(cfg), "dedup_threshold": dcfg.cut if cfg.dedup else None}, "layers": layers,
               "overall": overall[:100], "outliers": top_out,
               "duplicate_groups": groups,
               "score_sample": {"rows": int(sample.shape[1]), "mean": sample.mean(1).tolist(),
                                "std": sample.std(1).tolist()},
               "seconds": {"query": t_query, "explain": t_explain, "total": time.perf_counter() - t0}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.html").write_text(render_html(summary, per_query, plots))
    summary["seconds"]["total"] = time.perf_counter() - t0
    log.info("audit report in %s (%.1f s)", out, summary["seconds"]["total"])
    return summary


def _overall(per_query: list[dict]) -> list[dict]:
    """Across queries, how often and how strongly each example shows up (strongest first)."""
    agg: dict[int, dict] = {}
    for q in per_query:
        for h in q["hits"] + q["lowest"]:
            a = agg.setdefault(h["id"], {"id": h["id"], "text": h["text"], "in_top": 0, "in_lowest": 0,
                                         "sum_abs_score": 0.0, "sum_score": 0.0})
            a["in_top" if h["kind"] == "top" else "in_lowest"] += 1
            a["sum_abs_score"] += abs(h["score"])
            a["sum_score"] += h["score"]
    return sorted(agg.values(), key=lambda a: (-a["sum_abs_score"], a["id"]))


def _top_outliers(engine: QueryEngine, ranking, k: int) -> tuple[list[dict], np.ndarray]:
    """The ``k`` strongest outliers of ``ranking``, each with its text, and the ``[N]`` mask flagging them."""
    top = ranking.top(k) if k else []
    for o, t in zip(top, engine.texts.texts(np.array([o["id"] for o in top], dtype=np.int64)) if top else [],
                    strict=True):
        o["text"] = t
    flagged = np.zeros(engine.n, dtype=bool)
    flagged[[o["id"] for o in top]] = True
    return top, flagged


def _duplicate_groups(engine: QueryEngine, dcfg: DedupConfig, layers: list[str]) -> list[dict]:
    """The index's duplicate groups (:func:`find_duplicates`; sharded: over every part), each with its texts."""
    res = find_duplicates(getattr(engine, "whole", engine.dir), dcfg, layers)
    ids = sorted({i for g in res.groups for i in g.ids})
    by_id = dict(zip(ids, engine.texts.texts(np.array(ids, dtype=np.int64)), strict=True)) if ids else {}
    return [{**g.to_dict(), "texts": [by_id.get(i) for i in g.ids]} for g in res.groups]


def _hits_table(hits: list[dict], q_tokens: list[str]) -> str:
    rows = []
    for h in hits:
        qmap = heatmap(q_tokens, h["query_token_scores"])
        cell = (heatmap(h["tokens"], h["token_scores"])
                + f"<details><summary>query tokens for this example</summary>{qmap}</details>")
        rows.append([h["rank"], h["id"], h["score"], ("html", cell)])
    return table(["rank", "id", "score", "training example (token heatmap)"], rows)


def _signed_table(hits: list[dict], q_tokens: list[str], sign: int) -> str:
    """The hits whose score has ``sign`` (helpful: > 0, harmful: < 0); a line counts the others, which a k near the
    index's size brings into the list (an example scored +3 is not harmful because it ranks low)."""
    kept = [h for h in hits if h["score"] * sign > 0]
    left = len(hits) - len(kept)
    note = (f"<p class='muted'>{left} of these {len(hits)} have a score of the other sign or zero "
            f"({'they do not help' if sign > 0 else 'they help, or do nothing'}) and are not shown.</p>"
            if left else "")
    return (_hits_table(kept, q_tokens) if kept else "") + note


def render_html(summary: dict, per_query: list[dict], plots: dict[str, str]) -> str:
    """The report page from the summary, the per-query results and the base64 PNG plots."""
    cfg = summary["config"]
    damp = f", damping {cfg['damping']}" if cfg["method"] != "graddot" else ""
    parts = [f"<h1>gradindex audit report</h1><p class='muted'>{html.escape(summary['index'])}: "
             f"{summary['examples']} training examples, {summary['queries']} queries, method {cfg['method']}{damp}, "
             f"{len(summary['layers'])} layers, k = {cfg['k']}.</p>", LEGEND,
             "<h2>Queries</h2>"]
    for i, q in enumerate(per_query):
        parts.append(f"<h3 id='q{i}'>Query {i + 1}</h3><div class='query'>{html.escape(q['text'])}</div>"
                     f"<p class='muted'>{q['num_tokens']} target tokens, loss {q['loss']:.4g}"
                     + "".join(f"; {html.escape(n)}" for n in q["notes"]) + "</p>")
        for title, hits, sign in (("Most helpful (highest score)", q["hits"], 1),
                                  ("Most harmful (lowest score)", q["lowest"], -1)):
            parts.append(f"<h4>{title}</h4>" + _signed_table(hits, q["query_tokens"], sign))
    parts.append("<h2>Training examples that matter most across queries</h2>"
                 "<p class='muted'>By the sum of |score| over the queries' top and lowest lists.</p>")
    parts.append(table(["id", "in top", "in lowest", "sum |score|", "sum score", "text"],
                       [[a["id"], a["in_top"], a["in_lowest"], a["sum_abs_score"], a["sum_score"],
                         a["text"] or "(text unavailable)"] for a in summary["overall"][:50]]))
    parts.append("<h2>Outliers by self-influence</h2>")
    parts.append(table(["id", "self-influence", "per token", "tokens", "loss", "text"],
                       [[o["id"], o["self_influence"], o["per_token"], o["num_tokens"], o["loss"],
                         o["text"] or "(text unavailable)"] for o in summary["outliers"]]))
    parts.append("<h2>Duplicate groups</h2>")
    if not cfg.get("dedup", True) or cfg["dedup_threshold"] is None:
        parts.append("<p class='muted'>Not searched.</p>")
    elif not summary["duplicate_groups"]:
        parts.append(f"<p class='muted'>None at gradient cosine ≥ {cfg['dedup_threshold']}.</p>")
    else:
        parts.append(table(["group", "kind", "min cosine", "keep", "drop", "texts"],
                           [[g, d["kind"], d["min_cosine"], d["keep"], " ".join(map(str, d["drop"])),
                             ("html", "<br>".join(html.escape(str(t)) for t in d["texts"]))]
                            for g, d in enumerate(summary["duplicate_groups"])]))
    parts.append("<h2>Distributions</h2>"
                 f"<p class='muted'>Scores of {summary['score_sample']['rows']} training examples per query.</p>")
    for name in ("scores", "self_influence"):
        parts.append(f'<p><img class="plot" alt="{name} distribution" src="data:image/png;base64,{plots[name]}"></p>')
    return page("gradindex audit report", "".join(parts), "gxSortable();")
