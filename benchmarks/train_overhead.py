"""Per-step cost of capturing inside training: a plain training loop against the same loop with capture.

Two copies of the shared workload's model (benchmarks/README.md, "Shared workload": GPT-2, 4 layers,
width 256, vocab 8192, 128 positions, batch 8, one thread) train on the same batches with AdamW,
steps interleaved (the order flips every step) so machine noise hits both alike. One runs inside
:class:`gradindex.integrations.GradIndexCapture` (every block Conv1D hooked, projection 16x16, rows
written to the capture log each step); the assembly into the store at the end is timed apart and
also reported per step. The loop's HF mean loss is the one the Trainer uses. At the end the two
models' parameters are compared bit for bit.

    python -m benchmarks.train_overhead              # shared workload, 24 steps each (a minute or two)
    python -m benchmarks.train_overhead --quick      # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.common import Workload, make_model, make_sequences  # noqa: E402
from gradindex.data import collate  # noqa: E402
from gradindex.integrations import ROW_KEY, GradIndexCapture  # noqa: E402


def step(model, opt, batch: dict) -> float:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--projection", default="16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="Tiny sizes (a smoke test).")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "train_overhead.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = Workload(projection=args.projection)
    if args.quick:
        w = replace(w, layers=2, width=32, heads=2, vocab=256, seq_len=16)
    n_steps = args.steps + args.warmup
    seqs = make_sequences(w, n_steps * w.batch_size, w.seq_len)
    plain, captured = make_model(w, max(128, w.seq_len)), make_model(w, max(128, w.seq_len))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in (("plain", plain), ("capture", captured))}
    wall = {"plain": [], "capture": []}
    cpu = {"plain": [], "capture": []}
    with tempfile.TemporaryDirectory() as tmp:
        cap = GradIndexCapture(captured, Path(tmp) / "index", optimizer=opts["capture"], projection=w.projection,
                               num_rows=len(seqs))
        plain.train()
        captured.train()
        with cap:
            for i in range(n_steps):
                rows = list(range(i * w.batch_size, (i + 1) * w.batch_size))
                ids = [seqs[r] for r in rows]
                batch = collate(ids, ids, 0)
                order = ("plain", "capture") if i % 2 == 0 else ("capture", "plain")
                for name in order:
                    b = dict(batch, **({ROW_KEY: torch.tensor(rows)} if name == "capture" else {}))
                    t, c = time.perf_counter(), time.process_time()
                    step(plain if name == "plain" else captured, opts[name], b)
                    if i >= args.warmup:
                        wall[name].append(time.perf_counter() - t)
                        cpu[name].append(time.process_time() - c)
            t = time.perf_counter()
        assemble_s = time.perf_counter() - t  # the store and manifest are written on exit
        identical = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                          captured.state_dict().values()))
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    per_step_assembly = assemble_s / n_steps
    res = {
        "workload": asdict(w),
        "steps_timed": args.steps,
        "threads": args.threads,
        "median_step_s": med,
        "mean_step_s": {k: statistics.fmean(v) for k, v in wall.items()},
        "median_step_cpu_s": med_cpu,
        "overhead_median": med["capture"] / med["plain"] - 1,
        "overhead_median_cpu": med_cpu["capture"] / med_cpu["plain"] - 1,
        "assembly_s": assemble_s,
        "overhead_with_assembly": (med["capture"] + per_step_assembly) / med["plain"] - 1,
        "parameters_bit_identical": identical,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
    }
    print(f"per step (median of {args.steps}, interleaved): plain {med['plain'] * 1e3:.1f} ms, "
          f"with capture {med['capture'] * 1e3:.1f} ms -> overhead {res['overhead_median']:+.1%} "
          f"(CPU time {res['overhead_median_cpu']:+.1%}); store assembly {assemble_s:.2f} s at the end "
          f"({res['overhead_with_assembly']:+.1%} with it spread over the steps)")
    print(f"parameters bit-identical with and without capture: {identical}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
