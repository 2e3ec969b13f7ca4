"""gradindex and its peers side by side on the shared workload: one run, one process at a time, one thread.

    python -m benchmarks.peers.run --peers all --install    # venvs once (minutes each), then the table
    python -m benchmarks.peers.run --peers all              # the table, venvs already there
    python -m benchmarks.peers.run --quick --peers gradindex --out-dir /tmp/p   # smoke test (seconds)

The workload (benchmarks/README.md, "Shared workload": GPT-2 from a config, 512 training and 16
query sequences of 128 random token ids, seed 0, batch 8) is built once with ``benchmarks.common``
and written to a temporary directory (``save_pretrained`` + ``.npy``); every run loads those bytes. Each cell
(library × method) is one subprocess — ``python -m benchmarks.peers.adapters.<library>`` in that library's own
venv (gradindex and the floor in this interpreter) — with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``;
the adapter times only the attribution (``build``: gradients / logs / factors of the training set;
``query_Q``: from the first ``Q`` query sequences to their ``[Q, N]`` scores) and writes its scores.
Here: the floor (bare forward + backward, run first and last), peak RSS per process (``VmHWM``),
ratios to the floor, and Spearman against gradindex. Writes ``peers.json``, ``peers.md``, ``peers.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from benchmarks.common import spearman  # noqa: E402  (re-exported: tests/test_peers_bench.py)
from benchmarks.peers.common import QUICK, SHARED, peak_rss_mb, save_workload  # noqa: E402

RESULTS = HERE.parent / "results"
TORCH = "torch==2.13.0"
"""The torch every venv gets: the CPU build on this machine's disk (a plain ``torch`` pulls a CUDA build)."""


@dataclass(frozen=True)
class Peer:
    """A library: how to install it into its own venv, and the methods its adapter runs."""

    package: str
    methods: tuple[str, ...]
    install: tuple[str, ...] = ()
    """Requirements installed with their dependencies (torch pinned to ``TORCH``)."""
    no_deps: tuple[str, ...] = ()
    """Then installed without dependencies, with ``no_deps_flags``."""
    no_deps_flags: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    """Uninstalled afterwards."""
    notes: str = ""
    bias: str = ""
    """How the library treats the layers' bias (gradindex: a bias column in every layer's gradient)."""


PEERS: dict[str, Peer] = {
    "gradindex": Peer("gradindex", ("graddot-proj", "kfac-proj", "ekfac-proj", "graddot-full", "kfac-full",
                                    "ekfac-full"), bias="bias column"),
    "bergson": Peer(
        "bergson", ("graddot-proj", "graddot-full"), install=("bergson",), remove=("torchvision", "torchaudio"),
        notes="its torchvision/torchaudio requirements arrive as CUDA builds whose compiled ops do not load "
              "against the CPU torch (transformers then cannot import GPT-2); bergson imports neither, so they "
              "are removed after the install",
        bias="bias column (include_bias=True)"),
    "kronfluence": Peer(
        "kronfluence", ("graddot-full", "kfac-full", "ekfac-full"), install=("kronfluence", "transformers"),
        remove=("torchvision",), notes="torchvision (a CUDA build, unused) removed after the install",
        bias="bias column"),
    "logix": Peer(
        "logix-ai", ("graddot-proj", "kfac-proj", "ekfac-proj", "graddot-full", "ekfac-full"),
        install=("numpy", "einops", "pyyaml", "tqdm", "transformers"), no_deps=("logix-ai",),
        no_deps_flags=("--ignore-requires-python",),
        notes="logix-ai 0.1.1 declares Requires-Python <3.11; its pure-Python wheel is installed with "
              "--no-deps --ignore-requires-python after its declared dependencies, and runs on 3.11",
        bias="no bias"),
    "dattri": Peer("dattri", ("graddot-proj", "fim-proj", "ekfac-full"), install=("dattri", "transformers"),
                   bias="LoGra: no bias; EK-FAC: bias"),
    "traker": Peer("traker", ("trak-proj",), install=("traker", "transformers"), bias="weights and biases"),
}
ORDER = ("gradindex", "bergson", "kronfluence", "logix", "dattri", "traker")

REFERENCE = {"graddot": "graddot-full", "trak": "graddot-full", "kfac": "kfac-full", "ekfac": "ekfac-full",
             "fim": "ekfac-full"}
"""gradindex's full-space cell each method family is compared with (besides the same-named cell)."""

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}


# -- install ------------------------------------------------------------------------------------


def venv_python(venvs: Path, peer: str) -> Path:
    return venvs / peer / "bin" / "python"


def python_of(peer: str, venvs: Path) -> Path:
    return Path(sys.executable) if peer == "gradindex" else venv_python(venvs, peer)


def installed_versions(python: Path, packages: tuple[str, ...]) -> dict[str, str]:
    code = ("import json, importlib.metadata as m, sys\nout = {}\nfor n in sys.argv[1:]:\n"
            "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    p = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout) if p.returncode == 0 else {}


def install(name: str, venvs: Path, budget_s: float) -> dict:
    """Create ``venvs/name`` and install the peer; ``install.json`` beside it records how it went."""
    peer = PEERS[name]
    root = venvs / name
    if root.exists():
        shutil.rmtree(root)
    venvs.mkdir(parents=True, exist_ok=True)
    constraints = venvs / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [[sys.executable, "-m", "venv", str(root)], [*pip, TORCH]]
    if peer.install:
        steps.append([*pip, "-c", str(constraints), *peer.install])
    if peer.no_deps:
        steps.append([*pip, "--no-deps", *peer.no_deps_flags, *peer.no_deps])
    if peer.remove:
        steps.append([str(root / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *peer.remove])
    t0 = time.perf_counter()
    rec: dict = {"ok": True, "steps": [" ".join(s[s.index("install"):] if "install" in s else s[-3:])
                                       for s in steps], "notes": peer.notes}
    log = []
    for cmd in steps:
        left = budget_s - (time.perf_counter() - t0)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            rec.update(ok=False, why=f"install took over {budget_s:.0f} s: {' '.join(cmd[-3:])}")
            break
        log.append(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
        if p.returncode != 0:
            lines = [x for x in (p.stderr or p.stdout).splitlines() if "is ignored" not in x]
            rec.update(ok=False, why="\n".join(lines[-12:]))
            break
    rec["seconds"] = time.perf_counter() - t0
    if rec["ok"]:
        rec["versions"] = installed_versions(venv_python(venvs, name), (peer.package, "torch", "transformers"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "install.log").write_text("\n".join(log))
    (root / "install.json").write_text(json.dumps(rec, indent=1))
    print(f"install {name}: {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']:.0f} s "
          f"{rec.get('versions', rec.get('why', ''))}", flush=True)
    return rec


def install_record(name: str, venvs: Path) -> dict:
    """What the last install of ``name`` recorded (or why there is none)."""
    if name == "gradindex":
        return {"ok": True, "versions": installed_versions(Path(sys.executable), ("gradindex", "torch",
                                                                                  "transformers")),
                "notes": "this checkout, in the project's own venv"}
    f = venvs / name / "install.json"
    if f.exists():
        return json.loads(f.read_text())
    if venv_python(venvs, name).exists():
        return {"ok": True, "versions": installed_versions(venv_python(venvs, name), (PEERS[name].package, "torch",
                                                                                    "transformers")),
                "notes": PEERS[name].notes + " (installed by hand; no install.json)"}
    return {"ok": False, "why": f"no venv at {venvs / name}: run with --install"}


# -- one cell -----------------------------------------------------------------------------------


@dataclass
class Cell:
    peer: str
    method: str
    ok: bool = False
    why: str = ""
    wall: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)
    process_seconds: float = 0.0
    rss_peak_mb: float = 0.0
    rss_loaded_mb: float = 0.0
    versions: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict, repr=False)

    @property
    def key(self) -> str:
        return f"{self.peer}/{self.method}"


def run_cell(peer: str, method: str, python: Path, workload: Path, queries: list[int], timeout: float,
             out: Path) -> Cell:
    """One adapter process; its timings, scores, and its peak RSS (``VmHWM``, polled and self-reported)."""
    cell = Cell(peer, method)
    adapter = f"benchmarks.peers.adapters.{'floor' if peer == 'floor' else peer}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", adapter, "--workload", str(workload), "--method", method,
           "--queries", ",".join(map(str, queries)), "--out", str(out)]
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}  # the checkout's benchmarks (and gradindex)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=out)
        while True:
            pid, status = os.waitpid(p.pid, os.WNOHANG)
            if pid:
                break
            cell.rss_peak_mb = max(cell.rss_peak_mb, peak_rss_mb(p.pid))  # a killed run reports nothing itself
            if time.perf_counter() - t0 > timeout:
                os.killpg(p.pid, signal.SIGKILL)
                pid, status = os.waitpid(p.pid, 0)
                cell.why = f"timed out after {timeout:.0f} s (killed)"
                break
            time.sleep(0.2)
    p.returncode = os.waitstatus_to_exitcode(status)
    cell.process_seconds = time.perf_counter() - t0
    (out / "process.json").write_text(json.dumps({"seconds": cell.process_seconds, "rss_peak_mb": cell.rss_peak_mb,
                                                  "returncode": p.returncode, "why": cell.why}))
    return read_cell(cell, out, p.returncode)


def read_cell(cell: Cell, out: Path, returncode: int | None = None) -> Cell:
    """The cell's result files in ``out`` (also those of an earlier, interrupted run kept with ``--keep``)."""
    if returncode is None:  # resumed: what the parent recorded when this cell ended
        rec = json.loads((out / "process.json").read_text())
        cell.process_seconds, cell.rss_peak_mb, cell.why = rec["seconds"], rec["rss_peak_mb"], rec["why"]
        returncode = rec["returncode"]
    res_file = out / "result.json"
    if res_file.exists():
        res = json.loads(res_file.read_text())
        cell.wall, cell.cpu = res.get("wall", {}), res.get("cpu", {})
        cell.rss_loaded_mb = res.get("rss_loaded_mb", 0.0)
        cell.rss_peak_mb = max(cell.rss_peak_mb, res.get("rss_peak_mb", 0.0))
        cell.versions = res.get("versions", {})
        cell.ok = bool(res.get("ok")) and not cell.why
        if not res.get("ok"):
            cell.why = res.get("error", "failed")
    elif not cell.why:
        tail = (out / "log.txt").read_text()[-1500:]
        cell.why = f"exit {returncode}, no result: {tail}"
    for f in out.glob("scores_*.npy"):
        cell.scores[f.stem.removeprefix("scores_")] = np.load(f)
    state = "ok" if cell.ok else f"FAILED: {cell.why.splitlines()[-1] if cell.why else ''}"
    print(f"  {cell.key:<28} {cell.process_seconds:7.1f} s  peak {cell.rss_peak_mb:7.0f} MB  "
          f"{ {k: round(v, 2) for k, v in cell.wall.items()} }  {state}", flush=True)
    return cell


# -- figures ------------------------------------------------------------------------------------


def mean_spearman(a: np.ndarray | None, b: np.ndarray | None) -> dict | None:
    """Mean (and min) over query rows of Spearman between two ``[Q, N]`` score matrices."""
    if a is None or b is None or a.shape != b.shape:
        return None
    rho = [spearman(x, y) for x, y in zip(a, b, strict=True)]
    return {"mean": float(np.mean(rho)), "min": float(np.min(rho))}


def summarize(cells: list[Cell], queries: list[int], n_train: int) -> dict:
    floors = [c for c in cells if c.peer == "floor" and c.ok]
    floor_s = float(np.mean([c.wall["build"] for c in floors])) if floors else float("nan")
    floor_cpu = float(np.mean([c.cpu["build"] for c in floors])) if floors else float("nan")
    gi = {c.method: c for c in cells if c.peer == "gradindex" and c.ok}
    qmax = max(queries)
    rows = []
    for c in cells:
        if c.peer == "floor":
            continue
        row: dict = {"library": c.peer, "method": c.method, "ok": c.ok, "why": c.why,
                     "bias": PEERS[c.peer].bias, "process_seconds": c.process_seconds,
                     "rss_peak_mb": c.rss_peak_mb, "rss_loaded_mb": c.rss_loaded_mb, "versions": c.versions,
                     "phases_wall": c.wall, "phases_cpu": c.cpu}
        if c.ok:
            build = sum(v for k, v in c.wall.items() if not k.startswith("query_"))
            build_cpu = sum(v for k, v in c.cpu.items() if not k.startswith("query_"))
            total = build + c.wall.get(f"query_{qmax}", 0.0)
            total_cpu = build_cpu + c.cpu.get(f"query_{qmax}", 0.0)
            row.update(build_s=build, query_s={q: c.wall.get(f"query_{q}") for q in queries}, total_s=total,
                       sequences_per_s=n_train / total, ratio_to_floor=total / floor_s,
                       build_ratio_to_floor=build / floor_s, cpu_ratio_to_floor=total_cpu / floor_cpu)
            family = c.method.split("-")[0]
            same = gi.get(c.method)
            ref = gi.get(REFERENCE.get(family, ""))
            key = str(qmax)
            row["spearman_vs_gradindex_same"] = (mean_spearman(c.scores.get(key), same.scores.get(key))
                                                 if same and c.peer != "gradindex" else None)
            row["spearman_vs_gradindex_full"] = (mean_spearman(c.scores.get(key), ref.scores.get(key))
                                                 if ref and ref is not c else None)
            if ref is not None and f"{key}-nobias" in ref.scores:
                row["spearman_vs_gradindex_full_nobias"] = mean_spearman(c.scores.get(key),
                                                                         ref.scores[f"{key}-nobias"])
        rows.append(row)
    return {"floor_seconds": floor_s, "floor_cpu_seconds": floor_cpu,
            "floor_runs": [c.wall.get("build") for c in floors], "rows": rows}


def fmt(x, spec: str = ".1f", none: str = "—") -> str:
    return none if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def rho(r: dict | None) -> str:
    return "—" if r is None else f"{r['mean']:.3f}"


def markdown(res: dict) -> str:
    s, w = res["summary"], res["workload"]
    qs = res["queries"]
    qmax = max(qs)
    lines = [
        "# gradindex and its peers, side by side",
        "",
        f"Workload: GPT-2 from a config ({w['layers']} layers, width {w['width']}, {w['heads']} heads, vocab "
        f"{w['vocab']}, {w['positions']} positions), {w['train']} training and {w['queries']} query sequences of "
        f"{w['seq_len']} random token ids (seed {w['seed']}), every block linear layer, batch {w['batch_size']}, "
        f"one thread, one process at a time. Machine: {res['machine']['cpus']} cores shared with other jobs "
        f"(load average {res['machine']['loadavg_before'][0]:.1f} before, {res['machine']['loadavg_after'][0]:.1f} "
        "after): compare ratios measured in this run, not seconds across runs.",
        "",
        f"Floor (bare forward + backward): {fmt(s['floor_seconds'], '.1f')} s wall "
        f"(runs: {', '.join(fmt(x, '.1f') for x in s['floor_runs'])}), {fmt(s['floor_cpu_seconds'], '.1f')} s CPU.",
        "",
        f"*total* = build + {qmax} queries; *seq/s* = training sequences / total; *× floor* = total / floor "
        "(wall), *CPU × floor* the same in process CPU time; *peak MB*: the process's peak RSS (Python, torch "
        f"and the library loaded: {res['baseline_mb']}); ρ: mean Spearman over the {qmax} queries against "
        "gradindex's same cell (*same*) and its full-space cell of that method (*full*; GradDot without the bias "
        "column for libraries that keep none, *full, no bias*).",
        "",
        f"| library | method | build s | 1 query s | {qmax} queries s | total s | seq/s | × floor | CPU × floor | "
        "peak MB | ρ same | ρ full | ρ full, no bias |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in s["rows"]:
        if not r["ok"]:
            continue
        q = r["query_s"]
        lines.append(
            f"| {r['library']} | {r['method']} | {fmt(r['build_s'])} | {fmt(q.get(min(qs)), '.2f')} | "
            f"{fmt(q.get(qmax), '.2f')} | {fmt(r['total_s'])} | {fmt(r['sequences_per_s'], '.2f')} | "
            f"{fmt(r['ratio_to_floor'], '.2f')} | {fmt(r['cpu_ratio_to_floor'], '.2f')} | "
            f"{fmt(r['rss_peak_mb'], '.0f')} | {rho(r.get('spearman_vs_gradindex_same'))} | "
            f"{rho(r.get('spearman_vs_gradindex_full'))} | {rho(r.get('spearman_vs_gradindex_full_nobias'))} |")
    failed = [r for r in s["rows"] if not r["ok"]]
    if failed:
        lines += ["", "Did not run to the end:", ""]
        lines += [f"- {r['library']} {r['method']}: {r['why'].strip().splitlines()[-1][:300]}" for r in failed]
    lines += ["", "| library | installed | versions | install s | notes |", "| --- | --- | --- | --- | --- |"]
    for name, rec in res["install"].items():
        v = ", ".join(f"{k} {x}" for k, x in rec.get("versions", {}).items())
        why = rec.get("why", "").strip().splitlines()[-1:] if not rec.get("ok") else []
        lines.append(f"| {name} | {'yes' if rec.get('ok') else 'no'} | {v or '—'} | {fmt(rec.get('seconds'), '.0f')} | "
                     f"{'; '.join([rec.get('notes', '')] + why).strip('; ')} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    rows = [r for r in s["rows"] if r["ok"]]
    rows.sort(key=lambda r: (r["method"].split("-")[-1], r["method"].split("-")[0], r["library"] != "gradindex"))
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(ORDER)}
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    y = np.arange(len(rows))[::-1]
    build = [r["build_s"] for r in rows]
    query = [r["total_s"] - r["build_s"] for r in rows]
    ax.barh(y, build, color=[colors[r["library"]] for r in rows])
    ax.barh(y, query, left=build, color=[colors[r["library"]] for r in rows], alpha=0.45, hatch="//")
    for yi, r in zip(y, rows, strict=True):
        ax.text(r["total_s"], yi, f" {r['ratio_to_floor']:.2f}×", va="center", fontsize=7)
    ax.set_yticks(y, [f"{r['library']} {r['method']}" for r in rows], fontsize=8)
    ax.axvline(s["floor_seconds"], color="k", ls="--", lw=1)
    ax.text(s["floor_seconds"], y[0] + 0.8, " floor", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(left=0.5 * min(r["total_s"] for r in rows))
    ax.set_xlabel(f"seconds, one thread (solid: build; hatched: {max(res['queries'])} queries); label: × floor")
    ax.set_title("Attribution on the shared workload, side by side", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out_dir: Path, venvs: Path) -> dict:
    """Rewrite ``peers.md`` and ``peers.png`` from ``peers.json``, its install records refreshed from ``venvs``."""
    res = json.loads((out_dir / "peers.json").read_text())
    res["install"] = {p: install_record(p, venvs) for p in res["install"]}
    for r in res["summary"]["rows"]:
        if "query_s" in r:
            r["query_s"] = {int(k): v for k, v in r["query_s"].items()}
    (out_dir / "peers.json").write_text(json.dumps(res, indent=1, default=str))
    (out_dir / "peers.md").write_text(markdown(res))
    plot(res, out_dir / "peers.png")
    return res


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="all", help=f"'all' or a comma list of {', '.join(ORDER)}")
    ap.add_argument("--methods", default="", help="only these methods (comma list, e.g. graddot-proj,ekfac-full)")
    ap.add_argument("--install", action="store_true", help="(re)create each chosen peer's venv first")
    ap.add_argument("--install-only", action="store_true", help="install the chosen peers, then stop")
    ap.add_argument("--install-budget", type=float, default=900, help="seconds per peer's install")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite peers.md/.png from --out-dir's peers.json, with --venvs' install records")
    ap.add_argument("--venvs", type=Path, default=ROOT / ".peers-venvs", help="where the peers' venvs live")
    ap.add_argument("--quick", action="store_true", help="tiny workload (16 sequences): a smoke test")
    ap.add_argument("--queries", default="", help="query counts, in the order they run (default: all, then 1)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per cell (default 600; 120 with --quick)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where peers.json/.md/.png go")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the workload and every cell's output here; a run kept there and interrupted "
                         "resumes at its first unfinished cell")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    peers = list(ORDER) if args.peers == "all" else [p.strip() for p in args.peers.split(",")]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; choose from {list(ORDER)}")
    if "gradindex" not in peers:
        peers.insert(0, "gradindex")  # the reference every score is compared with
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    size = QUICK if args.quick else SHARED
    queries = [int(q) for q in (args.queries or f"{size['queries']},1").split(",")]
    timeout = args.timeout or (120 if args.quick else 600)
    if max(queries) > size["queries"]:
        raise SystemExit(f"--queries asks for {max(queries)} queries; the workload has {size['queries']}")
    if args.render:
        return render(args.out_dir, args.venvs)
    load0 = list(os.getloadavg())
    if args.install or args.install_only:
        for p in peers:
            if p != "gradindex":
                install(p, args.venvs, args.install_budget)
    records = {p: install_record(p, args.venvs) for p in peers}
    if args.install_only:
        return records

    import torch

    from benchmarks.common import Workload, make_model, make_sequences

    torch.set_num_threads(1)
    work = args.keep or Path(tempfile.mkdtemp(prefix="gradindex-peers-"))
    meta = work / "workload" / "meta.json"
    resume = args.keep is not None and meta.exists() and json.loads(meta.read_text()) == size
    w = Workload(layers=size["layers"], width=size["width"], heads=size["heads"], vocab=size["vocab"],
                 seq_len=size["seq_len"], sequences=size["train"], batch_size=size["batch_size"], seed=size["seed"])
    seqs = np.array(make_sequences(w, size["train"] + size["queries"], size["seq_len"]))
    if not resume:  # else: a run kept with --keep goes on where it stopped, on the same bytes
        save_workload(make_model(w, size["positions"]), seqs[:size["train"]], seqs[size["train"]:], size,
                      work / "workload")
    plan = [("floor", "floor")]
    for p in peers:
        plan += [(p, m) for m in PEERS[p].methods if not methods or m in methods]
    plan.append(("floor", "floor"))
    print(f"{len(plan)} runs, one at a time, one thread each (timeout {timeout:.0f} s); work in {work}", flush=True)
    cells = []
    try:
        for i, (p, m) in enumerate(plan):
            if p != "floor" and not records[p].get("ok"):
                cells.append(Cell(p, m, why=f"not installed: {records[p].get('why', '')}"))
                continue
            out = work / "runs" / f"{i:02d}-{p}-{m}"
            if resume and (out / "process.json").exists():
                cells.append(read_cell(Cell(p, m), out))
                print(f"  {cells[-1].key:<28} (kept from the interrupted run)", flush=True)
                continue
            python = Path(sys.executable) if p == "floor" else python_of(p, args.venvs)
            cells.append(run_cell(p, m, python, work / "workload", queries, timeout, out))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    baseline = {c.peer: round(c.rss_loaded_mb) for c in cells if c.ok and c.rss_loaded_mb}
    res = {
        "workload": size, "queries": queries, "quick": args.quick, "timeout_s": timeout,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "threads": 1, "loadavg_before": load0, "loadavg_after": list(os.getloadavg())},
        "install": records,
        "baseline_mb": ", ".join(f"{k} {v}" for k, v in baseline.items()),
        "summary": summarize(cells, queries, size["train"]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "peers.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out_dir / "peers.md").write_text(markdown(res))
    plot(res, args.out_dir / "peers.png")
    print("\n" + markdown(res))
    print(f"wrote {args.out_dir / 'peers.json'}, peers.md, peers.png")
    return res


if __name__ == "__main__":
    main()
