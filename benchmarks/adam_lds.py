"""LDS of optimizer-aware influence (``adam``, exact and factored) and of EK-FAC's two Fishers.

Reuses benchmarks/fidelity.py's setup, model, retrained-subset ground truth and LDS (imported, not
copied): the model is trained with AdamW there (``train_model``), and its final optimizer state is
saved here as safetensors (``<param>.exp_avg_sq``). For each projection (and projection seed)
it builds, on the same model and data:

* a plain index with EK-FAC fitted from the observed labels (``--fisher empirical``), scored with
  GradDot, K-FAC and EK-FAC; the same index refitted with ``--fisher true`` (labels sampled from the
  model), scored with K-FAC and EK-FAC;
* an index of Adam-preconditioned rows, ``--adam-mode exact`` and ``factored``, scored with ``adam``.

``--adam-powers 1,0.5`` also measures ``G ⊘ (√v + ε)^p`` on both sides, i.e. the metric
``(√v + ε)^{-2p}``: ``p = 1`` is the method (``diag(v)⁻¹``, both sides preconditioned), ``p = 0.5``
the one-sided Adam step of LESS/TracIn-Adam (``⟨g_q, g_t ⊘ (√v + ε)⟩``). It is made here by
rewriting the state file (``√v' = (√v + ε)^p − ε``), not by the library.

All of them store the same ``k_g·k_a`` float32 numbers per layer, so a projection column compares
methods at equal bytes per example. EK-FAC is reported at the library's default damping and at
the best damping of the sweep (an upper bound that tunes on the evaluation). Paired differences
to EK-FAC (empirical, default damping) come with their standard error over queries.

Usage::

    python -m benchmarks.adam_lds --quick                     # seconds
    python -m benchmarks.adam_lds --subsets 32 --retrain-seeds 2 --projections 16,64,none
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from benchmarks import fidelity as F  # noqa: E402
from fixtures.tiny import save_model_dir  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.capture.adam import adam_capture_transforms, save_second_moments  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner  # noqa: E402


def query_gradients(model, tokenizer, query, bcfg: BuildConfig) -> dict[str, np.ndarray]:
    """layer → ``[Q, D]`` query rows, with the build's Adam transform when it had one."""
    transforms = None
    if bcfg.optimizer_state:
        transforms, _ = adam_capture_transforms(bcfg.optimizer_state, bcfg.rows.adam, model, bcfg.layers)
    return common.query_gradients(model, tokenizer, query, bcfg, transforms)


def _build(model, setup, bcfg: BuildConfig, out: Path) -> float:
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    build_index(model, setup.tokenizer, setup.train, out, bcfg, model_id="adam_lds", progress=False)
    return time.perf_counter() - t0


def powered_state(state: Path, p: float) -> Path:
    """A state file whose exact Adam weight is ``(√v + ε)^-p`` (module doc); ``state`` itself for ``p = 1``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if p == 1:
        return state
    with safe_open(str(state), "pt") as f:
        meta = f.metadata()
    eps = float(meta["eps"])
    t = {k: (((v.double().sqrt() + eps) ** p - eps).clamp_min(0) ** 2).float()
         for k, v in load_file(str(state)).items()}
    out = state.with_name(f"{state.stem}-p{p}.safetensors")
    save_file(t, str(out), metadata=meta)
    return out


def run(cfg: F.FidelityConfig, work: Path, workers: int, threads: int, log=print, powers=(1.0,),
        fisher: bool = True) -> dict:
    t_start = time.perf_counter()
    torch.set_num_threads(threads)
    work.mkdir(parents=True, exist_ok=True)
    setup = F.make_setup(cfg)
    init = {k: v.clone() for k, v in F.new_model(cfg, len(setup.tokenizer)).state_dict().items()}
    model = F.new_model(cfg, len(setup.tokenizer))
    model.load_state_dict(init)
    opts: list = []
    common.train_model(model, setup.train.input_ids, cfg, seed=1000, optimizer_out=opts)
    save_model_dir(model, setup.tokenizer, work / "model")
    state = save_second_moments(opts[0], model, work / "adam_state.safetensors")
    masks, losses, _ = F.retrained_losses(cfg, setup, init, work, workers, threads, log)
    torch.set_num_threads(threads)
    log(f"ground truth: {losses.shape[0]} subsets x {losses.shape[1]} seeds; ceiling {common.noise_ceiling(losses)}")

    per_q: dict[tuple[str, str], list[np.ndarray]] = {}
    seconds: dict[str, float] = {}
    bytes_per_example: dict[str, int] = {}

    def record(name, proj, s):
        per_q.setdefault((name, proj), []).append(common.lds_per_query(s, masks, losses.mean(axis=1)))

    for proj in cfg.projections:
        for ps in range(1 if proj == "none" else cfg.proj_seeds):
            spec = ProjectionSpec.parse(proj, seed=ps)
            idx = work / f"idx-{proj}-s{ps}"
            plain = BuildConfig.raw(projection=spec, batch_size=16, precondition="ekfac", damping=cfg.damping)
            seconds[f"build+ekfac {proj}"] = seconds.get(f"build+ekfac {proj}", 0) + _build(model, setup, plain, idx)
            q = query_gradients(model, setup.tokenizer, setup.query, plain)
            bytes_per_example[proj] = 4 * sum(v.shape[1] for v in q.values())
            record("graddot", proj, F.scores(idx, q, "graddot", cfg.damping))
            for fisher_kind in ("empirical", "true") if fisher else ("empirical",):
                if fisher_kind == "true":
                    t0 = time.perf_counter()
                    fit_preconditioner(idx, FitConfig(method="ekfac", damping=cfg.damping, fisher="true", seed=ps,
                                                      device="cpu"), model, setup.tokenizer, setup.train)
                    seconds[f"fit true {proj}"] = seconds.get(f"fit true {proj}", 0) + time.perf_counter() - t0
                for m in ("kfac", "ekfac"):
                    for d in cfg.dampings:
                        record(f"{m}-{fisher_kind}@{d}", proj, F.scores(idx, q, m, d))
            shutil.rmtree(idx)
            for pw in powers:
                for mode in ("exact", "factored"):
                    acfg = replace(plain, precondition="none", optimizer_state=str(powered_state(state, pw)),
                                   adam_mode=mode)
                    name = f"adam-{mode}" + ("" if pw == 1 else f"^{pw}")
                    seconds[f"build {name} {proj}"] = seconds.get(f"build {name} {proj}", 0) + _build(
                        model, setup, acfg, idx)
                    q_adam = query_gradients(model, setup.tokenizer, setup.query, acfg)
                    record(name, proj, F.scores(idx, q_adam, "adam", cfg.damping))
                    shutil.rmtree(idx)
        log(f"projection {proj}: done ({time.perf_counter() - t_start:.0f} s so far)")

    ref_name = f"ekfac-empirical@{cfg.damping}"
    table: dict[str, dict[str, dict]] = {}
    for (name, proj), runs in per_q.items():
        pq = np.mean(runs, axis=0)  # [Q], averaged over projection seeds
        ref = np.mean(per_q[(ref_name, proj)], axis=0)
        diff = pq - ref
        se = lambda x: float(x.std(ddof=1) / np.sqrt(len(x)))  # noqa: E731
        table.setdefault(name, {})[proj] = {"lds": float(pq.mean()), "query_se": se(pq),
                                            "diff_vs_ekfac": float(diff.mean()), "diff_se": se(diff),
                                            "per_proj_seed": [round(float(r.mean()), 4) for r in runs]}
    best = {}
    fishers = ("empirical", "true") if fisher else ("empirical",)
    for m in [f"{k}-{f}" for k in ("kfac", "ekfac") for f in fishers]:
        for proj in cfg.projections:
            cands = {d: table[f"{m}@{d}"][proj]["lds"] for d in cfg.dampings}
            d = max(cands, key=cands.get)
            best.setdefault(m, {})[proj] = {"damping": d, "lds": cands[d]}
    return {"benchmark": "adam_lds", "config": asdict(cfg), "threads": threads, "workers": workers,
            "bytes_per_example": bytes_per_example, "noise_ceiling": common.noise_ceiling(losses),
            "adam_powers": list(powers), "reference": ref_name, "lds": table, "best_damping": best,
            "seconds": {k: round(v, 1) for k, v in seconds.items()} | {
                "total": round(time.perf_counter() - t_start, 1)}}


def format_table(r: dict) -> str:
    projs = list(r["config"]["projections"])
    d = r["config"]["damping"]
    lines = [f"LDS (mean over queries; Δ = paired difference to ekfac-empirical@{d} ± SE over queries)",
             f"{'method':<22}" + "".join(f"{p + ' (' + str(r['bytes_per_example'][p] // 1024) + ' KiB)':>28}"
                                         for p in projs)]
    names = ["graddot", f"kfac-empirical@{d}", f"kfac-true@{d}", f"ekfac-empirical@{d}", f"ekfac-true@{d}"]
    names += [n for n in r["lds"] if n.startswith("adam")]
    for n in [n for n in names if n in r["lds"]]:
        row = r["lds"][n]
        lines.append(f"{n:<22}" + "".join(
            f"{row[p]['lds']:>10.3f} Δ {row[p]['diff_vs_ekfac']:+.3f}±{row[p]['diff_se']:.3f}" for p in projs))
    for m, per in r["best_damping"].items():
        lines.append(f"{m + ' best δ':<22}" + "".join(
            f"{per[p]['lds']:>10.3f} (δ={per[p]['damping']})".ljust(28) for p in projs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fidelity's tiny smoke configuration (seconds)")
    ap.add_argument("--work-dir", type=Path, default=F.DEFAULT_WORK.parent / "adam_lds")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: none with --quick, "
                    "else benchmarks/results/adam_lds.json)")
    ap.add_argument("--subsets", type=int)
    ap.add_argument("--retrain-seeds", type=int)
    ap.add_argument("--projections")
    ap.add_argument("--proj-seeds", type=int)
    ap.add_argument("--dampings")
    ap.add_argument("--adam-powers", default="1", help="comma-separated p of G/(sqrt(v)+eps)^p (module doc)")
    ap.add_argument("--no-true-fisher", action="store_true", help="skip the true-Fisher refits")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    cfg = F.QUICK if a.quick else F.FidelityConfig(projections=("16", "64", "none"), proj_seeds=2)
    over = {"n_subsets": a.subsets, "retrain_seeds": a.retrain_seeds, "proj_seeds": a.proj_seeds,
            "projections": tuple(a.projections.split(",")) if a.projections else None,
            "dampings": tuple(float(x) for x in a.dampings.split(",")) if a.dampings else None}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    result = run(cfg, a.work_dir, a.workers, a.threads, powers=tuple(float(x) for x in a.adam_powers.split(",")),
                 fisher=not a.no_true_fisher)
    print(format_table(result))
    out = a.out or (None if a.quick else Path("benchmarks/results/adam_lds.json"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
