"""Full-space K-FAC / EK-FAC (two model passes) and full-space re-rank, against dense float64 references.

References are independent of the library's capture: per-example gradients by ``torch.func`` on a
float64 copy of the model, per-token factors by plain forward hooks + ``autograd.grad`` in float64,
curvature as dense matrices or in numpy eigenbases.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.func import functional_call, grad

from gradindex.capture import ProjectionSpec, layer_info, select_layers
from gradindex.capture.gram import add_gram, upper_to_symmetric
from gradindex.cli import main
from gradindex.data import collate, load_records, per_example_loss, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import FitConfig, fit_preconditioner, load_full_preconditioner
from gradindex.precondition import fullspace as fs
from gradindex.query import QueryEngine
from gradindex.spec.manifest import read_manifest

DAMPING = 0.1
QUERY = "the cat sat on a mat"


def _index(out, model_dir, data_path, **kw):
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(load_records(data_path), tok, 64)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4, seed=1), shard_size=16, max_length=64,
                      precondition="ekfac", **kw)
    build_index(model, tok, data, out, cfg, model_id=str(model_dir), data_id=str(data_path), progress=False)
    build_indices(out, IndexConfig(), progress=False)
    return out


class Reference:
    """Everything in float64, from a copy of the model: per-example G (torch.func) and per-token factors."""

    def __init__(self, model_dir, data_path):
        model, tok = load_causal_lm(model_dir, device="cpu")
        self.model = copy.deepcopy(model).double()
        self.tok = tok
        data = tokenize_records(load_records(data_path), tok, 64)
        self.train = list(zip(data.input_ids, data.labels, strict=True))
        self.layers = list(select_layers(self.model))
        q = tok(QUERY, add_special_tokens=False)["input_ids"]
        self.query = (q, q)
        self.G = [self._func_grads(x, y) for x, y in self.train]  # [N] of {layer: [N_o, N_i+1]}
        self.Gq = self._func_grads(*self.query)
        self.A, self.S = self._factors()

    def _func_grads(self, x, y) -> dict[str, np.ndarray]:
        params = {n: p.detach() for n, p in self.model.named_parameters()}

        def loss_fn(p):
            logits = functional_call(self.model, p, (torch.tensor([x]),)).logits
            return per_example_loss(logits, torch.tensor([y]))[0].sum()

        g = grad(loss_fn)(params)
        mods = select_layers(self.model)
        return {n: layer_info(m).weight_grad_to_G(g[n + ".weight"], g.get(n + ".bias")).numpy()
                for n, m in mods.items()}

    def _factors(self):
        mods = select_layers(self.model)
        A = {n: 0.0 for n in mods}
        S = {n: 0.0 for n in mods}
        tokens = 0
        for k, (x, y) in enumerate(self.train):
            rec = {}
            hs = [m.register_forward_hook(lambda m, i, o, n=n, rec=rec: rec.__setitem__(n, (i[0], o)))
                  for n, m in mods.items()]
            b = collate([x], [y], 0)
            logits = self.model(input_ids=b["input_ids"]).logits
            loss = per_example_loss(logits, b["labels"])[0].sum()
            outs = torch.autograd.grad(loss, [rec[n][1] for n in mods])
            for h in hs:
                h.remove()
            for (n, m), go in zip(mods.items(), outs, strict=True):
                a = rec[n][0][0].detach()
                if layer_info(m).bias:
                    a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
                g = go[0]
                A[n] = A[n] + (a.T @ a).numpy()
                S[n] = S[n] + (g.T @ g).numpy()
                # the per-token factors rebuild torch.func's gradient
                np.testing.assert_allclose((g.T @ a).numpy(), self.G[k][n],
                                           rtol=1e-8, atol=1e-10)
            tokens += len(x)
        return {n: v / tokens for n, v in A.items()}, {n: v / tokens for n, v in S.items()}

    def scores(self, method: str, Q: dict | None = None, Lam: dict | None = None) -> np.ndarray:
        """``[N]`` full-space scores: K-FAC in numpy eigenbases of the reference factors, EK-FAC from ``Q``, ``Lam``."""
        selfnorm = method.endswith("-selfnorm")
        base = method.removesuffix("-selfnorm")
        dots, sq = np.zeros(len(self.G)), np.zeros(len(self.G))
        for n in self.layers:
            Gq = self.Gq[n]
            T = np.stack([G[n] for G in self.G])  # [N, N_o, N_i+1]
            if base in ("graddot", "cosine"):
                dots += (T * Gq).sum((1, 2))
                sq += (T * T).sum((1, 2))
                continue
            if base == "kfac":
                lam_S, Q_S = np.linalg.eigh(self.S[n])
                lam_A, Q_A = np.linalg.eigh(self.A[n])
                L = np.outer(lam_S, lam_A)
            else:
                Q_S, Q_A = Q[n]
                L = Lam[n]
            d = DAMPING * L.mean()
            w = 1.0 / np.maximum(L + d, d / 2)
            Rq = Q_S.T @ Gq @ Q_A
            R = Q_S.T @ T @ Q_A
            dots += (R * (Rq * w)).sum((1, 2))
            sq += (R * R * w).sum((1, 2))
        if base == "cosine":
            qn = np.sqrt(sum((self.Gq[n] ** 2).sum() for n in self.layers))
            return dots / qn / np.sqrt(sq)
        return dots / np.sqrt(sq) if selfnorm else dots


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request, tmp_path_factory, text_jsonl):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    d = _index(tmp_path_factory.mktemp("fs") / "idx", model_dir, text_jsonl)
    res = CliRunner().invoke(main, ["precondition", str(d), "--method", "ekfac", "--space", "full", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "full-space re-rank methods now: graddot, cosine, kfac, ekfac" in res.output
    return d, Reference(model_dir, text_jsonl)


def _rel(got, ref):
    return np.abs(np.asarray(got) - ref).max() / np.abs(ref).max()


def test_full_space_factors_and_correction_equal_dense_float64(case):
    d, ref = case
    kf, ek = load_full_preconditioner(d, "kfac"), load_full_preconditioner(d, "ekfac")
    import h5py

    with h5py.File(fs.full_path(d, "ekfac"), "r") as f:
        for n in ref.layers:
            L = f["layers"][n]
            assert "A" not in L and "S" not in L  # (full-space files keep the eigen-decomposition only)
            A = L["Q_A"][:] @ np.diag(L["lambda_A"][:]) @ L["Q_A"][:].T
            S = L["Q_S"][:] @ np.diag(L["lambda_S"][:]) @ L["Q_S"][:].T
            assert _rel(A, ref.A[n]) < 1e-5 and _rel(S, ref.S[n]) < 1e-5
    for n in ref.layers:
        Q_S, Q_A = ek.curvature[n]["Q_S"], ek.curvature[n]["Q_A"]
        # Λ*_ij = mean_n (Q_Sᵀ G_n Q_A)²_ij from torch.func's dense gradients, in the fitted basis
        lam = np.mean([(Q_S.T @ G[n] @ Q_A) ** 2 for G in ref.G], axis=0)
        assert _rel(ek.curvature[n]["Lambda"], lam) < 1e-4, n
        np.testing.assert_array_equal(kf.curvature[n]["Q_S"], Q_S)
    m = read_manifest(d)
    assert set(m["full_space"]) == {"kfac", "ekfac"} and m["full_space"]["ekfac"]["fit"]["examples"] == 40
    assert not (d / "precond" / fs.STATE).exists()


@pytest.mark.parametrize("method", ["graddot", "cosine", "kfac", "ekfac", "ekfac-selfnorm"])
def test_full_space_rerank_equals_dense_reference(case, method):
    d, ref = case
    ek = load_full_preconditioner(d, "ekfac")
    Q = {n: (ek.curvature[n]["Q_S"], ek.curvature[n]["Q_A"]) for n in ref.layers}
    Lam = {n: np.mean([(Q[n][0].T @ G[n] @ Q[n][1]) ** 2 for G in ref.G], axis=0) for n in ref.layers}
    truth = ref.scores(method, Q, Lam)
    with QueryEngine(d, device="cpu") as e:
        r = e.query(QUERY, k=10, method=method, damping=DAMPING, rerank_full=len(ref.G))  # every example
    ids = [h.id for h in r.hits]
    got = [h.full_score for h in r.hits]
    assert np.abs(np.array(got) - truth[ids]).max() < 1e-4 * np.abs(truth).max()
    assert ids == np.argsort(-truth, kind="stable")[:10].tolist()  # = exhaustive full-space top-10
    assert got == sorted(got, reverse=True) and len(r.hits) == 10


def test_kfac_full_space_matches_dense_kronecker_inverse(case):
    """One small layer: ``(S ⊗ A + δI)⁻¹`` as a dense matrix, solved directly."""
    d, ref = case
    n = next(n for n in ref.layers if ref.Gq[n].size <= 1100)
    kf = load_full_preconditioner(d, "kfac")
    H = np.kron(ref.S[n], ref.A[n])
    delta = DAMPING * np.outer(np.linalg.eigvalsh(ref.S[n]), np.linalg.eigvalsh(ref.A[n])).mean()
    want = np.linalg.solve(H + delta * np.eye(len(H)), ref.Gq[n].reshape(-1))
    got = kf.apply(n, torch.from_numpy(ref.Gq[n].reshape(1, -1)), -1.0, DAMPING)[0].numpy()
    assert _rel(got, want) < 1e-6


def test_rerank_of_a_few_candidates_and_errors(case):
    d, ref = case
    with QueryEngine(d, device="cpu") as e:
        r = e.query(QUERY, k=3, method="kfac", rerank_full=6)
        assert len(r.hits) == 3 and all(h.full_score is not None for h in r.hits)
        with pytest.raises(ValueError, match="rerank_full must be >= 0"):
            e.query(QUERY, rerank_full=-1)


def test_no_full_space_fit_is_a_clear_error(tmp_path, gpt2_dir, text_jsonl):
    d = _index(tmp_path / "idx", gpt2_dir, text_jsonl)
    res = CliRunner().invoke(main, ["query", str(d), "--text", QUERY, "--method", "ekfac", "--rerank-full", "5"])
    assert res.exit_code != 0 and "Error: " in res.output and "--space full" in res.output, res.output


@pytest.mark.parametrize("stage", ["factors", "correction"])
def test_killed_full_space_fit_resumes(tmp_path, gpt2_dir, text_jsonl, monkeypatch, stage):
    """Killed part-way through either model pass (the factor pass checkpoints upper-triangle sums and its
    head gradients are lost), a re-run resumes and writes the same curvature as an uninterrupted fit."""
    d = _index(tmp_path / "idx", gpt2_dir, text_jsonl)
    ref_dir = tmp_path / "ref"
    shutil.copytree(d, ref_dir)
    fit_preconditioner(ref_dir, FitConfig(method="ekfac", space="full"))
    calls = {"n": 0}
    visitor = fs._FactorSums if stage == "factors" else fs._CorrectionSums
    real = visitor.__call__

    def dying(self, name, a, g):
        calls["n"] += 1
        if calls["n"] > 12:  # part-way through the pass
            raise KeyboardInterrupt
        real(self, name, a, g)

    monkeypatch.setattr(visitor, "__call__", dying)
    monkeypatch.setattr(fs, "_State", _EagerState)
    with pytest.raises(KeyboardInterrupt):
        fit_preconditioner(d, FitConfig(method="ekfac", space="full"))
    state = np.load(d / "precond" / fs.STATE)
    assert str(state["stage"]) == stage and 0 < int(state["done"]) < 40
    monkeypatch.setattr(visitor, "__call__", real)
    fit_preconditioner(d, FitConfig(method="ekfac", space="full"))
    a, b = load_full_preconditioner(d, "ekfac"), load_full_preconditioner(ref_dir, "ekfac")
    import h5py

    with h5py.File(fs.full_path(d, "ekfac"), "r") as fa, h5py.File(fs.full_path(ref_dir, "ekfac"), "r") as fb:
        for n in a.layers:
            np.testing.assert_allclose(a.curvature[n]["Lambda"], b.curvature[n]["Lambda"], rtol=1e-10, atol=0)
            for key in ("lambda_A", "lambda_S"):
                np.testing.assert_allclose(fa["layers"][n][key][:], fb["layers"][n][key][:], rtol=1e-12, atol=0)


def test_factors_from_the_build_pass_skip_the_factor_pass(tmp_path, gpt2_dir, text_jsonl):
    a = _index(tmp_path / "a", gpt2_dir, text_jsonl, full_factors=True)
    b = _index(tmp_path / "b", gpt2_dir, text_jsonl)
    ea = fit_preconditioner(a, FitConfig(method="ekfac", space="full"))["ekfac"]
    fit_preconditioner(b, FitConfig(method="ekfac", space="full"))
    assert ea["fit"]["source"] == "build pass + model pass" and "factor_pass" not in ea["fit"]["phase_seconds"]
    import h5py

    fa, fb = h5py.File(fs.full_path(a, "ekfac"), "r"), h5py.File(fs.full_path(b, "ekfac"), "r")
    with fa, fb:
        for n in fa["layers"]:  # same sums up to float32 summation order; Σ Λ* = mean ‖G‖² in any basis
            for key in ("lambda_A", "lambda_S"):
                assert _rel(fa["layers"][n][key][:], fb["layers"][n][key][:]) < 1e-5, (n, key)
            assert fa["layers"][n]["Lambda"][:].sum() == pytest.approx(fb["layers"][n]["Lambda"][:].sum(), rel=1e-5)


class _EagerState(fs._State):
    def __init__(self, path, key, every):
        super().__init__(path, key, 0.0)


@pytest.mark.parametrize("block", [3, 7, 64])  # blocks that do not divide the width; one block
def test_gram_by_upper_blocks_equals_the_full_product(block):
    g = torch.Generator().manual_seed(0)
    acc = torch.zeros(20, 20, dtype=torch.float64)
    xs = [torch.randn(50, 20, generator=g) for _ in range(3)]
    for x in xs:
        add_gram(acc, x, block)
    want = sum((x.double().T @ x.double()).numpy() for x in xs)
    got = upper_to_symmetric(acc.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got, got.T)


def count_head_use(monkeypatch) -> list[tuple[bool, bool]]:
    """Per model-pass batch of the full-space fit, from now on: (keeps its head gradient, replays one)."""
    calls = []
    real = fs.batch_gradients

    def counting(*args, **kw):
        calls.append((kw.get("keep_head_grad", False), kw.get("head_grad") is not None))
        return real(*args, **kw)

    monkeypatch.setattr(fs, "batch_gradients", counting)
    return calls


def test_correction_pass_replays_the_head_gradients_of_the_factor_pass(tmp_path, gpt2_dir, text_jsonl, monkeypatch):
    d = _index(tmp_path / "idx", gpt2_dir, text_jsonl)
    calls = count_head_use(monkeypatch)
    fit_preconditioner(d, FitConfig(method="ekfac", space="full"))
    half = len(calls) // 2
    assert calls == [(True, False)] * half + [(False, True)] * half and half == 5  # 40 examples, batches of 8
    calls.clear()
    monkeypatch.setattr(fs, "HEAD_CACHE_BYTES", 0)  # nothing fits: the correction pass runs the head itself
    fit_preconditioner(d, FitConfig(method="ekfac", space="full"))
    assert calls[half:] == [(False, False)] * half


def test_correction_from_a_sample_equals_dense_float64_over_it(case, tmp_path):
    """``--correction-examples K``: the factors from every example, ``Λ*`` from a seeded sample of K of them,
    against torch.func's dense gradients of exactly those examples (and not of all 40)."""
    from gradindex.precondition.factors import sample_rows

    src, ref = case
    d = tmp_path / "idx"
    shutil.copytree(src, d)
    res = CliRunner().invoke(main, ["precondition", str(d), "--method", "ekfac", "--space", "full",
                                    "--correction-examples", "12", "--seed", "3", "--quiet"])
    assert res.exit_code == 0, res.output
    fit = read_manifest(d)["full_space"]["ekfac"]["fit"]
    assert fit["examples"] == 40 and fit["correction_examples"] == 12 and fit["correction_seed"] == 3
    ek, every = load_full_preconditioner(d, "ekfac"), load_full_preconditioner(src, "ekfac")
    picked = sample_rows(40, 12, 3)
    factors = fs.read_layers(fs.full_path(d, "ekfac"), ("lambda_S",))
    for n in ref.layers:
        Q_S, Q_A = ek.curvature[n]["Q_S"], ek.curvature[n]["Q_A"]
        assert _rel(Q_S @ np.diag(factors[n]["lambda_S"]) @ Q_S.T, ref.S[n]) < 1e-5  # factors: all 40
        lam = np.mean([(Q_S.T @ ref.G[k][n] @ Q_A) ** 2 for k in picked], axis=0)
        assert _rel(ek.curvature[n]["Lambda"], lam) < 1e-4, n
        assert _rel(every.curvature[n]["Lambda"], lam) > 1e-2, n  # (the sample's mean is not all 40's)


def test_kfac_file_keeps_its_eigenvalues_and_shares_the_ekfac_bases(case, tmp_path):
    """An EK-FAC fit's K-FAC file holds ``λ_S``, ``λ_A`` only; its bases are read from the EK-FAC file, and a
    missing EK-FAC file is a clear error naming the refit."""
    import h5py

    src, ref = case
    with h5py.File(fs.full_path(src, "kfac"), "r") as f:
        assert f.attrs[fs.BASES] == "ekfac-full.h5"
        assert all(set(f["layers"][n]) == {"lambda_A", "lambda_S"} for n in ref.layers)
    assert fs.full_path(src, "kfac").stat().st_size < fs.full_path(src, "ekfac").stat().st_size / 4
    d = tmp_path / "idx"
    shutil.copytree(src, d)
    fs.full_path(d, "ekfac").unlink()
    with pytest.raises(FileNotFoundError, match="--method ekfac --space full"):
        load_full_preconditioner(d, "kfac")


def test_correction_examples_are_refused_outside_full_space():
    with pytest.raises(ValueError, match="--space full"):
        FitConfig(method="ekfac", correction_examples=8)
    with pytest.raises(ValueError, match=">= 0"):
        FitConfig(method="ekfac", space="full", correction_examples=-1)
