"""The default lookup at growing N on real captured default rows: build seconds per stage, bytes, RAM,
recall@10 against the exhaustive default, first-stage recall, p50/p95 latency (issue 17, item 5).

Workload: ``benchmarks/lookup.py``'s (a trained GPT-2 2x32, vocab 1024, its 8 block layers hooked:
25,152 numbers per example; int4 rows in the EK-FAC whitened eigenbasis, 12.6 KiB per example), but
the training texts are :func:`windows` (distinct windows of 8-27 words of the standard-library
corpus, up to ~6x10^5 of them: ``lookup.windows`` gives at most ~1.2x10^5). Each N is built by
``build_index`` as ``gradindex build`` builds it (the fused fit + transcode, the default ``auto``
index), in its own process (``--build N``), timed per stage with ``benchmarks.buildcost``'s clock.

    python -m benchmarks.lookup_scale --build 200000 --work /work/tmp/lookup   # one build, resumable

Only the build step exists so far (``idx-N.build.json`` beside each index); the lookup measurement
(recall against a batched exact scan of the codes, latency one query at a time) is still to write.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = 20  # window lengths 8 .. 8 + LENGTHS - 1 words
SPARE = 12 << 30  # disk left to others while the fused transcode keeps its rotated copy


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def windows(n: int, n_queries: int) -> tuple[list[str], list[str], list[str]]:
    """(corpus documents, ``n`` distinct training windows, query windows of the held-out last 5%).
    Window ``i``: start ``s = i mod M``, length ``8 + (i // M + 7 s) mod 20`` words (every start
    takes all 20 lengths over the first 20 M windows; the queries are ``lookup.windows``')."""
    from benchmarks import lookup
    from fixtures.tiny import stdlib_corpus

    docs = stdlib_corpus()
    words = " ".join(docs).split()
    train = words[:int(len(words) * 0.95)]
    m = len(train) - 8 - LENGTHS
    if n > m * LENGTHS:
        raise ValueError(f"the corpus gives at most {m * LENGTHS} windows, asked for {n}")
    out, seen, i = [], set(), 0
    while len(out) < n and i < m * LENGTHS:
        s = i % m
        t = " ".join(train[s:s + 8 + (i // m + 7 * s) % LENGTHS])
        if t not in seen:
            seen.add(t)
            out.append(t)
        i += 1
    if len(out) < n:
        raise ValueError(f"the corpus gives {len(out)} distinct windows, asked for {n}")
    return docs, out, lookup.windows(10, n_queries)[2]


def _spare_copy() -> None:
    """The fused transcode keeps its rotated copy only where that leaves SPARE bytes to others."""
    from gradindex.precondition import fused

    keeps = fused.keeps_copy

    def keeps_with_spare(d, manifest, storage):
        dims = [int(v["rows"]) * int(v["cols"]) for v in manifest["build"]["layers"].values()]
        need = 2 * int(manifest["counts"]["examples"]) * sum(dims)
        ok = keeps(d, manifest, storage) and fused.free_bytes(d) - 1.1 * need > SPARE
        log(f"rotated copy kept: {ok}")
        return ok

    fused.keeps_copy = keeps_with_spare


def build(n: int, work: Path, steps: int) -> dict:
    """Build (or resume) ``work/idx-N``; its stage seconds, bytes and peak disk go to its ``bench-build.json``
    (a resumed build adds one entry per attempt)."""
    import resource

    import torch

    from benchmarks import lookup
    from benchmarks.buildcost import DiskPeak, Stages, _bytes
    from gradindex.capture import ProjectionSpec
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.index import IndexConfig
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig

    torch.set_num_threads(1)
    out = work / f"idx-{n}"
    stamp = out.parent / f"idx-{n}.build.json"
    done = json.loads(stamp.read_text()) if stamp.exists() else {"attempts": []}
    if done.get("complete"):
        return done
    docs, texts, _ = windows(n, 1)
    mdir = lookup.model_dir(work, docs, steps)
    model, tok = load_causal_lm(mdir, device="cpu")
    data = tokenize_records(records_from_texts(texts), tok, lookup.MAX_LENGTH)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                      transcode="ekfac", max_length=lookup.MAX_LENGTH, batch_size=32)
    _spare_copy()
    stages = Stages()
    stages.wrap()
    import gradindex.pipeline as pipeline

    log(f"N={n}: building {out}")
    t = time.perf_counter()
    with DiskPeak(out, stages) as disk:
        pipeline.build_index(model, tok, data, out, cfg, index=IndexConfig(), model_id=str(mdir), progress=True)
    done["attempts"].append({"seconds": round(time.perf_counter() - t, 2),
                             "stages": {k: round(v, 2) for k, v in stages.seconds.items()},
                             "stages_cpu": {k: round(v, 2) for k, v in stages.cpu.items()},
                             "peak_disk_bytes": disk.peak, "peak_disk_stage": disk.peak_stage,
                             "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                             "load_end": round(os.getloadavg()[0], 2)})
    done.update(complete=True, examples=n, store_bytes=_bytes(out / "store"), index_dir_bytes=_bytes(out))
    stamp.write_text(json.dumps(done, indent=1))
    log(f"N={n}: built, {json.dumps(done['attempts'][-1])}")
    return done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", type=int, nargs="*", default=[])
    ap.add_argument("--work", type=Path, default=Path("/work/tmp/lookup"))
    ap.add_argument("--train-steps", type=int, default=300)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    for n in a.build:
        build(n, a.work, a.train_steps)


if __name__ == "__main__":
    main()
