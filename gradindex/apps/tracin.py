"""TracIn-CP over saved checkpoints: ``score(q, t) = Σ_c η_c ⟨g_q^c, g_t^c⟩``.

A trajectory index is a directory holding one ordinary index per checkpoint (``ckpt-NN/``, raw
rows, built with the same data, layers and projection) and ``trajectory.json`` listing each
checkpoint's model directory, training step and learning rate ``η_c``::

    gradindex trajectory train.jsonl --out traj --checkpoint run/checkpoint-100 --checkpoint run/checkpoint-200 ...
    gradindex query traj --method tracin --text "..."

A query's gradient is taken under every checkpoint's model; its scores are the ``η_c``-weighted
sum of each checkpoint's exact GradDot scores over the whole store (equivalently one inner product
of the concatenated ``√η_c g^c`` vectors). The learning rate comes from ``--lr`` or from the
checkpoint's ``trainer_state.json`` (the HF Trainer's log of the step); checkpoints must be given
in training order (their steps, where known, must increase).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradindex.data import Tokenized
from gradindex.pipeline import BuildConfig, IndexConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.engine import Hit, QueryResult
from gradindex.spec import layout

TRAJECTORY = layout.TRAJECTORY


@dataclass(frozen=True)
class Checkpoint:
    model: str
    """The checkpoint's model directory."""
    lr: float
    """Learning rate ``η_c`` of the updates it stands for."""
    step: int | None = None


STEP_NAME = re.compile(r"(?:checkpoint|step|global_step|ckpt|iter|iteration)[-_]?(\d+)", re.IGNORECASE)
"""Folder names that state a training step (``checkpoint-500``, ``step_500``, ``global_step500``): a name
merely ending in a number (``llama-3``, ``run-v2``) states none."""


def checkpoint_step(model_dir: str | os.PathLike) -> int | None:
    """The training step of a checkpoint: ``trainer_state.json``'s ``global_step``, else the step its folder
    name states (:data:`STEP_NAME`), else ``None`` (unknown: the order check skips it)."""
    d = Path(model_dir)
    state = d / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    m = STEP_NAME.fullmatch(d.name)
    return int(m.group(1)) if m else None


def trainer_lr(model_dir: str | os.PathLike) -> float | None:
    """The learning rate the HF Trainer logged last before this checkpoint, if it saved its state."""
    state = Path(model_dir) / "trainer_state.json"
    if not state.is_file():
        return None
    logged = [e["learning_rate"] for e in json.loads(state.read_text()).get("log_history", []) if "learning_rate" in e]
    return float(logged[-1]) if logged else None


def checkpoints(models: list[str], lrs: list[float]) -> list[Checkpoint]:
    """Checked checkpoints: one learning rate each (given, or from ``trainer_state.json``), in training order."""
    if not models:
        raise ValueError("give at least one --checkpoint")
    if lrs and len(lrs) not in (1, len(models)):
        raise ValueError(f"{len(models)} checkpoints and {len(lrs)} learning rates: give one --lr per checkpoint "
                         "(or one for all)")
    out = []
    for i, m in enumerate(models):
        lr = lrs[i if len(lrs) > 1 else 0] if lrs else trainer_lr(m)
        if lr is None:
            raise ValueError(f"checkpoint {m!r} has no learning rate: pass --lr for each checkpoint (its "
                             "trainer_state.json, which would give it, is missing or logs none)")
        if not (lr > 0 and np.isfinite(lr)):
            raise ValueError(f"learning rate {lr} of checkpoint {m!r} must be positive")
        out.append(Checkpoint(str(Path(m).resolve()), float(lr), checkpoint_step(m)))
    seen = [c.model for c in out]
    if len(set(seen)) < len(seen):
        twice = next(m for m in seen if seen.count(m) > 1)
        raise ValueError(f"checkpoint {twice!r} is given more than once: list each checkpoint once, from the first "
                         "to the last")
    steps = [c.step for c in out]
    if None not in steps and any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"checkpoints are not in training order (steps {steps}); list them from the first "
                         "to the last")
    return out


def build_trajectory(ckpts: list[Checkpoint], data: Tokenized, out_dir: str | os.PathLike, cfg: BuildConfig,
                     load, data_id: str = "", index: IndexConfig | None = None, progress: bool = True,
                     overwrite: bool = False) -> dict:
    """One raw-row index per checkpoint under ``out_dir``; ``load(model_dir) -> (model, tokenizer)``.

    TracIn scores are exact sums over the stores, so no FAISS index is built unless ``index`` asks for one. A killed
    run resumes; ``overwrite`` rebuilds every checkpoint's index (``out_dir`` must still hold a trajectory index or
    nothing). An ``out_dir`` this call created is removed again if it fails before writing into it."""
    if cfg.rows.transcode or cfg.rows.basis != "raw" or cfg.optimizer_state:
        raise ValueError("TracIn sums GradDot over checkpoints: build raw rows (--transcode none, "
                         "--projection-basis raw, no --optimizer-state)")
    out = Path(out_dir)
    _refuse_foreign(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        entries = _build_checkpoints(ckpts, data, out, cfg, load, data_id, index, progress, overwrite)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    meta = {"kind": "tracin", "checkpoints": entries}
    tmp = out / (TRAJECTORY + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / TRAJECTORY)
    return meta


def _build_checkpoints(ckpts: list[Checkpoint], data: Tokenized, out: Path, cfg: BuildConfig, load, data_id: str,
                       index: IndexConfig | None, progress: bool, overwrite: bool) -> list[dict]:
    """:func:`build_trajectory`'s indices, one per checkpoint in order; ``overwrite``: the old
    ``trajectory.json`` and any checkpoint index past the new list's go first."""
    if overwrite:
        (out / TRAJECTORY).unlink(missing_ok=True)
        for p in out.glob("ckpt-*"):
            if p.is_dir() and int(p.name.removeprefix("ckpt-")) >= len(ckpts):
                shutil.rmtree(p)
    entries, first = [], None
    for i, c in enumerate(ckpts):
        model, tok = load(c.model)
        first = _same_layers(model, cfg.layers, first, ckpts[0].model, c.model)
        build_index(model, tok, data, out / f"ckpt-{i:02d}", cfg, index=index, model_id=c.model,
                    data_id=data_id, progress=progress, overwrite=overwrite)
        entries.append({"model": c.model, "lr": c.lr, "step": c.step, "index": f"ckpt-{i:02d}"})
    return entries


def _refuse_foreign(out: Path) -> None:
    """Refuse an ``out`` that holds anything but a trajectory index (or a killed one's checkpoint indices, which
    resume): an index or other files there would be shadowed by ``trajectory.json``."""
    keep = re.compile(rf"ckpt-\d+|{re.escape(TRAJECTORY)}(\.tmp)?|\.lock")
    other = sorted(p.name for p in out.iterdir() if not keep.fullmatch(p.name)) if out.is_dir() else []
    if other:
        raise FileExistsError(f"output directory {str(out)!r} holds other files than a trajectory index "
                              f"({', '.join(other[:3])}); choose another --out (nothing was written)")


def _same_layers(model, patterns, first: dict | None, first_dir: str, model_dir: str) -> dict:
    """The hooked layers' shapes of ``model``, refused unless they are ``first``'s (the first checkpoint's, when
    given): a trajectory's checkpoints are one model's training run."""
    from gradindex.capture.hooks import select_layers
    from gradindex.capture.layers import layer_info

    shapes = {n: (i.kind, i.n_in, i.n_out, i.bias)
              for n, i in ((n, layer_info(m)) for n, m in select_layers(model, list(patterns) or None).items())}
    if first is not None and shapes != first:
        differ = [n for n in {**first, **shapes} if first.get(n) != shapes.get(n)]
        raise ValueError(f"checkpoint {model_dir!r} is not the model of {first_dir!r}: its layers differ "
                         f"({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}); give the checkpoints of one "
                         "training run")
    return shapes


class TracInEngine:
    """Query engines of every checkpoint, answering ``tracin`` by the weighted sum of exact GradDot scores (the
    method's :attr:`~gradindex.methods.Method.engine`: ``gradindex query`` opens a directory it :meth:`opens` with
    it). ``options``: :class:`QueryEngine` options it has no use for (``model_dir``: each checkpoint has its own)."""

    @staticmethod
    def opens(index_dir: str | os.PathLike) -> bool:
        """Whether ``index_dir`` is a trajectory index (``trajectory.json``)."""
        return (Path(index_dir) / TRAJECTORY).is_file()

    def __init__(self, index_dir: str | os.PathLike, device: str = "auto", data: str | None = None, **options):
        self.dir = Path(index_dir)
        self.meta = json.loads((self.dir / TRAJECTORY).read_text())
        self.lrs = np.array([c["lr"] for c in self.meta["checkpoints"]], np.float64)
        self.engines = [QueryEngine(self.dir / c["index"], c["model"], device=device, data=data)
                        for c in self.meta["checkpoints"]]
        sizes = {e.n for e in self.engines}
        if len(sizes) != 1:
            raise ValueError(f"the checkpoints' indices hold different numbers of examples {sorted(sizes)}")
        self.n = sizes.pop()

    def scores(self, queries: list, layers=None, text_field: str = "text") -> np.ndarray:
        """``[Q, N]`` TracIn scores of every training example."""
        total = np.zeros((len(queries), self.n))
        for lr, e in zip(self.lrs, self.engines, strict=True):
            total += lr * e.scores(queries, "graddot", layers=layers, text_field=text_field)
        return total

    def query_batch(self, queries: list, k: int = 10, lowest: int = 0, layers=None, method: str | None = None,
                    text_field: str = "text", **options) -> list[QueryResult]:
        """Each query's top ``k`` (and ``lowest``) by :meth:`scores`; ``options``: settings it has no use for."""
        if method not in (None, "tracin"):
            raise ValueError(f"{str(self.dir)!r} is a trajectory index over checkpoints: it answers --method tracin, "
                             f"not {method}")
        s = self.scores(queries, layers, text_field)
        last = self.engines[-1]
        chosen = last.select_layers(layers)
        out = []
        for row in s:
            top = np.lexsort((np.arange(self.n), -row))[:k]
            ids = np.concatenate([top, np.lexsort((np.arange(self.n), row))[:lowest]]).astype(np.int64)
            texts = last.texts.texts(ids) if len(ids) else []
            hits = [Hit(int(i), float(row[i]), {}, t) for i, t in zip(ids, texts, strict=True)]
            out.append(QueryResult(hits[:len(top)], hits[len(top):], "tracin", None, chosen))
        return out

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def __enter__(self) -> TracInEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
