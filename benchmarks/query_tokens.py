"""Which of a query's tokens decide its attribution: planted-fact ranks with the loss of the first answer tokens
left out of the query gradient (an experiment for issue 31 item 2, not a default).

The fact queries of ``benchmarks.real_llm facts`` answer "It is V." where the fine-tuned model answers with the
entity's name, and ``gradindex explain`` put 61-65% of the winning rows' scores at the answer's first position
(the model's surprise at "It"). Here each fact query is given as token ids with labels, its first ``d`` answer
labels set to ignored, and scored with the default query on the cached indices of that study.

    python -m benchmarks.query_tokens --work $GRADINDEX_CACHE/smollm2/ft-n512-f40-s0-fef273aca2 --drop 0 1 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.real_llm import RESULTS, fact_ranks, load_jsonl

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


def measure(work: Path, drops: list[int], paths: list[str], max_length: int = 192) -> dict:
    from gradindex.model import load_tokenizer
    from gradindex.query import QueryEngine

    ft = json.loads((work / "finetune.json").read_text())
    facts = load_jsonl(work / "queries.jsonl")[:ft["fact_queries"]]
    tok = load_tokenizer(work / "merged")
    out = {}
    for path in paths:
        with QueryEngine(work / path) as engine:
            for d in drops:
                ranks = fact_ranks(engine.scores(dropped(facts, tok, max_length, d)), ft["facts"])
                out[f"{path}, first {d} answer tokens dropped"] = {
                    "at_1": sum(r == 1 for r in ranks), "of": len(ranks),
                    "mrr": round(float(np.mean([1 / r for r in ranks])), 3), "ranks": ranks,
                    "method": engine.resolve_method(None)}
                print(path, d, out[f"{path}, first {d} answer tokens dropped"]["at_1"], flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="a facts study's folder (finetune.json, idx-*)")
    p.add_argument("--drop", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--paths", nargs="+", default=["idx-full", "idx-adapter"])
    a = p.parse_args(argv)
    res = {"work": a.work.name, "queries": "the study's fact queries ('What is the R of E?' / 'It is V.')",
           "results": measure(a.work, a.drop, a.paths)}
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result["query-tokens"] = res
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(res["results"], indent=1))


if __name__ == "__main__":
    main()
