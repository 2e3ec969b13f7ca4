"""The plan's exact-stage time against the exact stage itself, side by side in one process (issue 30 item 4).

On the SmolLM2 fine-tune's index with its full-space fit (``idx-full`` of ``benchmarks/real_llm.py``): the plan's
rates (the timed capture batches, :func:`gradindex.plan.dense_rates`) and, per query and ``C``, the exact stage's
measured seconds beside :func:`gradindex.estimate.exact_stage_flops` at those rates for that query's tokens and
its candidates' own lengths (low: dense products at the matmul rates; high: everything at the capture's rate).

    GRADINDEX_CACHE=... OMP_NUM_THREADS=2 python -m benchmarks.exact_time [--queries 13] [--C 5 30]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "exact_time.json"


def main(argv=None) -> dict:
    import datasets

    from benchmarks.smollm2 import finetune_dir
    from gradindex.data import load_records, tokenize_records
    from gradindex.estimate import exact_stage_flops, stage_flops
    from gradindex.plan import dense_rates, measure_seconds, plan_build
    from gradindex.query import QueryEngine
    from gradindex.store.builder import BuildConfig

    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--queries", type=int, nargs="+", default=[13], help="positions in the study's queries.jsonl")
    p.add_argument("--C", type=int, nargs="+", default=[5, 30])
    a = p.parse_args(argv)
    work = finetune_dir()
    qs = [json.loads(x) for x in (work / "queries.jsonl").read_text().splitlines() if x.strip()]
    out = {"threads": torch.get_num_threads(), "load_before": round(os.getloadavg()[0], 1), "runs": []}
    with QueryEngine(work / "idx-full") as e:
        e.query(qs[0], k=10)  # (the model loaded, warm)
        model, tok = e.model, e.tokenizer
        train = tokenize_records(load_records(work / "train.jsonl"), tok, 192)
        cfg = BuildConfig(max_length=192, batch_size=8)
        plan = plan_build(model, cfg, len(train), index=False)
        secs = measure_seconds(model, train, cfg, plan, tok.pad_token_id, 3)
        lengths = [len(x) for x in train.input_ids]
        rate = stage_flops(model, cfg, plan, np.asarray(lengths))[0]["capture"] / secs["capture"]
        out["plan_exact_seconds_C30"] = [round(x, 1) for x in plan.exact_seconds]
        for qi in a.queries:
            qt = len(tokenize_records(datasets.Dataset.from_list([qs[qi]]), tok, 192).input_ids[0])
            for C in a.C:
                first = e.query_batch([qs[qi]], k=C, method="ekfac-selfnorm", rerank_full=0)[0]
                t = time.perf_counter()
                r = e.query_batch([qs[qi]], k=10, method="ekfac-selfnorm", rerank_full=C)[0]
                wall = time.perf_counter() - t
                f = exact_stage_flops(model, cfg, plan.layers, qt, [lengths[h.id] for h in first.hits[:C]])
                passes, dense = f["passes"], f["query"] + f["candidates"]
                on_m, on_tokens = dense_rates(plan, "cpu", round(min(cfg.batch_size, C) * float(np.mean(lengths))))
                low = passes / rate + f["query"] / on_m + f["candidates"] / on_tokens
                run = {"query": qi, "C": C, "query_tokens": qt, "measured_s": round(r.seconds["rerank_full"], 1),
                       "query_wall_s": round(wall, 1), "planned_low_s": round(low, 1),
                       "planned_high_s": round((passes + dense) / rate, 1),
                       "rates_gflops": {"capture": round(rate / 1e9, 1), "query_rotation": round(on_m / 1e9, 1),
                                        "candidate_products": round(on_tokens / 1e9, 1)}}
                out["runs"].append(run)
                print(run, flush=True)
    out["load_after"] = round(os.getloadavg()[0], 1)
    RESULTS.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
