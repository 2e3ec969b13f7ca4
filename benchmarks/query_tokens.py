"""Which of a query's tokens decide its attribution: planted-fact ranks with the loss of the first answer tokens
left out of the query gradient (an experiment for issue 31 item 2, not a default).

The fact queries of ``benchmarks.real_llm facts`` answer "It is V." where the fine-tuned model answers with the
entity's name, and ``gradindex explain`` put 61-65% of the winning rows' scores at the answer's first position
(the model's surprise at "It"). Here each fact query is given as token ids with labels, its first ``d`` answer
labels set to ignored, and scored with the default query on the cached indices of that study.

    python -m benchmarks.query_tokens --work $GRADINDEX_CACHE/smollm2/ft-n512-f40-s0-fef273aca2 --drop 0 1 2

With ``--target`` each fact query is also scored with the fact's value as its ``target`` (only the value's
tokens measured). With ``--weightings`` each answer token is scored alone once (cached; scores are linear in the
query's gradient) and every :data:`WEIGHTINGS` of them measured: fact ranks, and for ``--forms queries`` (a study
folder with retrainings, e.g. ``ft-n160-s0-fef273aca2``) the halves LDS paired against the plain sum.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.real_llm import RESULTS, fact_ranks, load_jsonl, paired

IGNORE = -100


def dropped(records: list[dict], tokenizer, max_length: int, drop: int) -> list[dict]:
    """The chat ``records`` as ``input_ids``/``labels`` queries (tokenized as the build does), their first ``drop``
    answer labels ignored."""
    import datasets

    from gradindex.data import tokenize_records

    t = tokenize_records(datasets.Dataset.from_list(records), tokenizer, max_length)
    out = []
    for ids, labels in zip(t.input_ids, t.labels, strict=True):
        labels = list(labels)
        for i in [i for i, y in enumerate(labels) if y != IGNORE][:drop]:
            labels[i] = IGNORE
        out.append({"input_ids": list(ids), "labels": labels})
    return out


def asked(work: Path, ft: dict, form: str) -> list[dict]:
    """A study's queries of ``form``: ``queries`` (all: facts, then held-out documentation), ``chat`` (its fact
    queries, "It is V."), or one of ``benchmarks.real_llm.FORMS``."""
    from benchmarks.real_llm import form_queries

    if form in ("queries", "chat"):
        qs = load_jsonl(work / "queries.jsonl")
        return qs if form == "queries" else qs[:ft["fact_queries"]]
    return form_queries(ft["facts"], form)


def ranks_row(ranks: list[int], method: str) -> dict:
    """Fact ranks as the JSON records them: how many first, of how many, MRR, the ranks, the method."""
    return {"at_1": sum(r == 1 for r in ranks), "of": len(ranks),
            "mrr": round(float(np.mean([1 / r for r in ranks])), 3), "ranks": ranks, "method": method}


def measure(work: Path, drops: list[int], paths: list[str], forms: list[str], max_length: int = 192) -> dict:
    """Per path, query form and drop: the fact ranks. ``forms``: ``chat`` (the chat set's own fact queries, "It is
    V.") and any of ``benchmarks.real_llm.FORMS``."""
    from gradindex.model import load_tokenizer
    from gradindex.query import QueryEngine

    ft = json.loads((work / "finetune.json").read_text())
    facts_of = {f: asked(work, ft, f) for f in forms}
    tok = load_tokenizer(work / "merged")
    out = {}
    for path in paths:
        with QueryEngine(work / path) as engine:
            for form, facts in facts_of.items():
                for d in drops:
                    ranks = fact_ranks(engine.scores(dropped(facts, tok, max_length, d)), ft["facts"])
                    name = f"{path}, first {d} answer tokens dropped" + ("" if form == "chat" else f", {form} form")
                    out[name] = ranks_row(ranks, engine.resolve_method(None))
                    print(name, out[name]["at_1"], flush=True)
    return out


def measure_targets(work: Path, paths: list[str], forms: list[str]) -> dict:
    """Per path and query form: fact ranks of the default query, and of the same query with its ``target`` the
    fact's value (only the value's tokens measured, :func:`gradindex.query.inputs.measure_target`)."""
    from gradindex.query import QueryEngine

    ft = json.loads((work / "finetune.json").read_text())
    facts_of = {f: asked(work, ft, f) for f in forms}
    out = {}
    for path in paths:
        with QueryEngine(work / path) as engine:
            for form, facts in facts_of.items():
                for name, qs in (("whole answer", facts),
                                 ("target: the value", [dict(q, target=f["value"]) for q, f in zip(facts, ft["facts"],
                                                                                                  strict=True)])):
                    ranks = fact_ranks(engine.scores(qs), ft["facts"])
                    key = f"{path}, {form} form, {name}"
                    out[key] = ranks_row(ranks, engine.resolve_method(None))
                    print(key, out[key]["at_1"], flush=True)
    return out


def single_tokens(records: list[dict], tokenizer, max_length: int) -> tuple[list[dict], list[int]]:
    """Each record's answer tokens one at a time: one ``input_ids``/``labels`` query per label kept (the others
    ignored), and the record each came from. Scores are linear in the query's gradient, so a record's score is the
    sum of its tokens' (:func:`weighted`)."""
    import datasets

    from gradindex.data import tokenize_records

    t = tokenize_records(datasets.Dataset.from_list(records), tokenizer, max_length)
    out, owner = [], []
    for j, (ids, labels) in enumerate(zip(t.input_ids, t.labels, strict=True)):
        for i in [i for i, y in enumerate(labels) if y != IGNORE]:
            one = [IGNORE] * len(labels)
            one[i] = labels[i]
            out.append({"input_ids": list(ids), "labels": one})
            owner.append(j)
    return out, owner


def per_token_scores(work: Path, path: str, records: list[dict], name: str, max_length: int = 192) -> list[np.ndarray]:
    """Per record, ``[T, N]`` default-query scores of each of its answer tokens alone (cached in ``work``)."""
    from gradindex.model import load_tokenizer
    from gradindex.query import QueryEngine

    cache = work / f"per-token-{path}-{name}.npz"
    if cache.exists():
        z = np.load(cache)
        return [z[str(j)] for j in range(len(records))]
    qs, owner = single_tokens(records, load_tokenizer(work / "merged"), max_length)
    with QueryEngine(work / path) as engine:
        s = np.concatenate([engine.scores(qs[i:i + 64]) for i in range(0, len(qs), 64)])
    owner = np.array(owner)
    out = [s[owner == j] for j in range(len(records))]
    np.savez(cache, **{str(j): x for j, x in enumerate(out)})
    return out


WEIGHTINGS = {  # a record's score from its tokens' score vectors S [T, N]
    "sum (the default)": lambda S: S.sum(0),
    "first dropped": lambda S: S[1:].sum(0),
    "tokens unit-normed": lambda S: (S / np.linalg.norm(S, axis=1, keepdims=True).clip(1e-30)).sum(0),
    "tokens z-scored": lambda S: ((S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True).clip(1e-30)).sum(0),
}


def weighted(per_token: list[np.ndarray], how: str) -> np.ndarray:
    """``[Q, N]`` scores of the records from their per-token scores under weighting ``how``."""
    return np.stack([WEIGHTINGS[how](S) for S in per_token])


def measure_weightings(work: Path, paths: list[str], forms: list[str]) -> dict:
    """Per path and query form (``queries``: the chat set's fact and documentation queries, with the halves LDS;
    a fact form: its fact ranks): every :data:`WEIGHTINGS` of the per-token scores (computed once, cached)."""
    from benchmarks.common import evaluate

    ft = json.loads((work / "finetune.json").read_text())
    F = ft["fact_queries"]
    out = {}
    for path in paths:
        for form in forms:
            per = per_token_scores(work, path, asked(work, ft, form), form)
            lds = retrained(work, ft["n"]) if form == "queries" else None
            base = None
            for how in WEIGHTINGS:
                s = weighted(per, how)
                ranks = fact_ranks(s[:F], ft["facts"])
                row = {"facts_at_1": sum(r == 1 for r in ranks), "of": len(ranks), "ranks": ranks}
                if lds is not None and len(lds[0]):
                    pq = evaluate(s, *lds)["per_query"]
                    base = pq if base is None else base  # (the first weighting: the plain sum)
                    row |= {"halves": len(lds[0]), "lds": round(float(pq.mean()), 4),
                            "lds_facts": round(float(pq[:F].mean()), 4), "lds_docs": round(float(pq[F:].mean()), 4),
                            "paired_vs_sum": paired(pq, base)}
                out[f"{path}, {form}, {how}"] = row
                print(f"{path}, {form}, {how}", {k: v for k, v in row.items() if k != "ranks"}, flush=True)
    return out


def retrained(work: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(masks [M, N], losses [M, 1, Q])`` of the seed-0 halves retrained so far in ``work/retrain``."""
    from benchmarks.real_llm import halves

    m = 0
    while (work / "retrain" / f"s{m:03d}-r0.json").exists():
        m += 1
    losses = [json.loads((work / "retrain" / f"s{i:03d}-r0.json").read_text())["losses"] for i in range(m)]
    return halves(n, m), np.array(losses)[:, None]


def target_positions(records: list[dict], values: list[str], tokenizer, max_length: int = 192) -> list[list[int]]:
    """Per record, the indices among its loss tokens (in order: the rows of :func:`per_token_scores` and the
    entries of a retraining's per-token losses) of the tokens :func:`gradindex.query.inputs.measure_target` keeps
    for the target ``values[j]``."""
    import datasets

    from gradindex.data import tokenize_records
    from gradindex.query.inputs import measure_target

    t = tokenize_records(datasets.Dataset.from_list(records), tokenizer, max_length)
    out = []
    for j, (labels, value) in enumerate(zip(t.labels, values, strict=True)):
        labels = list(labels)
        kept = measure_target(labels, value, tokenizer, j)
        out.append([n for n, k in enumerate([k for k, y in enumerate(labels) if y != IGNORE]) if kept[k] != IGNORE])
    return out


def token_retrained(work: Path) -> tuple[list[int], list[dict]]:
    """The seed-0 subsets whose per-token losses exist, in order, and their records: those ``benchmarks.real_llm
    retrain-tokens`` re-ran (``retrain/tokens/sNNN-r0.json``) and the halves retrained since the halves files also
    hold them (``retrain/sNNN-r0.json`` with ``token_losses``)."""
    found = {}
    for f in sorted((work / "retrain").glob("s[0-9][0-9][0-9]-r0.json")):
        rec = json.loads(f.read_text())
        if "token_losses" in rec:
            found[int(f.stem[1:4])] = rec
    for f in (work / "retrain" / "tokens").glob("s[0-9][0-9][0-9]-r0.json"):
        found[int(f.stem[1:4])] = json.loads(f.read_text())
    done = sorted(found)
    return done, [found[i] for i in done]


def measure_target_lds(work: Path, path: str = "idx-full") -> dict:
    """The halves LDS of the fact queries with the fact's value as their ``target``: each query's score the sum of
    its per-token scores (:func:`per_token_scores`, the default query) over the value's tokens, against the
    retrained models' loss on those same tokens (the per-token losses of ``real_llm retrain-tokens``); beside it
    the whole answer against the whole answer's loss, BM25 against the target's loss, and the crossings, paired
    on the same fact queries and subsets. Checks the token alignment on the way (counts per query, the per-token
    sums against the summed losses, the target sums against the engine's own ``target`` query)."""
    import datasets

    from benchmarks.baselines import bm25_scores
    from benchmarks.common import evaluate
    from benchmarks.real_llm import bm25, halves
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import load_tokenizer
    from gradindex.query import QueryEngine
    from gradindex.query.inputs import measure_target

    ft = json.loads((work / "finetune.json").read_text())
    F = ft["fact_queries"]
    queries = asked(work, ft, "queries")
    facts = queries[:F]
    values = [f["value"] for f in ft["facts"]]
    tok = load_tokenizer(work / "merged")
    per = per_token_scores(work, path, facts, "chat")  # [T_j, N] per fact query (its tokens alone scored)
    pos = target_positions(facts, values, tok)
    done, recs = token_retrained(work)
    if len(done) < 3:
        raise SystemExit(f"{len(done)} subsets with per-token losses in {work / 'retrain' / 'tokens'}; the LDS "
                         "needs at least 3 (benchmarks.real_llm retrain-tokens makes them)")
    masks_all = np.load(work / "masks.npy")
    if not np.array_equal(masks_all, halves(ft["n"], len(masks_all))):
        raise SystemExit("masks.npy is not the halves real_llm draws")
    masks = masks_all[done]
    old = np.array([json.loads((work / "retrain" / f"s{i:03d}-r0.json").read_text())["losses"] for i in done])
    for i, r in zip(done, recs, strict=True):
        if r["rows"] != np.flatnonzero(masks_all[i]).tolist() or r["seed"] != 1000:
            raise SystemExit(f"subset {i}'s per-token file was trained on other rows or another seed")
    new = np.array([r["losses"] for r in recs])  # [M, Q] summed losses of the re-runs
    tl = [[np.array(t) for t in r["token_losses"]] for r in recs]  # [M][Q] per-token losses
    # -- token alignment: the per-token losses and the per-token scores index the same tokens
    counts_scores = [len(S) for S in per]
    counts_losses = sorted({tuple(len(t) for t in x[:F]) for x in tl})
    if counts_losses != [tuple(counts_scores)]:
        raise SystemExit(f"per-token counts differ: scores {counts_scores}, retrained losses {counts_losses}")
    sums = np.array([[t.sum() for t in x] for x in tl])
    rel = lambda a, b: float(np.max(np.abs(a - b) / np.abs(b)))  # noqa: E731
    rel_row = lambda a, b: float(np.max(np.abs(a - b).max(1) / np.abs(b).max(1)))  # noqa: E731  (to each row's scale)
    with QueryEngine(work / path) as engine:
        engine_target = engine.scores([dict(q, target=v) for q, v in zip(facts, values, strict=True)])
        method = engine.resolve_method(None)
    s_target = np.stack([S[p].sum(0) for S, p in zip(per, pos, strict=True)])
    s_whole = np.stack([S.sum(0) for S in per])
    default = np.load(work / "scores.npz")["first stage ekfac-selfnorm (full)"][:F]
    check = {
        "subsets_done": done, "seed": 1000,
        "tokens_per_query": counts_scores,
        "target_tokens": [[tok.decode([int(x)]) for x in np.array(
            [y for y in tokenize_records(datasets.Dataset.from_list([q]), tok, 192).labels[0] if y != IGNORE])[p]]
            for q, p in zip(facts, pos, strict=True)],
        "per_token_sum_vs_new_summed_max_rel": rel(sums, new),
        "new_summed_vs_existing_max_rel": rel(new, old),
        "new_summed_vs_existing_max_abs": float(np.max(np.abs(new - old))),
        "target_score_vs_engine_target_query_max_rel_to_row": rel_row(s_target, engine_target),
        "whole_score_vs_cached_default_max_rel_to_row": rel_row(s_whole, default),
        "method": method,
    }
    print(json.dumps(check), flush=True)
    target_loss = np.array([[t[p].sum() for t, p in zip(x[:F], pos, strict=True)] for x in tl])  # [M, F]
    train = tokenize_records(load_records(ft["data"]), tok, 192)
    qt = tokenize_records(datasets.Dataset.from_list(facts), tok, 192)
    bm25_target = bm25_scores([list(x) for x in train.input_ids], [list(x) for x in qt.input_ids],
                              [measure_target(list(y), v, tok) for y, v in zip(qt.labels, values, strict=True)])
    bm25_whole = bm25(ft, facts)
    conditions = {  # name: (score [F, N], ground truth [M, F])
        "target query vs target loss": (s_target, target_loss),
        "whole answer vs whole-answer loss (existing retrainings)": (s_whole, old[:, :F]),
        "whole answer vs whole-answer loss (re-runs)": (s_whole, new[:, :F]),
        "whole answer vs target loss": (s_whole, target_loss),
        "target query vs whole-answer loss (re-runs)": (s_target, new[:, :F]),
        "bm25 (whole answer) vs target loss": (bm25_whole, target_loss),
        "bm25 (target tokens) vs target loss": (bm25_target, target_loss),
        "bm25 (whole answer) vs whole-answer loss (re-runs)": (bm25_whole, new[:, :F]),
    }
    rows = {}
    for name, (score, truth) in conditions.items():
        pq = evaluate(score, masks, truth[:, None, :])["per_query"]
        rows[name] = {"lds": round(float(pq.mean()), 4), "se": round(float(pq.std(ddof=1) / np.sqrt(len(pq))), 4),
                      "lds_per_query": [round(float(x), 4) for x in pq]}
    cached = evaluate(default, masks, old[:, None, :F])["per_query"]  # the existing figures on these subsets
    check["whole_answer_lds_vs_cached_default_max_abs"] = float(np.max(np.abs(
        cached - np.array(rows["whole answer vs whole-answer loss (existing retrainings)"]["lds_per_query"]))))
    ref = rows["target query vs target loss"]["lds_per_query"]
    for name, row in rows.items():
        if name != "target query vs target loss":
            row["target_query_vs_this"] = paired(ref, row["lds_per_query"])
    ranks = {"target query": ranks_row(fact_ranks(s_target, ft["facts"]), method),
             "whole answer": ranks_row(fact_ranks(s_whole, ft["facts"]), method)}
    for name, row in rows.items():
        print(f"{name}: {row['lds']} +- {row['se']}", row.get("target_query_vs_this", ""), flush=True)
    return {"work": work.name, "index": path, "method": method, "subsets": len(done), "fact_queries": F,
            "conditions": "halves LDS (Spearman per fact query over the subsets of the summed scores against minus "
                          "the retrained loss) on the seed-0 subsets re-run with per-token losses (real_llm "
                          "retrain-tokens, one thread, nice 19, on 2 shared cores); scores: the cached per-token "
                          f"default-query scores ({path}) summed over the tokens measure_target keeps for the "
                          "fact's value (target) or over all answer tokens (whole answer); BM25 of the whole answer's "
                          "or the target's tokens",
            "check": check, "results": rows, "fact_ranks": ranks}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="a facts study's folder (finetune.json, idx-*)")
    p.add_argument("--drop", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--paths", nargs="+", default=["idx-full", "idx-adapter"])
    p.add_argument("--forms", nargs="+", default=["chat"],
                   help="fact query forms: chat (the chat set's own) and benchmarks.real_llm.FORMS' names")
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON to write the key into")
    p.add_argument("--weightings", action="store_true",
                   help="per-token scores of --forms (queries: the chat set's queries, with the halves LDS) under "
                        "every weighting")
    p.add_argument("--target", action="store_true", help="each fact query also with its value as its target")
    p.add_argument("--target-lds", action="store_true",
                   help="the halves LDS of the fact queries with their value as target, against the retrained loss "
                        "on the same tokens (per-token losses of real_llm retrain-tokens), beside the whole answer "
                        "and BM25")
    a = p.parse_args(argv)
    if a.target_lds:
        key, res = f"query-target-lds-{a.work.name}", measure_target_lds(a.work, a.paths[0])
    elif a.weightings:
        key, res = f"query-token-weightings-{a.work.name}", {
            "work": a.work.name, "weightings": list(WEIGHTINGS),
            "results": measure_weightings(a.work, a.paths, a.forms)}
    elif a.target:
        key, res = f"query-target-{a.work.name}", {
            "work": a.work.name, "queries": "the study's fact queries in each --forms phrasing",
            "results": measure_targets(a.work, a.paths, a.forms)}
    else:
        key, res = "query-tokens", {"work": a.work.name,
                                    "queries": "the study's fact queries ('What is the R of E?' / 'It is V.')",
                                    "results": measure(a.work, a.drop, a.paths, a.forms)}
    result = json.loads(a.results.read_text()) if a.results.exists() else {}  # re-read: others write other keys
    result[key] = res
    a.results.write_text(json.dumps(result, indent=1))
    print(json.dumps(res["results"], indent=1))


if __name__ == "__main__":
    main()
