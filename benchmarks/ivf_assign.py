"""The ivf-sketch tier's pass over every sketch (each one's nearest list, the probe rows' exhaustive tops, the lists'
sums: :func:`gradindex.index.tiers.ivf_sketch.assign`) in one process and shared by torchrun ranks.

Its cost depends on ``N``, the sketch width and ``nlist``, not on the values, so random codes time it. Run it once
alone and once under torchrun over the same folder; each run appends its seconds to ``--out``, and the ranks' lists
and means are checked equal to the one process's with as many threads as a rank (its ``.npz`` beside the
codes):

    python -m benchmarks.ivf_assign --examples 100000 --work /work/tmp/ivf-assign
    torchrun --standalone --nproc_per_node 2 -m benchmarks.ivf_assign --examples 100000 --work /work/tmp/ivf-assign
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from gradindex import distributed
from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.tiers.ivf_sketch import LISTS_PER_ROOT, PROBE_QUERIES, _Codes, assign

RESULTS = Path(__file__).resolve().parent / "results"


def codes_in(work: Path, n: int, m: int) -> _Codes:
    """``n`` random sketch codes of ``m`` numbers and their scales in ``work`` (made once, by rank 0)."""
    work.mkdir(parents=True, exist_ok=True)
    if distributed.rank() == 0 and not (work / "codes.npy").exists():
        rng = np.random.default_rng(0)
        codes = np.lib.format.open_memmap(work / "codes.partial.npy", mode="w+", dtype=np.uint8, shape=(n, m))
        for s in range(0, n, 1 << 15):
            codes[s:s + (1 << 15)] = rng.integers(0, 256, (min(1 << 15, n - s), m), dtype=np.uint8)
        codes.flush()
        del codes
        np.save(work / "scales.npy", rng.lognormal(0, 1, n).astype(np.float32))
        os.replace(work / "codes.partial.npy", work / "codes.npy")
    if distributed.active():
        distributed.barrier()
    return _Codes(work, {"sketch": {"codes": "codes.npy", "scales": "scales.npy"}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=100_000)
    ap.add_argument("--numbers", type=int, default=SKETCH_BYTES - 4)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--block-bytes", type=int, default=64 << 20, help="float32 sketches a block (the build's default)")
    ap.add_argument("--out", type=Path, default=RESULTS / "ivf_assign.json")
    args = ap.parse_args()
    distributed.init_from_env("cpu")
    team = distributed.team()
    codes = codes_in(args.work, args.examples, args.numbers)
    nlist = max(1, int(LISTS_PER_ROOT * np.sqrt(args.examples)))
    rng = np.random.default_rng(1)
    centroids = rng.standard_normal((nlist, args.numbers)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    probe = np.sort(rng.choice(args.examples, PROBE_QUERIES, replace=False))
    factors = np.stack([np.ones(args.examples, np.float32), rng.lognormal(0, 0.3, args.examples).astype(np.float32)])
    t = time.perf_counter()
    lists, means, truth = assign(codes, centroids, probe, factors, args.block_bytes, False, team)
    seconds = time.perf_counter() - t
    if not team.lead:
        distributed.shutdown()
        return
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    ref = args.work / f"one-process-{threads}-threads.npz"  # (threads change a product's bits)
    if team.size == 1:
        np.savez(ref, lists=lists, means=means, truth=truth)
    same = None
    if team.size > 1 and ref.exists():
        r = np.load(ref)
        same = bool(np.array_equal(r["lists"], lists) and r["means"].tobytes() == means.tobytes()
                    and np.array_equal(r["truth"], truth))
    row = {"examples": args.examples, "sketch_numbers": args.numbers, "nlist": nlist, "ranks": team.size,
           "block_rows": max(1, args.block_bytes // (4 * args.numbers)),
           "threads_per_rank": threads, "seconds": round(seconds, 2),
           "equal_to_one_process": same, "cpus": os.cpu_count(), "platform": platform.platform(),
           "load_average": os.getloadavg()}
    print(json.dumps(row))
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "runs": [*runs, row]}, indent=1))
    if distributed.active():
        distributed.shutdown()


if __name__ == "__main__":
    main()
