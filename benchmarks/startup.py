"""CLI start-up: wall time and peak memory of ``gradindex --help``, ``info IDX``, ``query --help``, and of a
one-off ``query IDX --text ...`` (model load, one query, its hits' texts).

Each command runs ``--repeats`` times (default 5) in a fresh ``python -m gradindex.cli`` process;
the median wall and CPU times (CPU time is what a loaded shared machine disturbs least) and the
largest peak RSS (``wait4``'s ``ru_maxrss``) are reported. With
``--compare DIR`` the same commands run, interleaved, from another checkout (e.g. ``/work/main``)
for a side-by-side figure. ``IDX`` is a tiny index built first in a temp dir (or ``--index``).
Target (issue 7 item 4): each but the query under 1 s; the query's CPU time is issue 17's figure.

    python -m benchmarks.startup                       # writes benchmarks/results/startup.json
    python -m benchmarks.startup --compare /work/main  # this checkout and another, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
UNDER_TARGET = ("--help", "info IDX", "query --help")
"""The commands the target is for; a one-off ``query`` loads torch, transformers and the model (issue 17)."""
QUERY = "example 3 of the start-up benchmark"


def run_once(root: Path, args: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of one fresh ``python -m gradindex.cli ARGS`` from ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "gradindex.cli", *args], cwd=root, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"gradindex {' '.join(args)} failed in {root}: {p.stderr.read().decode()[-500:]}")
    p.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def tiny_index(work: Path) -> Path:
    """A 40-example index of a tiny GPT-2, built in a child process (this one stays small: a forked
    child's peak RSS counts its parent's pages)."""
    subprocess.run([sys.executable, "-m", "benchmarks.startup", "--make-index", str(work)], check=True, cwd=ROOT)
    return work / "idx"


def make_index(work: Path) -> None:
    from click.testing import CliRunner

    from fixtures.tiny import save_model_dir, tiny_gpt2, train_tokenizer
    from gradindex.cli import main

    texts = [f"example {i} of the start-up benchmark, a few words long" for i in range(40)]
    tok = train_tokenizer(texts, vocab_size=300)
    model_dir = save_model_dir(tiny_gpt2(vocab_size=len(tok), n_layer=1, n_embd=16, n_head=2), tok, work / "model")
    (work / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = CliRunner().invoke(main, ["build", str(model_dir), str(work / "d.jsonl"), "--out", str(work / "idx"),
                                    "--projection", "4", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, res.output


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--index", default=None, help="An index directory for `info` (default: build a tiny one).")
    ap.add_argument("--compare", default=None, help="Another checkout to time side by side.")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    ap.add_argument("--make-index", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_index:
        return make_index(Path(args.make_index))
    with tempfile.TemporaryDirectory() as tmp:
        idx = Path(args.index) if args.index else tiny_index(Path(tmp))
        commands = {"--help": ["--help"], "info IDX": ["info", str(idx)], "query --help": ["query", "--help"],
                    "query IDX --text": ["query", str(idx), "--text", QUERY, "-k", "3"]}
        roots = {"this": ROOT} | ({"compare": Path(args.compare).resolve()} if args.compare else {})
        raw: dict[str, dict[str, list]] = {r: {c: [] for c in commands} for r in roots}
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                for r, root in roots.items():
                    raw[r][name].append(run_once(root, cmd))
    results = {}
    for r, root in roots.items():
        results[r] = {"root": str(root)}
        for name, runs in raw[r].items():
            walls = [w for w, _, _ in runs]
            results[r][name] = {"median_s": round(statistics.median(walls), 3), "min_s": round(min(walls), 3),
                                "max_s": round(max(walls), 3),
                                "median_cpu_s": round(statistics.median(c for _, c, _ in runs), 3),
                                "peak_rss_mib": round(max(m for _, _, m in runs), 1)}
    print(f"{'command':<14}" + "".join(f"{r + ' wall s':>14}{r + ' CPU s':>14}{r + ' peak MiB':>16}" for r in roots))
    for name in commands:
        print(f"{name:<14}" + "".join(f"{results[r][name]['median_s']:>14.3f}{results[r][name]['median_cpu_s']:>14.3f}"
                                      f"{results[r][name]['peak_rss_mib']:>16.1f}" for r in roots))
    ok = all(results["this"][c]["median_s"] < TARGET_S for c in commands if c in UNDER_TARGET)
    print(f"target: every median but the query's under {TARGET_S} s: {'met' if ok else 'NOT met'} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    out = {"repeats": args.repeats, "target_s": TARGET_S, "target_for": list(UNDER_TARGET), "target_met": ok,
           "load_average": os.getloadavg(), "cpus": os.cpu_count(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
