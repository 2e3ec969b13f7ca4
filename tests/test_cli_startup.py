"""The CLI starts without the heavy libraries (issue 7 item 4); benchmarks/startup.py times it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "faiss", "transformers", "datasets", "h5py", "numpy")
ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys\nprint('loaded:', *(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    last = out.stdout.strip().splitlines()[-1].split()
    assert last[0] == "loaded:", out.stdout
    return last[1:]


def test_importing_the_cli_and_asking_for_help_loads_no_heavy_library():
    assert _loaded_after("import gradindex") == []
    assert _loaded_after("import gradindex.cli") == []
    helps = "\n".join(
        f"main({args!r}, standalone_mode=False)"
        for args in (["--help"], ["--version"], ["build", "--help"], ["query", "--help"], ["index", "--help"],
                     ["info", "--help"], ["layers", "--help"], ["precondition", "--help"]))
    assert _loaded_after(f"from gradindex.cli import main\n{helps}") == []


def test_info_loads_no_heavy_library(tmp_path):
    import json

    d = tmp_path / "idx"
    (d / "faiss").mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "status": "complete", "counts": {"examples": 2}, "preconditioners": {},
        "build": {"projection": {"kind": "gaussian", "k_a": 2, "k_g": 2, "seed": 0}, "max_length": 8,
                  "layers": {"h.0.mlp": {"rows": 2, "cols": 2, "kind": "linear", "n_in": 4, "n_out": 4}}}}))
    (d / "faiss" / "index.json").write_text(json.dumps({
        "status": "complete", "space": {"whiten": "none", "normalize": False, "damping": 0.1},
        "layers": {"h.0.mlp": {"factory": "Flat", "bytes": 64}}}))
    code = f"from gradindex.cli import main\nmain(['info', {str(d)!r}], standalone_mode=False)"
    assert _loaded_after(code) == []


def test_the_cli_storage_names_are_the_store_codes():
    from gradindex.cli.build import STORAGES
    from gradindex.store.codes import STORAGES as CODES

    assert tuple(STORAGES) == tuple(CODES)


def _wait_policy(env: dict, code: str = "import gradindex") -> str:
    import os

    full = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    probe = f"{code}\nimport os, sys\nprint(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True, env=full)
    return out.stdout.split()


def test_the_library_sets_a_passive_omp_wait_policy_before_torch_unless_the_user_set_one():
    """Issue 33 item 10: spinning OpenMP threads made the CLI and the README's Python block 2.5-5x slower on a
    shared machine; the package sets PASSIVE when it is imported (torch not yet loaded); a user's value wins."""
    assert _wait_policy({}) == ["PASSIVE", "False"]
    assert _wait_policy({}, "import gradindex.cli") == ["PASSIVE", "False"]
    assert _wait_policy({"OMP_WAIT_POLICY": "ACTIVE"}) == ["ACTIVE", "False"]
