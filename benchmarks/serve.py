"""Load test of ``gradindex serve``: latency, throughput and batch size under 1..32 concurrent clients,
and the overload answers (503 when the queue is full, 504 past the request time limit).

Index: GPT-2 from a config (2 blocks, width 128, vocab 2048, 128 positions; untrained: a query's
cost does not depend on the weights), ``gradindex build --projection 16`` (8 layers x 256 numbers;
the other options default: EK-FAC, rows in its eigenbasis as int4, exhaustive search) over the first
``--examples`` paragraphs of the standard library's docstrings (``fixtures.tiny.stdlib_corpus``);
about 15 s. (The default ``--projection auto`` keeps 1/8 of this model's full gradients, ~190 KB
a row: a query then costs ~2 s of search and the load test measures the scan, not the server.)
Queries: the other paragraphs, ``k = 10``, the default method (ekfac).

The server runs as a subprocess (``python -m gradindex.cli serve``, loopback, a free port, one
torch/OpenMP thread); closed-loop clients (threads, one ``httpx.Client`` each: a client sends its
next query when the last is answered) run for ``--seconds`` at each concurrency. Reported per
phase: p50/p95 latency (client side), throughput (answered queries/s), the mean batch (queries per
engine call, from ``/health``), and failed (not 200) and hung (no answer within the client's
limit) requests, which must be 0. Then, with ``--max-batch 1``, the same load answered one query
at a time (the old server's behaviour), for the gain of batching. Overload: a burst of
``--burst`` simultaneous queries at a server with ``--queue-size 4`` (503s, each with
``Retry-After``), and at one with a ``--request-timeout`` of 3 single-query latencies (504s);
each server must still answer a query afterwards (within 10 tries: with so tight a limit a lone
query may 504 too on a loaded machine).

    python -m benchmarks.serve                 # ~4 min on 2 shared cores; writes results/serve.json
    python -m benchmarks.serve --seconds 3     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_index(work: Path, examples: int) -> tuple[Path, list[str], float]:
    """Build the index with the CLI's defaults; returns it, the query texts and the build seconds."""
    from click.testing import CliRunner

    from fixtures.tiny import save_model_dir, stdlib_corpus, tiny_gpt2, train_tokenizer
    from gradindex.cli import main

    docs = stdlib_corpus()
    train, queries = docs[:examples], docs[examples:]
    tok = train_tokenizer(train, vocab_size=2048)
    model_dir = save_model_dir(tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=128, n_head=4, n_positions=128),
                               tok, work / "model")
    (work / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    t0 = time.perf_counter()
    res = CliRunner().invoke(main, ["build", str(model_dir), str(work / "train.jsonl"), "--out", str(work / "idx"),
                                    "--device", "cpu", "--max-length", "128", "--projection", "16", "--quiet"])
    if res.exit_code != 0:
        raise SystemExit(f"build failed: {res.output}")
    return work / "idx", queries, time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gradindex serve IDX`` in a subprocess on a free loopback port."""

    def __init__(self, index: Path, *options: str):
        self.base = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "gradindex.cli", "serve", str(index), "--device", "cpu",
                                      "--cpu-index", "--port", self.base.rsplit(":", 1)[1], *options],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(self.base + "/health", timeout=2).raise_for_status()
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise SystemExit(f"the server did not come up: {self.proc.stdout.read()}") from None
                time.sleep(0.25)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def query_body(queries: list[str], i: int) -> dict:
    return {"text": queries[i % len(queries)], "k": 10}


def load(server: Server, queries: list[str], clients: int, seconds: float, limit: float) -> dict:
    """``clients`` closed-loop clients for ``seconds``; latencies of the answered queries, failures."""
    before = server.health()["served"]
    lat: list[float] = []
    codes: dict[str, int] = {}
    lock = threading.Lock()
    https = [httpx.Client(base_url=server.base, timeout=limit) for _ in range(clients)]  # made before the clock
    stop = time.monotonic() + seconds

    def client(c: int) -> None:
        i = c * 7919
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                r = https[c].post("/query", json=query_body(queries, i))
                code = str(r.status_code)
            except httpx.TimeoutException:
                code = "hung"
            except httpx.HTTPError as e:
                code = type(e).__name__
            dt = time.perf_counter() - t0
            with lock:
                codes[code] = codes.get(code, 0) + 1
                if code == "200":
                    lat.append(dt)
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for h in https:
        h.close()
    after = server.health()["served"]
    batches, served = after["batches"] - before["batches"], after["queries"] - before["queries"]
    lat.sort()
    return {"clients": clients, "seconds": round(wall, 2), "answered": len(lat),
            "failed": sum(n for c, n in codes.items() if c not in ("200", "hung")), "hung": codes.get("hung", 0),
            "codes": codes, "p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
            "p95_ms": round(1000 * lat[min(len(lat) - 1, int(0.95 * len(lat)))], 1) if lat else None,
            "throughput_qps": round(len(lat) / wall, 2), "batches": batches,
            "mean_batch": round(served / batches, 2) if batches else None}


def burst(server: Server, queries: list[str], n: int, limit: float) -> dict:
    """``n`` queries sent at once (threads behind a barrier); their status codes, then one more query."""
    codes: dict[str, int] = {}
    retry_after: set[str] = set()
    lock = threading.Lock()
    gate = threading.Barrier(n)

    def one(i: int) -> None:
        with httpx.Client(base_url=server.base, timeout=limit) as http:
            gate.wait()
            try:
                r = http.post("/query", json=query_body(queries, i))
                code = str(r.status_code)
                if r.status_code == 503:
                    retry_after.add(r.headers.get("retry-after", "missing"))
            except httpx.TimeoutException:
                code = "hung"
            except httpx.HTTPError as e:
                code = type(e).__name__
            with lock:
                codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + limit  # the worker finishes the batch it started (its clients are gone)
    while (q := server.health()["queue"])["depth"] + q["answering"] and time.monotonic() < deadline:
        time.sleep(0.05)
    tries = []  # a tiny --request-timeout may 504 a lone query on a loaded machine too: a few tries
    while len(tries) < 10 and (not tries or tries[-1] != 200):
        r = httpx.post(server.base + "/query", json=query_body(queries, len(tries)), timeout=limit)
        tries.append(r.status_code)
    return {"sent": n, "codes": codes, "retry_after": sorted(retry_after), "answers_after": tries[-1],
            "tries_after": tries, "served": server.health()["served"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=800, help="Training paragraphs indexed.")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=15.0, help="Duration of each load phase.")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--work", default=None, help="Build the index here and reuse it when it is there (default: a "
                    "temp dir).")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    args = ap.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    limit = 60.0  # the client's limit: past it a request counts as hung (the server's own limit is 30 s)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        if (work / "queries.json").exists():
            index, queries, build_s = work / "idx", json.loads((work / "queries.json").read_text()), None
        else:
            log(f"building the index ({args.examples} examples) ...")
            work.mkdir(parents=True, exist_ok=True)
            index, queries, build_s = make_index(work, args.examples)
            (work / "queries.json").write_text(json.dumps(queries))
        log(f"index {'reused' if build_s is None else f'built in {build_s:.1f} s'}; {len(queries)} query texts")
        phases = {}
        for name, options in (("batched", []), ("one at a time", ["--max-batch", "1"])):
            server = Server(index, *options)
            try:
                for c in args.clients if name == "batched" else [c for c in args.clients if c > 1]:
                    log(f"{name}: {c} clients for {args.seconds:g} s ...")
                    phases.setdefault(name, []).append(load(server, queries, c, args.seconds, limit))
            finally:
                server.close()
        p50 = phases["batched"][0]["p50_ms"] / 1000
        log(f"503: a burst of {args.burst} at --queue-size 4 ...")
        server = Server(index, "--queue-size", "4")
        try:
            full = burst(server, queries, args.burst, limit)
        finally:
            server.close()
        timeout = round(max(0.05, 3 * p50), 3)
        log(f"504: a burst of {args.burst} at --request-timeout {timeout:g} ...")
        server = Server(index, "--request-timeout", str(timeout))
        try:
            late = burst(server, queries, args.burst, limit)
        finally:
            server.close()
    out = {"machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_average_at_start": load_at_start,
                       "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
           "index": {"examples": args.examples, "model": "GPT-2 2x128, vocab 2048, 128 positions (untrained)",
                     "build": "gradindex build --projection 16, other options default (ekfac, eigenbasis int4, "
                              "exhaustive)", "build_s": build_s and round(build_s, 1)},
           "server": {"defaults": "--max-batch 16 --batch-window 0.002 --queue-size 64 --request-timeout 30",
                      "threads": 1},
           "query": "a held-out stdlib paragraph, k=10, method ekfac (the default)",
           "phases": phases, "overload_503": {"queue_size": 4, **full},
           "overload_504": {"request_timeout_s": timeout, **late}}
    print(f"\n{'server':<15}{'clients':>8}{'p50 ms':>9}{'p95 ms':>9}{'q/s':>8}{'batch':>7}{'failed':>8}{'hung':>6}")
    for name, rows in phases.items():
        for r in rows:
            print(f"{name:<15}{r['clients']:>8}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}{r['throughput_qps']:>8.1f}"
                  f"{r['mean_batch'] or 0:>7.2f}{r['failed']:>8}{r['hung']:>6}")
    for name, b in (("503 burst", full), ("504 burst", late)):
        print(f"{name}: {b['sent']} sent -> {b['codes']}; Retry-After {b['retry_after']}; "
              f"queries afterwards: {b['tries_after']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {args.out}")
    ok = (all(r["failed"] == 0 and r["hung"] == 0 for rows in phases.values() for r in rows)
          and full["codes"].get("503", 0) > 0 and late["codes"].get("504", 0) > 0
          and set(full["codes"]) <= {"200", "503"} and set(late["codes"]) <= {"200", "504"}
          and full["answers_after"] == late["answers_after"] == 200)
    if not ok:
        raise SystemExit("FAILED: a failed or hung request, a missing 503/504, or no answer after an overload")


if __name__ == "__main__":
    main()
