"""gradindex on the shared workload through its public API (run in gradindex's own venv).

``build``: :func:`gradindex.pipeline.build_index` (capture → store → the preconditioner fit, when
the method has one) into a temporary index directory (no FAISS indices: every score here is exact),
opened as a :class:`~gradindex.query.QueryEngine` on the workload's model; ``query_Q``:
:meth:`QueryEngine.scores` of the first ``Q`` query sequences (their gradients captured as the build
captured, preconditioned, exact scores streamed from the store). Projected methods store
16x16 = 256 numbers per layer; ``-full`` methods store the whole gradient (with Conv1D's bias
column): ``kfac-full``/``ekfac-full`` fit full-space curvature from the model (``FitConfig(space="full")``,
factors summed in the build pass) and precondition each query once; ``-full-store`` fit the same
curvature from the stored rows instead (dense float64 rotations of every stored gradient: slower).
``graddot-full`` also writes, untimed, the same scores without the bias column
(``scores_Q-nobias.npy``): the reference for peers that keep no bias gradient.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import Tokenized  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import DEFAULT_DAMPING, FitConfig, fit_preconditioner  # noqa: E402
from gradindex.query import QueryEngine  # noqa: E402


def without_bias(e: QueryEngine, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unprojected query rows with each layer's bias column (the last of ``[N_o, N_i + 1]``) zeroed:
    their inner products with the stored rows are the weight-only GradDot of peers without a bias column."""
    out = {}
    for n, g in grads.items():
        k_g, k_a = e.index.shapes[n]
        g = g.reshape(len(g), k_g, k_a).clone()
        g[..., -1] = 0
        out[n] = g.reshape(len(g), -1)
    return out


def built(w: Workload, d: str, cfg: BuildConfig, fit: FitConfig | None = None) -> QueryEngine:
    """The workload's training set built into ``d/index`` (and ``fit`` fitted), opened on the workload's model."""
    seqs = w.train.tolist()
    data = Tokenized(seqs, [list(s) for s in seqs], 0, "input_ids")
    tok, index = SimpleNamespace(pad_token_id=0), Path(d) / "index"
    build_index(w.model, tok, data, index, cfg, model_id=str(w.root / "model"), data_id="random", progress=False)
    if fit is not None:
        fit_preconditioner(index, fit, w.model, tok, data)
    return QueryEngine(index, model=w.model, pad_id=0)


def method(name: str, projection: str, precondition: str):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        cfg = BuildConfig.raw(projection=ProjectionSpec.parse(projection), max_length=w.train.shape[1],
                          batch_size=w.batch_size, precondition=precondition)
        out = {}
        with tempfile.TemporaryDirectory(prefix="gradindex-peers-") as d:
            with clock.phase("build"):
                e = built(w, d, cfg)
            with e:
                for q in queries:
                    with clock.phase(f"query_{q}"):
                        out[q] = e.scores(w.queries[:q], method=name)
                    if name == "graddot" and projection == "none":  # untimed: the reference of bias-free peers
                        grads, _, _ = e.gradients(e.tokenize(w.queries[:q].tolist()))
                        out[f"{q}-nobias"] = e.scores(without_bias(e, grads), method=name)
        return out

    return run


def full_space(name: str):
    """Full-space K-FAC / EK-FAC the cheap way: an unprojected store whose build pass also sums the full-space
    factors (``full_factors``), ``FitConfig(space="full")`` (eigendecompositions, plus EK-FAC's correction
    pass), then each query's full gradient preconditioned once and scored against every stored row."""

    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), max_length=w.train.shape[1],
                          batch_size=w.batch_size, full_factors=True)
        out = {}
        with tempfile.TemporaryDirectory(prefix="gradindex-peers-") as d:
            with clock.phase("build"):
                e = built(w, d, cfg, FitConfig(method=name, space="full"))
                pre = e.full_preconditioner(name)
            with e:
                for q in queries:
                    with clock.phase(f"query_{q}"):
                        grads, _, _ = e.gradients(e.tokenize(w.queries[:q].tolist()))
                        grads = {n: pre.apply(n, g.double(), -1.0, DEFAULT_DAMPING) for n, g in grads.items()}
                        out[q] = e.scores(grads, method="graddot")
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
