"""What every adapter shares: the workload on disk, the layers, the clock, and the result files.

Imported by the adapters in every peer's own virtual environment, so it needs numpy, torch and
transformers only — nothing from gradindex. The workload is written once by ``run.py``
(``save_pretrained`` model + token ids as ``.npy``) and every adapter loads those same bytes.

An adapter defines ``METHODS = {name: fn}``, each ``fn(w: Workload, queries: list[int], clock: Clock)
-> dict`` returning ``{Q: scores [Q, N]}`` (the first ``Q`` queries against every training sequence;
``"Q-tag"`` keys for untimed extra variants) and timing its phases with ``clock.phase(...)``
(``build``, then ``query_Q``); ``adapter_main(METHODS)`` does the
rest: one thread, argument parsing, the result JSON and the ``.npy`` files, errors as a result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

SHARED = {"layers": 4, "width": 256, "heads": 4, "vocab": 8192, "positions": 128, "seq_len": 128,
          "train": 512, "queries": 16, "batch_size": 8, "seed": 0}
"""The shared workload (benchmarks/README.md, "Shared workload")."""
QUICK = {"layers": 2, "width": 64, "heads": 4, "vocab": 512, "positions": 32, "seq_len": 32,
         "train": 16, "queries": 4, "batch_size": 8, "seed": 0}
"""A smoke-test size (seconds)."""


@dataclass
class Workload:
    """The model and token ids every run sees (identical bytes for every adapter)."""

    model: nn.Module
    train: torch.Tensor
    """[N, T] int64 training token ids; the loss is every next token's cross-entropy, summed per sequence."""
    queries: torch.Tensor
    """[Q, T] int64 query token ids."""
    meta: dict
    root: Path

    @property
    def batch_size(self) -> int:
        return int(self.meta["batch_size"])


def save_workload(model: nn.Module, train: np.ndarray, queries: np.ndarray, meta: dict, root: Path) -> Path:
    """Write the workload once: ``model/`` (``save_pretrained``), ``train.npy``, ``queries.npy``, ``meta.json``."""
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root / "model")
    np.save(root / "train.npy", np.asarray(train, dtype=np.int64))
    np.save(root / "queries.npy", np.asarray(queries, dtype=np.int64))
    (root / "meta.json").write_text(json.dumps(meta, indent=1))
    return root


def load_workload(root: str | os.PathLike) -> Workload:
    from transformers import GPT2LMHeadModel

    root = Path(root)
    model = GPT2LMHeadModel.from_pretrained(root / "model").eval()
    train = torch.from_numpy(np.load(root / "train.npy"))
    queries = torch.from_numpy(np.load(root / "queries.npy"))
    return Workload(model, train, queries, json.loads((root / "meta.json").read_text()), root)


def block_linears(model: nn.Module) -> list[str]:
    """Names of every linear layer of the transformer blocks (GPT-2's ``Conv1D``; no LM head, no embeddings)."""
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if isinstance(m, Conv1D | nn.Linear) and ".h." in f".{n}."]


def conv1d_to_linear(model: nn.Module) -> list[str]:
    """Replace every block ``Conv1D`` (``y = x W + b``) by the equal ``nn.Linear`` (weight ``Wᵀ``), in place.

    For peers that track ``nn.Linear`` only. Returns the replaced layers' names (same names as before).
    """
    from transformers.pytorch_utils import Conv1D

    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Conv1D) and ".h." in f".{name}.":
            n_in, n_out = mod.weight.shape
            lin = nn.Linear(n_in, n_out)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.T)
                lin.bias.copy_(mod.bias)
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, lin)
            names.append(name)
    return names


def summed_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` next-token cross-entropy summed over each sequence (gradindex's per-example loss)."""
    lp = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                           reduction="none")
    return lp.view(ids.shape[0], -1).sum(1)


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident set so far, MiB: ``VmHWM`` of its memory map.

    Not ``ru_maxrss``: that survives ``exec``, so a child forked from a large parent reports the
    parent's size. Falls back to it where ``/proc`` is missing.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid == "self" else 0.0


@dataclass
class Clock:
    """Wall and process-CPU seconds of named phases (a phase may be entered several times: it adds up)."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0


Method = Callable[[Workload, list[int], Clock], dict]


def package_versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in ("torch", "transformers", "numpy", *names):
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            pass
    return out


def adapter_main(methods: dict[str, Method], packages: tuple[str, ...] = ()) -> int:
    """CLI of an adapter: ``--workload DIR --method NAME --queries 16,1 --out DIR``.

    Writes ``OUT/result.json`` (phases' wall and CPU seconds, RSS after loading and at the peak,
    versions, or the error) and ``OUT/scores_Q.npy`` per query count. Exit 0 on success, 1 on error.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--method", required=True, choices=sorted(methods))
    ap.add_argument("--queries", default="16,1", help="query counts, comma-separated, run in this order")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"method": args.method, "python": platform.python_version(),
                 "versions": package_versions(*packages), "threads": torch.get_num_threads()}
    clock = Clock()
    try:
        w = load_workload(args.workload)
        res["rss_loaded_mb"] = peak_rss_mb()
        queries = [int(q) for q in args.queries.split(",")]
        scores = methods[args.method](w, queries, clock)
        for key, s in scores.items():  # Q, or "Q-tag" for an extra untimed variant (a reference)
            q = int(str(key).split("-")[0])
            s = np.asarray(s, dtype=np.float64)
            if s.shape != (q, len(w.train)):
                raise ValueError(f"{args.method}: scores {key!r} have shape {s.shape}, expected {(q, len(w.train))}")
            np.save(out / f"scores_{key}.npy", s)
        res["ok"] = True
        rc = 0
    except Exception as e:  # the harness records why and moves on
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        print(res["traceback"], file=sys.stderr)
        rc = 1
    res["wall"], res["cpu"] = clock.wall, clock.cpu
    res["rss_peak_mb"] = peak_rss_mb()
    (out / "result.json").write_text(json.dumps(res, indent=1))
    return rc
