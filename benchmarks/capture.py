"""Capture throughput on the shared workload, side by side in one run, and the routing sweep.

Measured, on the same batches and in one process so that machine noise hits all alike:

* floor: a bare forward + backward (weight gradients, mean loss), nothing captured;
* build: :func:`gradindex.store.builder.build_store` end to end into an HDF5 store in a temp dir;
* capture: the in-memory :func:`gradindex.capture.batch.batch_gradients` loop alone;
* naive: ``torch.func`` ``vmap(grad(loss))`` over examples, then ``P_g G P_aᵀ`` per layer;
* threads: the build (and the floor) with two threads against one;
* sweep: sequence length x projection size, the routed capture against each forced route, both
  end to end and for the per-layer routed math alone, with the cost model's choice per layer.

Each method runs ``--rounds`` times in turn; a method's figure is its fastest round. Prints tables
and writes JSON (default ``benchmarks/results/capture.json``). ``--quick`` is a smoke test.

    python -m benchmarks.capture                  # the shared workload (several minutes)
    python -m benchmarks.capture --quick          # tiny sizes, under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.common import Workload, make_model, make_sequences  # noqa: E402
from gradindex.capture import (  # noqa: E402
    GradientCapture,
    ProjectedRows,
    ProjectionSpec,
    RowSpace,
    Visitor,
    choose_route,
    projection_matrix,
)
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.data import Tokenized, collate, per_example_loss  # noqa: E402
from gradindex.store.builder import BuildConfig, build_store  # noqa: E402

ROUTES = ("auto", "factorized", "materialized")


def batches(seqs: list[list[int]], B: int) -> Iterator[list[list[int]]]:
    for s in range(0, len(seqs), B):
        yield seqs[s:s + B]


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def timed(fn: Callable[..., object], *args: object, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds ``fn(*args)`` takes on ``clock`` (wall by default; ``time.process_time`` for CPU)."""
    t = clock()
    fn(*args)
    return clock() - t


# -- the methods -------------------------------------------------------------------------------


def run_floor(model: nn.Module, seqs: list[list[int]], B: int) -> None:
    """Bare forward + backward: mean loss, weight gradients, zero_grad each step."""
    model.requires_grad_(True)
    for ids in [collate(b, b, 0) for b in batches(seqs, B)]:
        out = model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], labels=ids["labels"],
                    use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)


def run_build(model: nn.Module, seqs: list[list[int]], w: Workload) -> dict:
    """``build_store`` end to end into a temporary index directory; returns the manifest's routes."""
    data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse(w.projection), max_length=w.seq_len,
                      batch_size=w.batch_size)
    tokenizer = SimpleNamespace(pad_token_id=0)
    with tempfile.TemporaryDirectory(prefix="gradindex-bench-") as d:
        res = build_store(model, tokenizer, data, Path(d) / "index", cfg, progress=False)
    return res.manifest.get("routes", {})


def run_capture(model: nn.Module, seqs: list[list[int]], w: Workload, route: str = "auto") -> None:
    """The in-memory capture loop alone (what a build does, minus the store)."""
    model.requires_grad_(False)
    with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec.parse(w.projection)), route)) as cap:
        for b in batches(seqs, w.batch_size):
            batch_gradients(model, cap, b, b, 0)


def run_naive(model: nn.Module, seqs: list[list[int]], w: Workload) -> None:
    """``torch.func``: vmap over examples of grad of the summed loss, then ``P_g G P_aᵀ`` per layer."""
    from torch.func import functional_call, grad, vmap

    model.requires_grad_(False)
    spec = ProjectionSpec.parse(w.projection)
    cap = GradientCapture(model)  # only for layer selection and shapes
    params = {f"{n}.{k}": p.detach() for n, m in cap.modules.items() for k, p in m.named_parameters()}
    proj = {}
    if not spec.is_identity:
        proj = {n: (projection_matrix(spec, n, "a", i.n_in_total), projection_matrix(spec, n, "g", i.n_out))
                for n, i in cap.infos.items()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (x.unsqueeze(0),), {"use_cache": False}).logits
        return per_example_loss(logits, x.unsqueeze(0))[0].sum()

    per_example = vmap(grad(loss), in_dims=(None, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no batching rule for SDPA": that is the baseline
        for b in batches(seqs, w.batch_size):
            g = per_example(params, torch.tensor(b))
            for n, info in cap.infos.items():
                G = info.weight_grad_to_G(g[n + ".weight"], g.get(n + ".bias"))  # [B, N_o, N_i+1]
                if n in proj:
                    P_a, P_g = proj[n]
                    G = P_g @ G @ P_a.T  # [B, k_g, k_a]
                G.reshape(G.shape[0], -1)


# -- the comparison ----------------------------------------------------------------------------


def compare(w: Workload, rounds: int, two_threads: bool) -> dict:
    """Every method, ``rounds`` times in turn on one thread (then the floor and the build on two)."""
    model = make_model(w, max(128, w.seq_len))
    seqs = make_sequences(w, w.sequences, w.seq_len)
    warm = seqs[: 2 * w.batch_size]
    methods: dict[str, Callable[[list[list[int]]], object]] = {
        "floor": lambda s: run_floor(model, s, w.batch_size),
        "build": lambda s: run_build(model, s, w),
        "capture": lambda s: run_capture(model, s, w),
        "naive_torch_func": lambda s: run_naive(model, s, w),
    }
    plan = [(k, 1) for k in methods] + ([("floor", 2), ("build", 2)] if two_threads else [])
    times: dict[tuple[str, int], list[float]] = {key: [] for key in plan}
    cpu: dict[tuple[str, int], list[float]] = {key: [] for key in plan}
    for k, n in plan:  # warm-up: allocator, kernels, projection matrices, thread pools
        with threads(n):
            methods[k](warm)
    for r in range(rounds):  # 1- and 2-thread runs interleaved, so that noise hits both alike
        for k, n in plan:
            with threads(n):
                c0 = time.process_time()
                times[k, n].append(timed(methods[k], seqs))
                cpu[k, n].append(time.process_time() - c0)
            print(f"  round {r + 1}/{rounds} {k:<17} {n} thread(s) {times[k, n][-1]:7.2f} s  "
                  f"(cpu {cpu[k, n][-1]:7.2f} s)", flush=True)
    one = {k: times[k, 1] for k in methods}
    best = {k: min(v) for k, v in one.items()}
    best_cpu = {k: min(cpu[k, 1]) for k in methods}
    out = {
        "seconds": one,
        "cpu_seconds": {k: cpu[k, 1] for k in methods},
        "best_seconds": best,
        "sequences_per_s": {k: w.sequences / v for k, v in best.items()},
        "ratio_to_floor": {k: v / best["floor"] for k, v in best.items()},
        "ratio_to_floor_per_round": {k: [t / f for t, f in zip(v, one["floor"], strict=True)]
                                     for k, v in one.items()},
        "cpu_ratio_to_floor": {k: v / best_cpu["floor"] for k, v in best_cpu.items()},
    }
    if two_threads:
        t2 = {k: times[k, 2] for k in ("floor", "build")}
        b2 = {k: min(v) for k, v in t2.items()}
        out["two_threads"] = {
            "seconds": t2,
            "best_seconds": b2,
            "sequences_per_s": {k: w.sequences / v for k, v in b2.items()},
            "speedup": {k: best[k] / v for k, v in b2.items()},
            "build_ratio_to_floor": b2["build"] / b2["floor"],
        }
    return out


# -- the routing sweep -------------------------------------------------------------------------


class _Recorder(Visitor):
    """Keeps each layer's call of the last batch instead of reducing it."""

    def __init__(self) -> None:
        self.recorded = {}

    def visit(self, call) -> None:
        self.recorded[call.name] = call


def _gradient(projected: ProjectedRows, call, route: str) -> torch.Tensor:
    call.cache.clear()  # (each timed run maps the tokens again)
    return projected.gradient(call, route)


def route_math(model: nn.Module, batch: list[list[int]], spec: ProjectionSpec, reps: int) -> dict:
    """Per layer: CPU seconds of each fixed route's math on one batch, and the cost model's choice."""
    rec, projected = _Recorder(), ProjectedRows(RowSpace(spec))
    with GradientCapture(model, None, rec) as cap:
        batch_gradients(model, cap, batch, batch, 0)
    projected.bind(cap)
    rows = {}
    for name, call in rec.recorded.items():
        info = call.info
        B, T = call.a.shape[0], call.a.shape[1]
        secs = {}
        for route in ("factorized", "materialized"):
            projected.gradient(call, route)  # warm
            secs[route] = min(timed(_gradient, projected, call, route, clock=time.process_time) for _ in range(reps))
        pick = choose_route(B, T, info.n_in_total, info.n_out, spec.k_a, spec.k_g)
        rows[name] = {"seconds": secs, "choice": pick, "faster": min(secs, key=secs.get),
                      "shape": [B, T, info.n_in_total, info.n_out]}
    return rows


def sweep(w: Workload, lengths: list[int], projections: list[str], tokens: int, reps: int) -> list[dict]:
    model = make_model(w, max(lengths))
    model.requires_grad_(False)
    out = []
    with threads(1):
        for T in lengths:
            n = max(w.batch_size, tokens // T)
            seqs = make_sequences(w, n, T)
            for proj in projections:
                spec = ProjectionSpec.parse(proj)
                rows_of = {r: ProjectedRows(RowSpace(spec), r) for r in ROUTES}
                caps = {r: GradientCapture(model, None, rows_of[r]) for r in ROUTES}
                warm = [s[:16] for s in seqs[: w.batch_size]]  # projections, kernels
                secs = dict.fromkeys(ROUTES, 0.0)
                cpu = dict.fromkeys(ROUTES, 0.0)
                for i, b in enumerate([warm, *batches(seqs, w.batch_size)]):
                    for r in ROUTES:  # interleaved per batch: noise hits each route alike
                        with caps[r]:
                            c0, t0 = time.process_time(), time.perf_counter()
                            batch_gradients(model, caps[r], b, b, 0)
                        if i > 0:
                            secs[r] += time.perf_counter() - t0
                            cpu[r] += time.process_time() - c0
                    if i == 0:
                        for v in rows_of.values():
                            v.route_counts.clear()
                math = route_math(model, seqs[: w.batch_size], spec, reps)
                fact = sum(v["seconds"]["factorized"] for v in math.values())
                mat = sum(v["seconds"]["materialized"] for v in math.values())
                auto = sum(v["seconds"][v["choice"]] for v in math.values())
                best = sum(min(v["seconds"].values()) for v in math.values())
                wrong = [k for k, v in math.items() if v["choice"] != v["faster"]]
                row = {
                    "seq_len": T, "projection": proj, "sequences": n,
                    "capture_seq_per_s": {r: n / secs[r] for r in ROUTES},
                    "capture_seq_per_cpu_s": {r: n / cpu[r] for r in ROUTES},
                    "routes_chosen": dict(rows_of["auto"].route_counts),
                    "math_ms": {"auto": 1e3 * auto, "factorized": 1e3 * fact, "materialized": 1e3 * mat,
                                "best_per_layer": 1e3 * best},
                    "auto_over_best": auto / best,
                    "layers_misrouted": wrong,
                    "layers": math,
                }
                out.append(row)
                print(_sweep_line(row), flush=True)
    return out


# -- printing ----------------------------------------------------------------------------------


SWEEP_HEADER = (f"  {'T':>5} {'k':<8}| {'seq per cpu-s: auto':>19} {'fact':>7} {'mat':>7} | "
                f"{'math ms: auto':>13} {'fact':>8} {'mat':>8} {'best':>8} {'auto/best':>9} | routes chosen")


def _sweep_line(r: dict) -> str:
    c, m = r["capture_seq_per_cpu_s"], r["math_ms"]
    chosen = " ".join(f"{k[:3]}:{v}" for k, v in sorted(r["routes_chosen"].items()))
    return (f"  {r['seq_len']:>5} {r['projection']:<8}| {c['auto']:19.2f} {c['factorized']:7.2f} "
            f"{c['materialized']:7.2f} | {m['auto']:13.2f} {m['factorized']:8.2f} {m['materialized']:8.2f} "
            f"{m['best_per_layer']:8.2f} {r['auto_over_best']:9.3f} | {chosen}"
            + (f" (misrouted: {len(r['layers_misrouted'])})" if r["layers_misrouted"] else ""))


def print_summary(w: Workload, res: dict) -> None:
    c = res["compare"]
    print(f"\nshared workload: {w.sequences} x {w.seq_len} tokens, batch {w.batch_size}, projection "
          f"{w.projection}, 1 thread (fastest of {len(c['seconds']['floor'])} rounds)")
    print(f"  {'method':<18}{'seconds':>9}{'seq/s':>9}{'x floor':>9}{'cpu x floor':>13}")
    for k, t in c["best_seconds"].items():
        print(f"  {k:<18}{t:9.2f}{c['sequences_per_s'][k]:9.2f}{c['ratio_to_floor'][k]:9.3f}"
              f"{c['cpu_ratio_to_floor'][k]:13.3f}")
    if "two_threads" in c:
        t2 = c["two_threads"]
        print(f"  2 threads: build {t2['best_seconds']['build']:.2f} s ({t2['speedup']['build']:.2f}x one "
              f"thread), floor {t2['best_seconds']['floor']:.2f} s ({t2['speedup']['floor']:.2f}x); build/floor "
              f"{t2['build_ratio_to_floor']:.3f}")
    for k, v in res["targets"].items():
        print(f"  target {k}: {'met' if v else 'NOT met'}")


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Workload()
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test in well under a minute")
    p.add_argument("--threads", type=int, default=1, help="threads of the main comparison")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--sequences", type=int, default=d.sequences)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--projection", default=d.projection)
    p.add_argument("--rounds", type=int, default=2, help="turns of every method; the fastest counts")
    p.add_argument("--no-two-threads", dest="two_threads", action="store_false")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--no-compare", dest="compare", action="store_false")
    p.add_argument("--sweep-lengths", default="32,64,128,256,512,1024")
    p.add_argument("--sweep-projections", default="16x16,256x256")
    p.add_argument("--sweep-tokens", type=int, default=4096,
                   help="tokens per (length, projection, route); at least one batch")
    p.add_argument("--sweep-reps", type=int, default=5, help="repeats of each layer's route math")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "capture.json"))
    args = p.parse_args(argv)
    if args.quick:
        defaults = {"layers": 2, "width": 64, "vocab": 512, "seq_len": 32, "sequences": 32, "rounds": 1,
                    "sweep_lengths": "16,64,256", "sweep_projections": "8x8,64x64", "sweep_tokens": 512,
                    "sweep_reps": 2}
        for k, v in defaults.items():  # --quick sets the sizes the user did not give
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    w = Workload(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab,
                 seq_len=args.seq_len, sequences=args.sequences, batch_size=args.batch_size,
                 projection=args.projection)
    res: dict = {
        "workload": asdict(w),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "platform": platform.platform(), "threads": args.threads,
                    "loadavg_before": list(os.getloadavg())},
        "quick": args.quick,
    }
    if args.compare:
        with threads(args.threads):
            res["compare"] = compare(w, args.rounds, args.two_threads)
        c = res["compare"]
        res["targets"] = {"build <= 1.15x floor": c["ratio_to_floor"]["build"] <= 1.15}
        if "two_threads" in c:
            res["targets"]["2 threads >= 1.7x 1 thread (build)"] = c["two_threads"]["speedup"]["build"] >= 1.7
        print_summary(w, res)
    if args.sweep:
        print("\nrouting sweep (1 thread): capture sequences per CPU second per route, end to end; "
              "routed math (sum over layers, CPU ms) on one batch")
        print(SWEEP_HEADER)
        lengths = [int(x) for x in args.sweep_lengths.split(",")]
        projections = args.sweep_projections.split(",")
        res["sweep"] = sweep(replace(w, seq_len=max(lengths)), lengths, projections, args.sweep_tokens,
                             args.sweep_reps)
    res["machine"]["loadavg_after"] = list(os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
    return res


if __name__ == "__main__":
    main()
