"""gradindex on the shared workload through its public API (run in gradindex's own venv).

``build``: :func:`gradindex.pipeline.build_index` (capture → store → the preconditioner fit, when
the method has one) into a temporary index directory (no FAISS indices: every score here is exact);
``query_Q``: the first ``Q`` query sequences' gradients, captured as the build captured (same layers
and projection, weight-free backward), then :func:`gradindex.query.scores.score_matrix`
(preconditioning, exact scores streamed from the store). Projected methods store
16x16 = 256 numbers per layer; ``-full`` methods store the whole gradient (with Conv1D's bias
column): ``kfac-full``/``ekfac-full`` fit full-space curvature from the model (``FitConfig(space="full")``,
factors summed in the build pass) and precondition each query once; ``-full-store`` fit the same
curvature from the stored rows instead (dense float64 rotations of every stored gradient: slower).
``graddot-full`` also writes, untimed, the same scores without the bias column
(``scores_Q-nobias.npy``): the reference for peers that keep no bias gradient.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[0:1] = [str(HERE.parent), str(HERE.parents[2])]  # common.py's folder and the repository, not this folder

import torch  # noqa: E402
from common import Clock, Workload, adapter_main  # noqa: E402

from gradindex.capture import GradientCapture, ProjectionSpec  # noqa: E402
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.data import Tokenized  # noqa: E402
from gradindex.index import OpenIndex  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner, load_full_preconditioner  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402


def query_gradients(ix: OpenIndex, model, ids: list[list[int]], batch_size: int) -> dict[str, torch.Tensor]:
    """layer → ``[Q, D]`` query rows, captured with the index's layers and projection."""
    parts = []
    with GradientCapture(model, ix.layers, ix.projection) as cap:
        for s in range(0, len(ids), batch_size):
            parts.append(batch_gradients(model, cap, ids[s:s + batch_size], ids[s:s + batch_size], 0).grads)
    return {n: torch.cat([p[n].float() for p in parts]) for n in ix.layers}


def without_bias(ix: OpenIndex, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unprojected query rows with each layer's bias column (the last of ``[N_o, N_i + 1]``) zeroed:
    their inner products with the stored rows are the weight-only GradDot of peers without a bias column."""
    out = {}
    for n, g in grads.items():
        k_g, k_a = ix.shapes[n]
        g = g.reshape(len(g), k_g, k_a).clone()
        g[..., -1] = 0
        out[n] = g.reshape(len(g), -1)
    return out


def method(name: str, projection: str, precondition: str):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        seqs = w.train.tolist()
        data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
        cfg = BuildConfig(projection=ProjectionSpec.parse(projection), max_length=w.train.shape[1],
                          batch_size=w.batch_size, precondition=precondition)
        out = {}
        with tempfile.TemporaryDirectory(prefix="gradindex-peers-") as d:
            with clock.phase("build"):
                build_index(w.model, SimpleNamespace(pad_token_id=0), data, Path(d) / "index", cfg,
                            model_id=str(w.root / "model"), data_id="random", progress=False)
                ix = OpenIndex(Path(d) / "index")
            try:
                for q in queries:
                    with clock.phase(f"query_{q}"):
                        grads = query_gradients(ix, w.model, w.queries[:q].tolist(), w.batch_size)
                        out[q] = score_matrix(ix, grads, method=name)
                    if name == "graddot" and projection == "none":  # untimed: the reference of bias-free peers
                        out[f"{q}-nobias"] = score_matrix(ix, without_bias(ix, grads), method=name)
            finally:
                ix.close()
        return out

    return run


def full_space(name: str):
    """Full-space K-FAC / EK-FAC the cheap way: an unprojected store whose build pass also sums the full-space
    factors (``full_factors``), ``FitConfig(space="full")`` (eigendecompositions, plus EK-FAC's correction
    pass), then each query's full gradient preconditioned once and scored against every stored row."""

    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        seqs = w.train.tolist()
        data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
        tok = SimpleNamespace(pad_token_id=0)
        cfg = BuildConfig(projection=ProjectionSpec.parse("none"), max_length=w.train.shape[1],
                          batch_size=w.batch_size, full_factors=True)
        out = {}
        with tempfile.TemporaryDirectory(prefix="gradindex-peers-") as d:
            index = Path(d) / "index"
            with clock.phase("build"):
                build_index(w.model, tok, data, index, cfg, model_id=str(w.root / "model"), data_id="random",
                            progress=False)
                fit_preconditioner(index, FitConfig(method=name, space="full"), w.model, tok, data)
                pre = load_full_preconditioner(index, name)
                ix = OpenIndex(index)
            try:
                for q in queries:
                    with clock.phase(f"query_{q}"):
                        grads = query_gradients(ix, w.model, w.queries[:q].tolist(), w.batch_size)
                        grads = {n: pre.apply(n, g.double(), -1.0, 0.1) for n, g in grads.items()}
                        out[q] = score_matrix(ix, grads, method="graddot")
            finally:
                ix.close()
        return out

    return run


METHODS = {
    "graddot-proj": method("graddot", "16x16", "none"),
    "kfac-proj": method("kfac", "16x16", "kfac"),
    "ekfac-proj": method("ekfac", "16x16", "ekfac"),
    "graddot-full": method("graddot", "none", "none"),
    "kfac-full": full_space("kfac"),
    "ekfac-full": full_space("ekfac"),
    "kfac-full-store": method("kfac", "none", "kfac"),
    "ekfac-full-store": method("ekfac", "none", "ekfac"),
}

if __name__ == "__main__":
    raise SystemExit(adapter_main(METHODS, ("gradindex",)))
