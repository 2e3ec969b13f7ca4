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
    a = p.parse_args(argv)
    if a.weightings:
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
