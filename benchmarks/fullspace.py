"""Full-space EK-FAC fit: gradindex against Kronfluence and the forward+backward floor, side by side.

On the shared workload (benchmarks/README.md), one thread, in one run:

* floor: bare forward + backward over the same batches (HF mean loss, weight gradients);
* gradindex: ``fit_preconditioner(FitConfig(method="ekfac", space="full"))`` on a 16x16 index of the
  same data (the index build itself is not timed): factor pass, eigendecomposition, correction pass;
* gradindex_after_full_factors (``--build-factors``, default): the same fit on a 16x16 index built with
  ``full_factors=True``, which summed ``A`` and ``S`` in its capture pass: eigendecomposition and
  correction pass only; ``full_factors_build_extra_seconds`` is what that adds to the build;
* kronfluence: ``Analyzer.fit_all_factors`` with ``FactorArguments(strategy="ekfac")`` (covariance,
  eigendecomposition, lambda), run by ``benchmarks/kronfluence_ekfac.py`` in its own venv
  (``--kronfluence-python``), same model (Conv1D → equal nn.Linear), data, loss and batch size.

Also compares the two fits' corrected eigenvalues on one layer (``Λ*`` is invariant to eigenvector
signs). Writes ``benchmarks/results/fullspace.json``.

    python -m benchmarks.fullspace                       # shared workload (~15 min on 2 shared cores)
    python -m benchmarks.fullspace --sequences 32 --no-kronfluence --out /tmp/fs.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fixtures.tiny import tiny_gpt2  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import Tokenized, collate  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner, load_full_preconditioner  # noqa: E402
from gradindex.store.builder import BuildConfig, build_store  # noqa: E402

HERE = Path(__file__).resolve().parent
KRON_PY = "/work/venvs/kronfluence/bin/python"
DUMP = "transformer.h.0.mlp.c_fc"


def floor(model, ids: torch.Tensor, bs: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of a bare forward + backward over ``ids`` in batches of ``bs``."""
    model.requires_grad_(True)
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, len(ids), bs):
        b = collate(ids[s:s + bs].tolist(), ids[s:s + bs].tolist(), 0)
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
        out.loss.backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def kronfluence(python: str, n: int, dump: bool) -> dict:
    """Run kronfluence_ekfac.py on ``n`` sequences; its JSON line (+ the dumped layer's Λ*)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kf.npz"
        cmd = [python, str(HERE / "kronfluence_ekfac.py"), "--sequences", str(n)]
        cmd += ["--dump", DUMP, "--out", str(out)] if dump else []
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
        if dump:
            z = np.load(out)
            res["lambda"] = z["lambda_matrix"] / float(z["num_lambda_processed"].reshape(-1)[0])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--kron-small", type=int, default=0,
                    help="also run Kronfluence on this many sequences, to split its fixed and per-sequence "
                         "costs and extrapolate every side to 512 sequences")
    ap.add_argument("--kronfluence-python", default=KRON_PY)
    ap.add_argument("--no-kronfluence", action="store_true", help="skip Kronfluence (gradindex and the floor only)")
    ap.add_argument("--build-factors", action=argparse.BooleanOptionalAction, default=True,
                    help="also fit on an index built with --full-factors (the fit is then the correction pass "
                         "alone) and report what collecting them adds to the build")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fullspace.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = dict(layers=4, width=256, heads=4, vocab=8192, seq_len=128, sequences=args.sequences, batch_size=8, seed=0)
    model = tiny_gpt2(vocab_size=w["vocab"], n_layer=w["layers"], n_embd=w["width"], n_head=w["heads"],
                      n_positions=128, seed=w["seed"])
    g = torch.Generator().manual_seed(w["seed"])
    ids = torch.randint(w["vocab"], (w["sequences"], w["seq_len"]), generator=g)  # as kronfluence_ekfac.py
    load0 = os.getloadavg()
    res: dict = {"workload": w, "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                            "python": platform.python_version(), "threads": 1}}
    wall: dict = {}
    cpu: dict = {}
    wall["floor"], cpu["floor"] = floor(model, ids, w["batch_size"])
    print(f"floor {wall['floor']:.1f} s (CPU {cpu['floor']:.1f} s)", flush=True)
    data = Tokenized(ids.tolist(), ids.tolist(), 0, "input_ids")
    tok = SimpleNamespace(pad_token_id=0)
    builds: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for full_factors in ((False, True) if args.build_factors else (False,)):
            out = Path(tmp) / f"idx-{int(full_factors)}"
            cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=16, k_g=16), max_length=128, batch_size=8,
                              shard_size=4096, full_factors=full_factors)
            t0, c0 = time.perf_counter(), time.process_time()
            build_store(model, tok, data, out, cfg, model_id="shared-workload", data_id="random", progress=False)
            builds[full_factors] = (time.perf_counter() - t0, time.process_time() - c0)
        key = "gradindex"
        for full_factors in builds:
            t0, c0 = time.perf_counter(), time.process_time()
            idx = Path(tmp) / f"idx-{int(full_factors)}"
            entries = fit_preconditioner(idx, FitConfig(method="ekfac", space="full"), model, tok, data)
            wall[key], cpu[key] = time.perf_counter() - t0, time.process_time() - c0
            phases = entries["ekfac"]["fit"]["phase_seconds"]
            print(f"{key} full-space EK-FAC {wall[key]:.1f} s (CPU {cpu[key]:.1f} s) {phases}", flush=True)
            res[f"{key}_phases"] = phases
            if not full_factors:
                ours = load_full_preconditioner(idx, "ekfac").curvature[DUMP]["Lambda"]
            key = "gradindex_after_full_factors"
    if args.build_factors:
        # what --full-factors adds to the (untimed) 16x16 build that the fit belongs to
        res["full_factors_build_extra_seconds"] = {"wall": builds[True][0] - builds[False][0],
                                                   "cpu": builds[True][1] - builds[False][1]}
    try:
        if args.no_kronfluence:
            raise ValueError("skipped (--no-kronfluence)")
        k = kronfluence(args.kronfluence_python, args.sequences, dump=True)
        wall["kronfluence"], cpu["kronfluence"] = k["seconds"], k["cpu_seconds"]
        res["kronfluence"] = {"ran": True, "lambda_max_rel_diff_" + DUMP:
                              float(np.abs(k["lambda"] - ours).max() / np.abs(k["lambda"]).max())}
        print(f"kronfluence {k['seconds']:.1f} s (CPU {k['cpu_seconds']:.1f} s)", flush=True)
        if args.kron_small:
            ks = kronfluence(args.kronfluence_python, args.kron_small, dump=False)
            res["kronfluence"]["small"] = {"sequences": args.kron_small, "seconds": ks["seconds"],
                                           "cpu_seconds": ks["cpu_seconds"]}
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        res["kronfluence"] = {"ran": False, "why": (str(e) + (getattr(e, "stderr", "") or ""))[-3000:]}
        print(f"kronfluence did not run: {res['kronfluence']['why']}", flush=True)
    res["seconds"], res["cpu_seconds"] = wall, cpu
    res["ratio_to_floor"] = {k: v / wall["floor"] for k, v in wall.items()}
    res["cpu_ratio_to_floor"] = {k: v / cpu["floor"] for k, v in cpu.items()}
    if "kronfluence" in cpu:
        res["kronfluence_over_gradindex"] = {"wall": wall["kronfluence"] / wall["gradindex"],
                                             "cpu": cpu["kronfluence"] / cpu["gradindex"]}
        if "gradindex_after_full_factors" in cpu:
            after, extra = cpu["gradindex_after_full_factors"], res["full_factors_build_extra_seconds"]["cpu"]
            res["kronfluence_over_gradindex_after_full_factors"] = {
                "wall": wall["kronfluence"] / wall["gradindex_after_full_factors"],
                "cpu": cpu["kronfluence"] / after, "cpu_counting_the_build_extra": cpu["kronfluence"] / (after + extra)}
    small = res.get("kronfluence", {}).get("small")
    if small and args.sequences != 512:
        # CPU seconds at 512 sequences: Kronfluence fixed + per-sequence from its two sizes; gradindex's
        # model passes scale with the sequences, its eigendecomposition does not; the floor scales.
        n, m = args.sequences, small["sequences"]
        per = (cpu["kronfluence"] - small["cpu_seconds"]) / (n - m)
        kron512 = cpu["kronfluence"] + per * (512 - n)
        eig = res["gradindex_phases"]["eigendecomposition"][1]
        ours512 = eig + (cpu["gradindex"] - eig) * 512 / n
        res["extrapolated_cpu_seconds_512"] = {"floor": cpu["floor"] * 512 / n, "gradindex": ours512,
                                               "kronfluence": kron512, "kronfluence_over_gradindex": kron512 / ours512}
    res["machine"]["loadavg_before"], res["machine"]["loadavg_after"] = load0, os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("workload", "machine")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
