"""A sharded index's lookup against the index it was split from, on ``benchmarks/lookup_scale.py``'s real default rows
(GPT-2 2x32, int4 EK-FAC eigenbasis rows, 12.6 KiB an example) with the exhaustive ``sketch`` tier: search p50/p95 of
one query at a time, the top 10's agreement with the unsplit index and recall@10 of the exhaustive default (where
``lookup_scale --truth`` kept it), and each process's peak RSS (issue 34).

For ``N`` (an index ``WORK/idx-N`` built by ``lookup_scale --build N``, left as it is) and ``P`` parts:

1. ``WORK/shard-bench/idx-N``: the index with the sketch tier (its store, basis and fits hard-linked, its manifest,
   hashes and tier its own), then ``split`` into ``WORK/shard-bench/idx-N-pP`` (each part's sketch over its rows);
2. the queries' rows (``truth-N.npz``'s, else computed with the model) and the exhaustive default's top 10 of each
   (the unsplit index's exact scores of every row) in ``WORK/shard-bench/queries-N.npz``;
3. lookups, each in its own process, one torch thread a process: the unsplit index; the sharded index in one process
   (every part in turn); and under ``torchrun --nproc_per_node P`` (rank 0 searches its parts and gathers the others');
   ``--rounds`` times in turn (p50/p95: the median of the rounds'). The sharded lookups re-rank each part's share of
   the sketch's ``C`` candidates (:func:`gradindex.query.sharded.part_candidates`); the ranks are also run as before
   that, every part re-ranking a whole ``C`` of its own (``whole C a part``), side by side in the same rounds.

    python -m benchmarks.shard_lookup --n 100000 --parts 2 --work /work/tmp/lookup

writes ``benchmarks/results/shard-lookup.json`` (a run per ``(N, P)`` and ``--label``, replaced when measured again),
with every process's RSS after its imports, after opening its index or parts, after its first query, and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "shard-lookup.json"
QUERIES = 40


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sketch_copy(src: Path, dst: Path) -> None:
    """``src`` with the sketch tier in ``dst``: the store, basis and fits hard-linked (read only here), the manifest,
    the recorded hashes and the tier written in ``dst`` alone."""
    from gradindex.index import IndexConfig, build_indices

    if (dst / "manifest.json").exists():
        return
    dst.mkdir(parents=True)
    for sub in ("store", "precond"):
        (dst / sub).mkdir()
        for f in sorted((src / sub).iterdir()):
            os.link(f, dst / sub / f.name)
    os.link(src / "basis.h5", dst / "basis.h5")
    for f in ("manifest.json", "checksums.json"):
        shutil.copy2(src / f, dst / f)
    shutil.copytree(src / "faiss", dst / "faiss")
    t = time.perf_counter()
    build_indices(dst, IndexConfig(factory="sketch"), progress=False, force=True)
    log(f"{dst.name}: sketch tier in {time.perf_counter() - t:.0f} s")


def prepare(n: int, parts: int, work: Path) -> tuple[Path, Path, Path]:
    """The sketch copy, its split in ``parts`` and the queries' rows (module doc)."""
    import numpy as np

    from gradindex.index.sharded import split_index

    bench = work / "shard-bench"
    one, sh, qf = bench / f"idx-{n}", bench / f"idx-{n}-p{parts}", bench / f"queries-{n}.npz"
    sketch_copy(work / f"idx-{n}", one)
    if not (sh / "shards.json").exists():
        shutil.rmtree(sh, ignore_errors=True)
        t = time.perf_counter()
        split_index(one, sh, parts)
        log(f"{sh.name}: split in {time.perf_counter() - t:.0f} s")
    if not qf.exists():
        truth = work / f"truth-{n}.npz"
        if truth.exists():  # (its query rows; its ids were scored by an older default: scored again below)
            z = np.load(truth)
            rows = {k[2:]: z[k] for k in z.files if k.startswith("q:")}
        else:
            from benchmarks.lookup import query_rows
            from benchmarks.lookup_scale import windows

            _, _, queries = windows(1, QUERIES)
            rows = query_rows(one, work / "model", queries)
        np.savez(qf, exact=exact_top10(one, rows), **{f"q:{k}": v for k, v in rows.items()})
    return one, sh, qf


def exact_top10(index: Path, rows: dict):
    """``[Q, 10]`` the exhaustive default's top 10 (the engine's exact scores of every row, its default method)."""
    import numpy as np
    import torch

    from gradindex.query import QueryEngine

    torch.set_num_threads(1)
    t = time.perf_counter()
    with QueryEngine(index, load_model=False, use_gpu=False) as e:
        s = e.scores({n: torch.from_numpy(v) for n, v in rows.items()})
    log(f"{index.name}: exact scores of {len(s)} queries over every row in {time.perf_counter() - t:.0f} s")
    return np.argsort(-s, axis=1, kind="stable")[:, :10]


def peak_rss() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    """``/proc/self/status``'s ``key`` (kB) in bytes (0 where there is none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_stage(stages: dict, name: str) -> None:
    """Record this process's RSS (its anonymous part, and its peak so far) at stage ``name``."""
    stages[name] = {"rss": _status("VmRSS"), "anon": _status("RssAnon"), "peak": _status("VmHWM")}


class _Part:
    """A rank's parts (:class:`gradindex.query.sharded.PartSearch`), its RSS recorded after its first request."""

    def __init__(self, local, stages: dict):
        self.local, self.stages = local, stages

    def run(self, op: str, kw: dict):
        out = self.local.run(op, kw)
        if "first query" not in self.stages:
            rss_stage(self.stages, "first query")
        return out


def follow_parts(index: Path, stages: dict) -> None:
    """A rank other than 0: :func:`gradindex.query.sharded.serve_parts`, its RSS recorded after it opened its
    parts and after its first request."""
    from gradindex import distributed
    from gradindex.index.sharded import read_sharded
    from gradindex.query.sharded import PartSearch, follow

    sh = read_sharded(index)
    local = PartSearch(sh, sh.owned(distributed.rank(), distributed.world_size()), use_gpu=False)
    rss_stage(stages, "opened")
    try:
        follow(_Part(local, stages))
    finally:
        local.close()


def lookups(index: Path, qf: Path, out: Path, whole: bool = False) -> None:
    """One process (or rank 0 under torchrun): 40 searches one at a time after 3 warm-up ones; JSON to ``out``."""
    import numpy as np
    import torch

    from gradindex import distributed
    from gradindex.query import QueryEngine
    from gradindex.query.sharded import ShardedQueryEngine

    torch.set_num_threads(1)
    mem: dict = {}
    rss_stage(mem, "imports")
    ranks = distributed.init_from_env("cpu", timeout=600)
    z = np.load(qf)
    q = {k[2:]: z[k] for k in z.files if k.startswith("q:")}
    if distributed.rank() > 0:
        follow_parts(index, mem)
        rss_stage(mem, "end")
        distributed.gather((peak_rss(), mem))
        distributed.shutdown()
        distributed.exit_rank(0)
    sharded = (index / "shards.json").exists()
    opener = ShardedQueryEngine if sharded else QueryEngine
    t = time.perf_counter()
    more = {"share_candidates": not whole} if sharded else {}
    with opener(index, load_model=False, use_gpu=False, **more) as e:
        rss_stage(mem, "opened")
        for j in range(3):  # (warm: the tier loaded, the page cache)
            e.search({n: v[j:j + 1] for n, v in q.items()}, k=10, texts=False)
            if j == 0:
                rss_stage(mem, "first query")
        opened = time.perf_counter() - t
        ts, top, stages = [], [], []
        for j in range(len(next(iter(q.values())))):
            t = time.perf_counter()
            r = e.search({n: v[j:j + 1] for n, v in q.items()}, k=10, texts=False)[0]
            ts.append(time.perf_counter() - t)
            top.append([h.id for h in r.hits])
            stages.append(r.seconds)
    rss_stage(mem, "end")
    rss, per = zip(*distributed.gather((peak_rss(), mem))) if ranks else ([peak_rss()], [mem])
    res = {"p50_s": float(np.percentile(ts, 50)), "p95_s": float(np.percentile(ts, 95)), "queries": len(ts),
           "open_and_warm_s": round(opened, 2), "peak_rss_bytes_per_process": list(rss),
           "rss_bytes_by_stage_per_process": list(per), "top10": top,
           # (each stage's median seconds; over parts: the parts' seconds added, every rank's)
           "stage_seconds_p50": {k: float(np.median([x.get(k, 0.0) for x in stages])) for k in stages[0]}}
    out.write_text(json.dumps(res))
    if ranks:
        distributed.shutdown()
        distributed.exit_rank(0)


def summarize(runs: dict[str, dict], qf: Path) -> None:
    """Each lookup's median p50/p95 over the rounds, and its top 10 against the unsplit's and the exhaustive
    default's (the top 10s themselves dropped)."""
    import numpy as np

    for e in runs.values():
        e["p50_s"] = float(np.median([x["p50_s"] for x in e["rounds"]]))
        e["p95_s"] = float(np.median([x["p95_s"] for x in e["rounds"]]))
    z = np.load(qf)
    base = runs["unsplit"]["top10"]
    for r in runs.values():
        r["same_top10_as_unsplit"] = float(np.mean([a == b for a, b in zip(r["top10"], base, strict=True)]))
        r["recall@10_of_unsplit"] = float(np.mean([len(set(a) & set(b)) / 10
                                                   for a, b in zip(r["top10"], base, strict=True)]))
        r["recall@10_of_exhaustive_default"] = float(np.mean([len(set(a) & set(t.tolist())) / 10
                                                              for a, t in zip(r["top10"], z["exact"], strict=True)]))
        del r["top10"]


def run(n: int, parts: int, work: Path, out: Path, rounds: int = 1, label: str | None = None) -> dict:
    """The three lookups (module doc), ``rounds`` times in turn (the machine's other load shifts between rounds; each
    round's p50/p95 kept, their medians reported). The run replaces the one of the same ``(N, P, label)``."""

    one, sh, qf = prepare(n, parts, work)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    tmp = work / "shard-bench"
    configs = [
        ("unsplit", [sys.executable, "-m", "benchmarks.shard_lookup", "--lookups", str(one)]),
        ("sharded, one process", [sys.executable, "-m", "benchmarks.shard_lookup", "--lookups", str(sh)]),
        (f"sharded, {parts} gloo ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc_per_node", str(parts), "-m", "benchmarks.shard_lookup",
                                          "--lookups", str(sh)]),
        (f"sharded, {parts} gloo ranks, whole C a part", [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(parts), "-m",
            "benchmarks.shard_lookup", "--lookups", str(sh), "--whole-candidates"]),
    ]
    runs: dict[str, dict] = {}
    load = []
    for r in range(rounds):
        load.append(round(os.getloadavg()[0], 1))
        for i, (name, cmd) in enumerate(configs):
            f = tmp / f"lookups-{n}-{parts}-{i}.json"
            subprocess.run([*cmd, "--queries-file", str(qf), "--result", str(f)], cwd=ROOT, env=env, check=True)
            got = json.loads(f.read_text())
            log(f"N={n}, P={parts}, round {r + 1}, {name}: search p50/p95 {got['p50_s'] * 1e3:.0f}/"
                f"{got['p95_s'] * 1e3:.0f} ms, peak RSS "
                f"{', '.join(f'{b / 2**30:.2f}' for b in got['peak_rss_bytes_per_process'])} GiB")
            e = runs.setdefault(name, {"rounds": [], "top10": got["top10"], "peak_rss_bytes_per_process":
                                       got["peak_rss_bytes_per_process"]})
            e["rounds"].append({k: got[k] for k in ("p50_s", "p95_s", "open_and_warm_s", "stage_seconds_p50")})
            e["rss_bytes_by_stage_per_process"] = got["rss_bytes_by_stage_per_process"]  # (the last round's)
            e["peak_rss_bytes_per_process"] = [max(a, b) for a, b in zip(e["peak_rss_bytes_per_process"],
                                                                         got["peak_rss_bytes_per_process"],
                                                                         strict=True)]
            assert got["top10"] == e["top10"], f"{name}: another top 10 in round {r + 1}"
    summarize(runs, qf)
    from gradindex.index.cost import sketch_candidates
    from gradindex.index.sharded import read_sharded
    from gradindex.query.sharded import part_candidates

    shd = read_sharded(sh)
    c = sketch_candidates(n)
    share = [part_candidates(c, p.stop - p.first, n, 10) for p in shd.parts]
    entry = {"examples": n, "parts": parts, "tier": "sketch", "threads_per_process": 1, "rounds": rounds,
             "queries": QUERIES, "load_average_at_each_round": load,
             "candidates": {"unsplit": c, "shared, per part": share,
                            "whole C a part, per part": [sketch_candidates(p.stop - p.first) for p in shd.parts]},
             "runs": runs, "measured": time.strftime("%Y-%m-%d"),
             "machine": f"{os.cpu_count()} cores, shared with other work while measured"}
    if label:
        entry["label"] = label
    report = json.loads(out.read_text()) if out.exists() else {"runs": []}
    key = (n, parts, label)
    report["runs"] = [r for r in report["runs"] if (r["examples"], r["parts"], r.get("label")) != key] + [entry]
    report["runs"].sort(key=lambda r: (r["examples"], r["parts"], r.get("measured", "")))
    report["what"] = __doc__.split("\n\n")[0].replace("\n", " ")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="*", default=[100000])
    ap.add_argument("--parts", type=int, nargs="*", default=[2])
    ap.add_argument("--work", type=Path, default=Path("/work/tmp/lookup"))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rounds", type=int, default=3, help="the three lookups this many times in turn")
    ap.add_argument("--label", help="names this run: it is kept beside earlier runs of the same N and P")
    ap.add_argument("--lookups", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--queries-file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--whole-candidates", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.lookups:
        return lookups(a.lookups, a.queries_file, a.result, a.whole_candidates)
    for n in a.n:
        for p in a.parts:
            run(n, p, a.work, a.out, a.rounds, a.label)


if __name__ == "__main__":
    main()
