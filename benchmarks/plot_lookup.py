"""Lookup latency and recall@10 against the number of indexed examples, from benchmarks/query.py's results.

Reads ``benchmarks/results/query-*.json`` (one run of ``benchmarks/query.py --examples N`` each) and
plots the chosen setting's search p50/p95, the end-to-end p95 and recall@10 against ``N`` (log x),
to ``benchmarks/results/lookup-scaling.png``; prints the table. The runs were made on different
days and machine loads: compare the trend, not single points.

    python -m benchmarks.plot_lookup
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    rows = []
    for f in sorted(RESULTS.glob("query-*.json")):
        for r in json.loads(f.read_text())["results"]:
            c, e = r["chosen"], r.get("e2e") or {}
            rows.append({"examples": r["examples"], "factory": r["factory"], "recall": c["recall@10"],
                         "search_p50_ms": c["p50_ms"], "search_p95_ms": c["p95_ms"],
                         "e2e_p95_ms": e.get("p95_ms"), "index_bytes_per_example": r["index_bytes_per_example"]})
    rows.sort(key=lambda r: r["examples"])
    print("| examples | index | recall@10 | search p50 ms | search p95 ms | end-to-end p95 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        e2e = f"{r['e2e_p95_ms']:.0f}" if r["e2e_p95_ms"] is not None else "—"
        print(f"| {r['examples']:,} | {r['factory']} | {r['recall']:.3f} | {r['search_p50_ms']:.0f} | "
              f"{r['search_p95_ms']:.0f} | {e2e} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["examples"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.semilogx(n, [r["search_p50_ms"] for r in rows], "o-", label="search p50")
    a.semilogx(n, [r["search_p95_ms"] for r in rows], "o-", label="search p95")
    a.semilogx(n, [r["e2e_p95_ms"] or float("nan") for r in rows], "o-", label="end to end p95")
    a.set_xlabel("indexed examples")
    a.set_ylabel("ms per query (2 CPU cores)")
    a.legend()
    a.grid(True, which="both", alpha=0.3)
    b.semilogx(n, [r["recall"] for r in rows], "o-")
    b.set_ylim(0.9, 1.005)
    b.set_xlabel("indexed examples")
    b.set_ylabel("recall@10 against exact search")
    b.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "lookup-scaling.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
