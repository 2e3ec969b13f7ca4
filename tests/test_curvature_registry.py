"""A method with its own curvature is one registration: a diagonal empirical Fisher defined and registered in this
test file alone (a :class:`~gradindex.precondition.Curvature` and a :class:`~gradindex.methods.Method`) is fitted
by the ordinary precondition path (``gradindex precondition``), listed where methods are, and scored by
``QueryEngine`` as a dense float64 reference computed here from the stored rows says. K-FAC and EK-FAC, behind the
same protocol, keep their files and their arithmetic (the pre-protocol computation, written out here)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import raw_tiny_index

from gradindex import methods as M
from gradindex.cli import main
from gradindex.precondition import Curvature, FitJob, absolute_damping, load_preconditioner, self_influence
from gradindex.precondition.apply import eigen_power
from gradindex.precondition.ekfac import Basis, store_pass
from gradindex.precondition.files import precond_path, read_layers
from gradindex.store import Store

TEXTS = ["the cat sat on a mat", "red sun over green hills", "some dog ran far away from home"]


@dataclass
class Diagonal:
    """One layer's fitted diagonal (``write_precond`` writes ``Lambda``, ``tokens``, ``examples``)."""

    Lambda: np.ndarray
    tokens: int
    examples: int


class DiagFisher(Curvature):
    """``H = diag(mean_n Ĝ_n²)`` over the finite stored rows, per layer; ``(H + δI)^p x = x ⊙ (d + δ)^p``."""

    @classmethod
    def fit(cls, job: FitJob, **options):
        store, shapes = job.store, job.shapes
        finite = store.column("finite").astype(bool)
        sums = {n: np.zeros(shapes[n]) for n in job.layers}
        for ids, grads in store.iter_blocks(job.layers, 16):
            keep = finite[store.positions(ids)]
            for n in job.layers:
                sums[n] += np.square(grads[n][keep].astype(np.float64)).sum(0).reshape(shapes[n])
        count = int(finite.sum())
        diag = {n: Diagonal(s / count, 0, count) for n, s in sums.items()}
        si = np.zeros((len(store), len(job.layers)))
        for ids, grads in store.iter_blocks(job.layers, 16):
            for j, n in enumerate(job.layers):
                w = 1.0 / (diag[n].Lambda.reshape(-1) + absolute_damping(job.cfg.damping, diag[n].Lambda))
                si[store.positions(ids), j] = np.square(grads[n].astype(np.float64)) @ w
        return {"diagfisher": (diag, si)}, {"source": "store rows", "examples": count}

    @staticmethod
    def power(x, tensors, delta, power):
        return x * (tensors[0].reshape(1, -1) + delta).pow(power)


@pytest.fixture
def diagfisher():
    spec = M.register(M.Method("diagfisher", fitted="diagfisher", self_influence="preconditioned",
                               row_bases={"raw": "diagfisher"}, apps=frozenset({"query"}), curvature=DiagFisher,
                               summary="a diagonal empirical Fisher (test-only)"))
    yield spec
    del M.REGISTRY[spec.name]


@pytest.fixture(scope="module")
def raw_index(tmp_path_factory, gpt2_dir, text_jsonl):
    """Raw float32 rows of 40 examples (projected 8 x 8), nothing fitted, the store tier built."""
    return raw_tiny_index(tmp_path_factory.mktemp("diag") / "index", gpt2_dir, text_jsonl, 5, "none", 48)

def _rows(index) -> dict[str, np.ndarray]:
    with Store(index) as st:
        return {n: np.concatenate([b[n] for _, b in st.iter_blocks([n], 16)]).astype(np.float64) for n in st.layers}


def test_a_test_only_curvature_is_fitted_and_queried_as_its_dense_reference(diagfisher, raw_index):
    from gradindex.query import QueryEngine

    res = CliRunner().invoke(main, ["precondition", str(raw_index), "--method", "diagfisher", "--damping", "0.01"])
    assert res.exit_code == 0, res.output
    assert "diagfisher" in M.methods_of(json.loads((raw_index / "manifest.json").read_text()), raw_index)
    with h5py.File(precond_path(raw_index, "diagfisher"), "r") as f:
        assert f.attrs["method"] == "diagfisher" and set(f) == {"layers", "self_influence", "self_influence_layers"}

    rows = _rows(raw_index)
    with QueryEngine(raw_index, device="cpu", use_gpu=False) as e:
        grads, _, _ = e.gradients(e.tokenize(TEXTS))
        for damping in (0.01, 0.2):  # the fit's own (self-influence read from its file), another (computed)
            q = {n: grads[n].double().numpy() for n in rows}
            H = {n: np.diag(np.square(t[np.isfinite(t).all(1)]).mean(0)) for n, t in rows.items()}  # dense, [D, D]
            Hd = {n: h + absolute_damping(damping, np.diag(h)) * np.eye(len(h)) for n, h in H.items()}
            want = sum(np.linalg.solve(Hd[n], q[n].T).T @ rows[n].T for n in rows)  # Σ_l ⟨(H + δI)⁻¹ q, t⟩
            si = sum(np.einsum("ij,ji->i", rows[n], np.linalg.solve(Hd[n], rows[n].T)) for n in rows)
            np.testing.assert_allclose(e.scores(TEXTS, method="diagfisher", damping=damping), want, rtol=1e-6)
            np.testing.assert_allclose(self_influence(raw_index, "diagfisher", damping, device="cpu"), si, rtol=1e-9)
            normed = want / np.sqrt(si)[None, :]
            np.testing.assert_allclose(e.scores(TEXTS, method="diagfisher-selfnorm", damping=damping), normed,
                                       rtol=1e-6)
            for method, ref in (("diagfisher", want), ("diagfisher-selfnorm", normed)):
                for r, row in zip(e.query_batch(TEXTS, k=5, method=method, damping=damping), ref, strict=True):
                    assert [h.id for h in r.hits] == list(np.argsort(-row, kind="stable")[:5])
                    np.testing.assert_allclose([h.score for h in r.hits], np.sort(row)[::-1][:5], rtol=1e-6)


def test_kfac_and_ekfac_keep_their_files_and_arithmetic(audit_index):
    """Behind the protocol, a K-FAC/EK-FAC fit's file holds what format 1 lists, and applying it is the
    pre-protocol arithmetic bit for bit: ``eigen_power`` of the file's ``Q_S, Q_A, Λ`` at ``δ = d · mean(Λ)``,
    and self-influence one ``store_pass`` over those bases (indices built before open and score the same)."""
    keys = {"A", "S", "lambda_A", "Q_A", "lambda_S", "Q_S", "Lambda"}
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with Store(audit_index) as st:
        layers, shapes = list(st.layers), {n: (8, 8) for n in st.layers}
        for method in ("kfac", "ekfac"):
            with h5py.File(precond_path(audit_index, method), "r") as f:
                assert {k for n in f["layers"] for k in f["layers"][n]} == keys
                assert set(f) == {"layers", "self_influence", "self_influence_layers"}
            curv, P = read_layers(precond_path(audit_index, method)), load_preconditioner(audit_index, method)
            for n in layers:
                c = {k: torch.as_tensor(v) for k, v in curv[n].items()}
                delta = absolute_damping(0.05, curv[n]["Lambda"])
                for power in (-1.0, -0.5, 0.5):
                    assert torch.equal(P.apply(n, x, power, 0.05), eigen_power(x, c["Q_S"], c["Q_A"], c["Lambda"],
                                                                             delta, power))
            bases = {n: Basis(curv[n]["Q_S"], curv[n]["Q_A"], curv[n]["Lambda"],
                              absolute_damping(0.05, curv[n]["Lambda"])) for n in layers}
            want = store_pass(st, layers, shapes, bases).self_influence.sum(axis=1)
            np.testing.assert_array_equal(self_influence(audit_index, method, 0.05, device="cpu"), want)


def test_fitted_lists_follow_the_registry(diagfisher):
    assert "diagfisher" in M.names("fitted") and "diagfisher" in M.names("indexed")
    assert "diagfisher-selfnorm" in M.all_methods_of_rows()
    res = CliRunner().invoke(main, ["precondition", "nowhere", "--method", "nothing"])
    assert res.exit_code == 2 and "diagfisher" in res.output  # a --method choice of `gradindex precondition`
