"""The default build against a bare forward + backward, per stage, before and after a change, in one run.

Peers workload (TARGETS.md): GPT-2 from a config (4 blocks, width 256, 4 heads, vocab 8192, 128
positions), 512 random sequences of 128 token ids (seed 0), batch 8, one thread. Each cell runs in
its own process, one after another, so that its peak RSS (``ru_maxrss``) is its own:

* ``floor``: a bare forward + backward of the same batches (benchmarks/capture.py's ``run_floor``);
* ``default``: ``build_index`` with the CLI's defaults (auto budget, int4 rows transcoded into the
  EK-FAC whitened eigenbasis, the default FAISS stage), with seconds per stage (capture, fit,
  transcode, FAISS), once with this checkout's gradindex (``after``) and once with ``--before``'s
  (another checkout, e.g. ``git archive BASE | tar -x -C /tmp/base``); with ``--also-ratio`` once more
  with ``--allocation ratio`` (each side ``k ∝`` its width: the split before the default ``cost``);
  each with the most bytes its index directory held at once (sampled every 0.1 s) over its final store,
  the most per stage, and what each entry of the directory held at that peak (``disk_at_peak``); the
  full-space fit of a budget-bound build is its own stage (``full_fit``, with its phases' seconds).

Then the same on a tiny model at a larger N (``--tiny-n`` examples of 16 tokens; GPT-2 2x48): the
stages after the capture divided by the capture. Writes ``benchmarks/results/buildcost.json``.

    python -m benchmarks.buildcost --before /tmp/base
    python -m benchmarks.buildcost --quick            # 32 sequences, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STAGES = {  # stage → (module, function) timed when present (the fused build has no transcode_in_place, ...)
    "capture": [("gradindex.pipeline", "build_store")],
    "fit_sample": [("gradindex.pipeline", "fit_on_sample")],
    "fit": [("gradindex.pipeline", "fit_preconditioner"), ("gradindex.precondition.fused", "store_fit")],
    "full_fit": [("gradindex.precondition.fit", "fit_full_space")],
    "transcode": [("gradindex.pipeline", "transcode_in_place"), ("gradindex.precondition.fused", "compact_rows")],
    "faiss": [("gradindex.pipeline", "build_indices")],
}
"""Seconds are exclusive: a stage called inside another (the full-space fit inside ``fit_preconditioner``)
counts for itself only."""


class Stages:
    """Exclusive wall seconds and process CPU seconds per stage, and the stage running now (for the disk
    sampler). CPU seconds (``time.process_time``: every thread of the process) are what other jobs on a
    shared machine disturb least."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.stack: list[str] = []
        self._originals: list[tuple] = []

    @property
    def now(self) -> str:
        return self.stack[-1] if self.stack else "other"

    def wrap(self) -> None:
        """Wrap each stage's function (where this gradindex has it) to add its exclusive seconds."""
        import importlib

        for stage, places in STAGES.items():
            for mod, name in places:
                try:
                    m = importlib.import_module(mod)
                except ImportError:
                    continue
                fn = getattr(m, name, None)
                if fn is not None:
                    self._originals.append((m, name, fn))
                    setattr(m, name, self._timed(fn, stage))

    def unwrap(self) -> None:
        """Put the wrapped functions back (a caller sharing the process, e.g. a test, sees them unchanged)."""
        while self._originals:
            m, name, fn = self._originals.pop()
            setattr(m, name, fn)

    def _timed(self, fn, stage: str):
        def wrapped(*a, **k):
            outer = self.now if self.stack else None
            t, c = time.perf_counter(), time.process_time()
            if outer is not None:  # pause the outer stage's clocks
                self.seconds[outer] = self.seconds.get(outer, 0.0) + t - self._since
                self.cpu[outer] = self.cpu.get(outer, 0.0) + c - self._cpu_since
            self.stack.append(stage)
            self._since, self._cpu_since = t, c
            try:
                return fn(*a, **k)
            finally:
                e, f = time.perf_counter(), time.process_time()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + e - self._since
                self.cpu[stage] = self.cpu.get(stage, 0.0) + f - self._cpu_since
                self.stack.pop()
                self._since, self._cpu_since = e, f

        return wrapped


def _bytes(d: Path) -> int:
    total = 0
    for p in Path(d).rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except FileNotFoundError:  # (moved or deleted while summed)
            pass
    return total


def _parts(d: Path) -> dict[str, int]:
    """Bytes per top-level entry of an index directory (``store``, ``rotated.partial``, ``precond``, ...)."""
    out: dict[str, int] = {}
    for p in Path(d).iterdir() if Path(d).is_dir() else []:
        try:
            out[p.name] = _bytes(p) if p.is_dir() else p.stat().st_size
        except FileNotFoundError:
            pass
    return out


def _rss() -> int:
    """This process's resident bytes now (Linux ``VmRSS``; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class DiskPeak:
    """The most bytes under a directory while the block runs, summed every 0.1 s by a thread; with
    ``stages``, also the most per stage and what the directory held (per entry) at the overall peak, and
    the process's most resident bytes per stage (sampled alike: a peak shorter than 0.1 s may be missed)."""

    def __init__(self, d: Path, stages: Stages | None = None):
        import threading

        self.d, self.peak, self._stop, self.stages = d, 0, threading.Event(), stages
        self.by_stage: dict[str, int] = {}
        self.rss_by_stage: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self.peak_stage = ""
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> None:
        stage = self.stages.now if self.stages is not None else "other"
        parts = _parts(self.d)
        total = sum(parts.values())
        self.by_stage[stage] = max(self.by_stage.get(stage, 0), total)
        self.rss_by_stage[stage] = max(self.rss_by_stage.get(stage, 0), _rss())
        if total > self.peak:
            self.peak, self.at_peak, self.peak_stage = total, parts, stage

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def child(cell: str, n: int, tokens: int, width: int, blocks: int, vocab: int, root: Path,
          allocation: str = "", fit_sample: int | None = None) -> dict:
    """One cell in this process: ``floor`` or ``default``; seconds (per stage) and peak RSS."""
    if root != ROOT:
        sys.path.insert(0, str(root))
    from types import SimpleNamespace

    import torch

    from fixtures.tiny import tiny_gpt2

    torch.set_num_threads(1)
    model = tiny_gpt2(vocab_size=vocab, n_layer=blocks, n_embd=width, n_head=4, n_positions=max(tokens, 16), seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(vocab, (n, tokens), generator=g).tolist()
    out: dict = {"cell": cell, "gradindex": str(root)}
    t, c = time.perf_counter(), time.process_time()
    if cell == "floor":
        from gradindex.data import collate

        model.requires_grad_(True)
        for s in range(0, n, 8):
            b = collate(seqs[s:s + 8], seqs[s:s + 8], 0)
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                  use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        from gradindex.capture import ProjectionSpec
        from gradindex.data import Tokenized
        from gradindex.index import IndexConfig
        from gradindex.pipeline import BuildConfig

        stages = Stages()
        stages.wrap()
        data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
        cfg = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                          transcode="ekfac", max_length=tokens, batch_size=8,
                          **({"allocation": allocation} if allocation else {}),
                          **({"fit_sample": fit_sample} if fit_sample is not None else {}))
        out["allocation"] = allocation or "default"
        out["fit_sample"] = cfg.fit_sample
        with tempfile.TemporaryDirectory(prefix="gradindex-buildcost-", dir=os.environ.get("BUILDCOST_TMP")) as d:
            import gradindex.pipeline as pipeline

            with DiskPeak(Path(d) / "idx", stages) as disk:
                pipeline.build_index(model, SimpleNamespace(pad_token_id=0), data, Path(d) / "idx", cfg,
                                     index=IndexConfig(), progress=False)
            out["index_bytes"] = _bytes(Path(d) / "idx")
            out["store_bytes"] = _bytes(Path(d) / "idx" / "store")
            out["peak_disk_bytes"] = disk.peak
            out["peak_disk_over_store"] = round(disk.peak / out["store_bytes"], 3)
            out["peak_disk_stage"] = disk.peak_stage
            out["disk_at_peak"] = disk.at_peak
            out["peak_disk_by_stage_over_store"] = {k: round(v / out["store_bytes"], 3)
                                                    for k, v in disk.by_stage.items()}
            out["peak_rss_mb_by_stage"] = {k: round(v / 2 ** 20, 1) for k, v in disk.rss_by_stage.items()}
            full = json.loads((Path(d) / "idx" / "manifest.json").read_text()).get("full_space", {})
            if full:
                fit = next(iter(full.values()))["fit"]
                out["full_fit"] = {"examples": fit["examples"], "source": fit.get("source"),
                                   "correction_examples": fit.get("correction_examples", fit["examples"]),
                                   "phase_seconds": fit.get("phase_seconds")}
        out["stages"] = {k: round(v, 2) for k, v in stages.seconds.items()}
        out["stages_cpu"] = {k: round(v, 2) for k, v in stages.cpu.items()}
    out["seconds"] = round(time.perf_counter() - t, 2)
    out["cpu_seconds"] = round(time.process_time() - c, 2)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def run(cell: str, n: int, tokens: int, width: int, blocks: int, vocab: int, root: Path,
        allocation: str = "", fit_sample: int | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "benchmarks.buildcost", "--child", cell, "--n", str(n), "--tokens", str(tokens),
            "--width", str(width), "--blocks", str(blocks), "--vocab", str(vocab), "--root", str(root),
            *(["--allocation", allocation] if allocation else []),
            *(["--fit-sample", str(fit_sample)] if fit_sample is not None else [])]
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{cell} ({root}) failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(res), flush=True)
    return res


def ratios(floor: dict, build: dict) -> dict:
    st = build["stages"]
    after_capture = sum(v for k, v in st.items() if k != "capture")
    cpu, fcpu = build.get("stages_cpu", {}), floor.get("cpu_seconds")
    by_cpu = {} if not cpu or not fcpu else {"cpu": {
        "x_floor": round(build["cpu_seconds"] / fcpu, 3),
        "capture_x_floor": round(cpu["capture"] / fcpu, 3),
        "full_fit_x_floor": round(cpu.get("full_fit", 0.0) / fcpu, 3),
        "after_capture_over_capture": round(sum(v for k, v in cpu.items() if k != "capture") / cpu["capture"], 3)}}
    return {**by_cpu,"x_floor": round(build["seconds"] / floor["seconds"], 3),
            "x_floor_without_faiss": round((build["seconds"] - st.get("faiss", 0.0)) / floor["seconds"], 3),
            "capture_x_floor": round(st["capture"] / floor["seconds"], 3),
            "full_fit_x_floor": round(st.get("full_fit", 0.0) / floor["seconds"], 3),
            "after_capture_over_capture": round(after_capture / st["capture"], 3),
            "after_capture_without_faiss_over_capture":
                round((after_capture - st.get("faiss", 0.0)) / st["capture"], 3),
            "rss_x_floor": round(build["peak_rss_mb"] / floor["peak_rss_mb"], 3),
            "peak_disk_over_store": build.get("peak_disk_over_store")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, help="another checkout's root: its gradindex is the 'before' cell")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny-n", type=int, default=3000, help="0: no tiny-model cells")
    ap.add_argument("--out", type=Path, default=RESULTS / "buildcost.json")
    ap.add_argument("--child")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--allocation", default="")
    ap.add_argument("--keep-as", default="", help="keep the --out file's earlier content under this key")
    ap.add_argument("--fit-sample", type=int, help="the builds' fit_sample (default: the library's)")
    ap.add_argument("--also-fused", action="store_true",
                    help="another build cell with fit_sample 0 (the fused fit over every example)")
    ap.add_argument("--also-ratio", action="store_true",
                    help="a third build cell: this checkout with --allocation ratio (the split before 'cost')")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.n, a.tokens, a.width, a.blocks, a.vocab, a.root, a.allocation,
                               a.fit_sample)))
        return {}
    n = 32 if a.quick else a.n
    roots = {"after": ROOT, **({"before": a.before} if a.before else {})}
    load = os.getloadavg()[0]
    peers = {"floor": run("floor", n, a.tokens, a.width, a.blocks, a.vocab, ROOT)}
    for name, root in roots.items():
        peers[name] = run("default", n, a.tokens, a.width, a.blocks, a.vocab, root, fit_sample=a.fit_sample)
    if a.also_fused:
        peers["after_fused"] = run("default", n, a.tokens, a.width, a.blocks, a.vocab, ROOT, fit_sample=0)
    if a.also_ratio:
        peers["after_ratio"] = run("default", n, a.tokens, a.width, a.blocks, a.vocab, ROOT, "ratio")
    peers["floor_again"] = run("floor", n, a.tokens, a.width, a.blocks, a.vocab, ROOT)
    floor = {"seconds": (peers["floor"]["seconds"] + peers["floor_again"]["seconds"]) / 2,
             **({"cpu_seconds": (peers["floor"]["cpu_seconds"] + peers["floor_again"]["cpu_seconds"]) / 2}
                if "cpu_seconds" in peers["floor"] else {}),
             "peak_rss_mb": max(peers["floor"]["peak_rss_mb"], peers["floor_again"]["peak_rss_mb"])}
    tiny_n = 200 if a.quick else a.tiny_n
    tiny = {name: run("default", tiny_n, 16, 48, 2, 256, root) for name, root in roots.items()} if tiny_n else {}
    res = {
        "workload": {"peers": f"GPT-2 {a.blocks}x{a.width}, vocab {a.vocab}, {n} x {a.tokens} random tokens, batch 8",
                     **({"tiny": f"GPT-2 2x48, vocab 256, {tiny_n} x 16 random tokens, batch 8"} if tiny_n else {}),
                     "build": "build_index with the CLI defaults (auto budget, int4 EK-FAC eigenbasis rows, "
                              "default FAISS stage); one thread; each cell its own process"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": round(load, 2),
                    "load_after": round(os.getloadavg()[0], 2)},
        "peers": peers, "floor": floor,
        "ratios": {name: ratios(floor, peers[name]) for name in [*roots, *(["after_ratio"] if a.also_ratio else []),
                                                                   *(["after_fused"] if a.also_fused else [])]},
        "tiny": tiny,
        "tiny_after_capture_over_capture": {
            name: round(sum(v for k, v in t["stages"].items() if k != "capture") / t["stages"]["capture"], 3)
            for name, t in tiny.items()},
    }
    print(json.dumps(res["ratios"], indent=1), json.dumps(res["tiny_after_capture_over_capture"]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.keep_as and a.out.exists():
        old = json.loads(a.out.read_text())
        res[a.keep_as] = old[a.keep_as] if a.keep_as in old else old
    a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
