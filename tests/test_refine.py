"""Query refinement against independent computations: a dense Gauss-Newton matrix from torch.func
Jacobians, a dense linear solve, and plain EK-FAC queries."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, jacfwd

from gradindex.capture import GradientCapture, ProjectionSpec, RowSpace
from gradindex.data import IGNORE, load_records, tokenize_records
from gradindex.index import build_indices
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.refine import (
    GaussNewton,
    RefineConfig,
    eager_attention,
    largest_eigenvalue,
    preconditioner_curvature,
    refine_solve,
    sampled_labels,
)

LAYERS = ("transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj")
QUERIES = ["the cat sat on a mat", "dog ran far away from home"]
N_TRAIN = 8
MAX_LEN = 12
DAMPING = 0.1
"""Of the converged comparison (the eigenbasis index bakes it in): well enough conditioned for 30 CG steps."""


def _data(tok, train_jsonl):
    return tokenize_records(load_records(train_jsonl), tok, MAX_LEN)


@pytest.fixture(scope="module")
def train_jsonl(tmp_path_factory, text_jsonl):
    p = tmp_path_factory.mktemp("refine-data") / "train.jsonl"
    p.write_text("".join(text_jsonl.read_text().splitlines(keepends=True)[:N_TRAIN]))
    return p


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A GPT-2 narrow enough (width 16) for a dense Gauss-Newton matrix of two layers in a second."""
    from fixtures.tiny import save_model_dir, tiny_gpt2

    return save_model_dir(tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=16, n_head=2, seed=4),
                          tokenizer, tmp_path_factory.mktemp("gpt2-16"))


def dense_ggn(model, ids, labels, pad_id) -> np.ndarray:
    """``mean_n J_nᵀ (diag p − p pᵀ) J_n`` over the examples, in the stacked ``[N_o, N_i+1]`` layout of LAYERS,
    from full Jacobians of the logits (Conv1D: weight = G[:, :-1]ᵀ, bias = G[:, -1])."""
    mods = dict(model.named_modules())
    sizes = [mods[n].weight.shape[1] * (mods[n].weight.shape[0] + 1) for n in LAYERS]
    theta = torch.cat([torch.cat([mods[n].weight.T, mods[n].bias[:, None]], 1).reshape(-1) for n in LAYERS])
    H = torch.zeros(len(theta), len(theta), dtype=torch.float64)
    for x, y in zip(ids, labels, strict=True):  # one example at a time, unpadded
        inp = torch.tensor([x])

        def logits(th, inp=inp):
            params, o = {}, 0
            for n, s in zip(LAYERS, sizes, strict=True):
                G = th[o:o + s].reshape(mods[n].weight.shape[1], -1)
                params[f"{n}.weight"], params[f"{n}.bias"] = G[:, :-1].T, G[:, -1]
                o += s
            return functional_call(model, params, (inp,), {"use_cache": False}).logits[0]

        with eager_attention(model):
            z = logits(theta).double()  # [T, V]
            J = jacfwd(logits)(theta).double()  # [T, V, D]
        keep = [t for t in range(len(x) - 1) if y[t + 1] != IGNORE]
        p = torch.softmax(z[keep], -1)  # [T', V]
        Jk = J[keep]  # [T', V, D]
        root = (Jk * p.sqrt()[..., None]).reshape(-1, len(theta))  # J_tᵀ diag(p) J_t = rootᵀ root
        Jp = torch.einsum("tvd,tv->td", Jk, p)  # J_tᵀ p
        H += root.T @ root - Jp.T @ Jp
    return (H / len(ids)).numpy()


@pytest.fixture(scope="module")
def setup(model_dir, train_jsonl):
    model, tok = load_causal_lm(model_dir, device="cpu")
    model = model.double().requires_grad_(False)
    data = _data(tok, train_jsonl)
    return model, tok, data, dense_ggn(model, data.input_ids, data.labels, tok.pad_token_id)


def _index(model_dir, train_jsonl, out, **kw):
    model, tok = load_causal_lm(model_dir, device="cpu")
    cfg = BuildConfig.raw(projection=ProjectionSpec(kind="none"), layers=LAYERS, precondition="ekfac",
                      max_length=MAX_LEN, **kw)
    build_index(model, tok, _data(tok, train_jsonl), out, cfg, model_id=str(model_dir), data_id=str(train_jsonl),
                progress=False)
    build_indices(out, progress=False)
    return out


@pytest.fixture(scope="module")
def raw_index(model_dir, train_jsonl, tmp_path_factory):
    return _index(model_dir, train_jsonl, tmp_path_factory.mktemp("refine") / "raw")


@pytest.fixture(scope="module")
def eigen_index(model_dir, train_jsonl, tmp_path_factory):
    return _index(model_dir, train_jsonl, tmp_path_factory.mktemp("refine") / "eigen", transcode="ekfac",
                  damping=DAMPING)


def test_gauss_newton_product_matches_dense_ggn(setup):
    model, tok, data, H = setup
    cap = GradientCapture(model, list(LAYERS))
    space = RowSpace(ProjectionSpec(kind="none")).bind(cap.infos)
    ggn = GaussNewton(model, cap.modules, cap.infos, tok.pad_token_id, data.input_ids, data.labels, batch=5)
    g = torch.Generator().manual_seed(0)
    V = {n: torch.randn(space.dims(n), generator=g, dtype=torch.float64) for n in LAYERS}
    HV = ggn.product(V)
    got = np.concatenate([HV[n].numpy().reshape(-1) for n in LAYERS])
    want = H @ np.concatenate([V[n].numpy().reshape(-1) for n in LAYERS])
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10 * np.abs(want).max())


def _query_grads(engine, texts):
    tokens = engine.tokenize([{"text": t} for t in texts])
    return tokens, engine.gradients(tokens)[0]


def test_zero_steps_is_plain_ekfac_exactly(raw_index, eigen_index):
    for d in (raw_index, eigen_index):
        with QueryEngine(d, device="cpu") as e:
            plain = e.scores(QUERIES, method="ekfac")
            zero = e.scores(QUERIES, method="ekfac", refine=RefineConfig(steps=0, damping=None))
            assert np.array_equal(plain, zero)
            a = e.query_batch(QUERIES, k=5, method="ekfac", texts=False)
            b = e.query_batch(QUERIES, k=5, method="ekfac", texts=False, refine=RefineConfig(steps=0, damping=None))
            assert [[(h.id, h.score) for h in r.hits] for r in a] == [[(h.id, h.score) for h in r.hits] for r in b]


@pytest.mark.parametrize("method", ["cg", "neumann"])
def test_more_steps_lower_the_residual_against_dense_ggn(setup, raw_index, method):
    _, _, _, H = setup
    with QueryEngine(raw_index, device="cpu") as e:
        tokens, grads = _query_grads(e, QUERIES[:1])
        curv = {n: preconditioner_curvature(e.pre.get("ekfac"), n, 1e-3) for n in LAYERS}
        A = H + np.diag(np.concatenate([np.full(e.space.dim(n), curv[n].delta) for n in LAYERS]))
        g = {n: grads[n][0].double() for n in LAYERS}
        gv = np.concatenate([g[n].numpy() for n in LAYERS])

        def hvp(x):  # the dense reference's product, so this checks the solver alone
            y = H @ np.concatenate([x[n].numpy() for n in LAYERS])
            o = np.cumsum([0] + [e.space.dim(n) for n in LAYERS])
            return {n: torch.from_numpy(y[o[i]:o[i + 1]]) for i, n in enumerate(LAYERS)}

        Pinv = np.concatenate([np.concatenate([curv[n].solve(torch.eye(e.space.dim(n), dtype=torch.float64)).numpy()
                                               if m == n else np.zeros((e.space.dim(m), e.space.dim(n)))
                                               for n in LAYERS], 1) for m in LAYERS], 0)
        lam_max = np.linalg.eigvals(Pinv @ A).real.max()
        assert lam_max > 2  # a Neumann step of 1 would diverge: the step must come from the spectrum
        assert largest_eigenvalue(g, curv, hvp) == pytest.approx(lam_max, rel=0.5)
        res = []
        for steps in (0, 1, 2, 4, 8):
            x, _ = refine_solve(g, curv, hvp, steps, method)
            xv = np.concatenate([x[n].numpy() for n in LAYERS])
            res.append(np.linalg.norm(A @ xv - gv))
        assert all(b < a for a, b in zip(res, res[1:])), res
        assert res[-1] < 0.5 * res[0], res


def _dense_hvp(H, dims):
    def hvp(x):
        y = H @ np.concatenate([x[n].numpy() for n in LAYERS])
        o = np.cumsum([0] + [dims[n] for n in LAYERS])
        return {n: torch.from_numpy(y[o[i]:o[i + 1]]) for i, n in enumerate(LAYERS)}
    return hvp


def test_refined_scores_match_the_dense_reference_on_raw_and_eigenbasis_rows(setup, raw_index, eigen_index):
    """The engine's refined scores (the model's own Gauss-Newton products, the stored rows) equal
    ``⟨x_k, g_t⟩`` of the same iterations on the dense matrix, on raw rows (preconditioned at query time) and on
    rows in the EK-FAC whitened eigenbasis (the refined vector mapped through the basis); and they move towards
    the dense solve ``⟨(H + δI)⁻¹ g_q, g_t⟩`` (closer than plain EK-FAC)."""
    _, _, _, H = setup
    cfg = RefineConfig(method="cg", steps=6, sample=N_TRAIN, batch=6, damping=None)
    with QueryEngine(raw_index, device="cpu") as e:
        tokens, grads = _query_grads(e, QUERIES)
        dims = {n: e.space.dim(n) for n in LAYERS}
        curv = {n: preconditioner_curvature(e.pre.get("ekfac"), n, DAMPING) for n in LAYERS}
        A = H + np.diag(np.concatenate([np.full(dims[n], curv[n].delta) for n in LAYERS]))
        T = np.concatenate([e.store.read_rows(np.arange(e.n), list(LAYERS))[n].astype(np.float64) for n in LAYERS], 1)
        G = np.concatenate([grads[n].double().numpy() for n in LAYERS], 1)  # [Q, D]
        X = []
        for j in range(len(QUERIES)):
            x, _ = refine_solve({n: grads[n][j].double() for n in LAYERS}, curv, _dense_hvp(H, dims), cfg.steps, "cg")
            X.append(np.concatenate([x[n].numpy() for n in LAYERS]))
        want = np.array(X) @ T.T  # [Q, N]
        exact = np.linalg.solve(A, G.T).T @ T.T
        plain = e.scores(QUERIES, method="ekfac", damping=DAMPING)
        raw = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=cfg)
    with QueryEngine(eigen_index, device="cpu") as e:
        eig = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=cfg)
    scale = np.abs(want).max()
    np.testing.assert_allclose(raw, want, atol=1e-4 * scale)
    np.testing.assert_allclose(eig, want, atol=1e-3 * scale)  # rows rotated and scaled in float32
    assert np.linalg.norm(raw - exact) < 0.5 * np.linalg.norm(plain - exact)


def test_refine_damping_solves_at_its_own_damping_on_raw_and_eigenbasis_rows(setup, raw_index, eigen_index):
    """``RefineConfig(damping=d)`` solves ``(H + δ_d I) x = g`` from ``P_d⁻¹ g`` (the index's EK-FAC at damping d),
    scored against rows stored at another damping: it equals the dense iterations at ``d``, on raw and eigenbasis
    rows; ``d`` equal to the query's damping changes nothing."""
    _, _, _, H = setup
    d2 = 10 * DAMPING
    cfg = RefineConfig(method="cg", steps=3, sample=N_TRAIN, batch=6, damping=None)
    with QueryEngine(raw_index, device="cpu") as e:
        tokens, grads = _query_grads(e, QUERIES)
        dims = {n: e.space.dim(n) for n in LAYERS}
        curv = {n: preconditioner_curvature(e.pre.get("ekfac"), n, d2) for n in LAYERS}
        T = np.concatenate([e.store.read_rows(np.arange(e.n), list(LAYERS))[n].astype(np.float64) for n in LAYERS], 1)
        X = [np.concatenate([x[n].numpy() for n in LAYERS]) for x, _ in
             (refine_solve({n: grads[n][j].double() for n in LAYERS}, curv, _dense_hvp(H, dims), cfg.steps, "cg")
              for j in range(len(QUERIES)))]
        want = np.array(X) @ T.T
        raw = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=replace(cfg, damping=d2))
        same = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=replace(cfg, damping=DAMPING))
        np.testing.assert_allclose(same, e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=cfg), rtol=1e-6,
                                   atol=1e-9 * np.abs(same).max())
    with QueryEngine(eigen_index, device="cpu") as e:
        eig = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=replace(cfg, damping=d2))
    scale = np.abs(want).max()
    np.testing.assert_allclose(raw, want, atol=1e-4 * scale)
    np.testing.assert_allclose(eig, want, atol=1e-3 * scale)
    with pytest.raises(ValueError, match="refine damping must be a positive"):
        RefineConfig(damping=0.0)


def test_refinement_caches_queries_and_refuses_methods_without_curvature(raw_index):
    cfg = RefineConfig(steps=1, sample=4)
    with QueryEngine(raw_index, device="cpu") as e:
        e.scores(QUERIES, method="ekfac", refine=cfg)
        calls = []
        ggn = e.refiner.gauss_newton(cfg, list(LAYERS))
        orig = ggn.product
        ggn.product = lambda V: calls.append(1) or orig(V)
        e.scores(QUERIES, method="ekfac", refine=cfg)
        assert not calls  # answered from the cache
        with pytest.raises(ValueError, match="refinement"):
            e.scores(QUERIES, method="graddot", refine=cfg)


def test_cli_query_explain_and_engine_default_refine(raw_index):
    """``gradindex query --refine`` ranks by the refined scores; an engine made with ``refine=`` refines every
    ekfac query (serve's path) and leaves graddot alone; ``explain`` splits the refined score."""
    from click.testing import CliRunner

    from gradindex.apps.explain import Explainer
    from gradindex.cli import main

    cfg = RefineConfig(steps=2, sample=N_TRAIN)
    with QueryEngine(raw_index, device="cpu") as e:
        want = e.scores(QUERIES[:1], method="ekfac", refine=cfg)[0]
        plain = e.scores(QUERIES[:1], method="graddot")[0]
    r = CliRunner().invoke(main, ["query", str(raw_index), "--text", QUERIES[0], "-k", "3", "--method", "ekfac",
                                  "--device", "cpu", "--json", "--refine", "cg", "--refine-steps", "2",
                                  "--refine-sample", str(N_TRAIN)])
    assert r.exit_code == 0, r.output
    hits = json.loads(r.output.strip().splitlines()[-1])
    assert [h["id"] for h in hits] == np.argsort(-want, kind="stable")[:3].tolist()
    np.testing.assert_allclose([h["score"] for h in hits], np.sort(want)[::-1][:3], rtol=1e-6)
    with QueryEngine(raw_index, device="cpu", refine=cfg) as e:
        res = e.query(QUERIES[0], k=3, method="ekfac", texts=False)
        np.testing.assert_allclose([h.score for h in res.hits], np.sort(want)[::-1][:3], rtol=1e-6)
        assert "refine" in res.seconds
        np.testing.assert_allclose(e.scores(QUERIES[:1], method="graddot")[0], plain)
        (ex,) = Explainer(e).explain(QUERIES[0], [int(np.argmax(want))], method="ekfac")
        assert ex.score == pytest.approx(want.max(), rel=1e-6)
        assert sum(ex.train.scores) == pytest.approx(ex.score, rel=1e-4)


def dense_gradients(model, ids, labels) -> np.ndarray:
    """``[S, D]`` per-example gradients of the summed target loss in LAYERS' stacked layout, by torch.func."""
    mods = dict(model.named_modules())
    theta = torch.cat([torch.cat([mods[n].weight.T, mods[n].bias[:, None]], 1).reshape(-1) for n in LAYERS])
    sizes = [mods[n].weight.shape[1] * (mods[n].weight.shape[0] + 1) for n in LAYERS]
    out = []
    for x, y in zip(ids, labels, strict=True):
        inp, tgt = torch.tensor([x]), torch.tensor(y[1:])

        def loss(th, inp=inp, tgt=tgt):
            params, o = {}, 0
            for n, s in zip(LAYERS, sizes, strict=True):
                G = th[o:o + s].reshape(mods[n].weight.shape[1], -1)
                params[f"{n}.weight"], params[f"{n}.bias"] = G[:, :-1].T, G[:, -1]
                o += s
            z = functional_call(model, params, (inp,), {"use_cache": False}).logits[0, :-1]
            return torch.nn.functional.cross_entropy(z, tgt, ignore_index=IGNORE, reduction="sum")

        with eager_attention(model):
            out.append(grad(loss)(theta).numpy())
    return np.array(out)


@pytest.mark.parametrize("curvature", ["fisher", "sampled"])
def test_fisher_refinement_matches_the_dense_fisher(setup, raw_index, curvature):
    """``curvature='fisher'|'sampled'``: the engine's refined scores equal the same CG iterations on the dense
    ``F + δI``, ``F`` the sample's empirical Fisher from torch.func per-example gradients (observed labels, or
    the model's own draws), cross-layer blocks included; the residual falls and the scores move towards the
    dense solve ``⟨(F + δI)⁻¹ g_q, g_t⟩`` (closer than plain EK-FAC)."""
    model, _, data, _ = setup
    cfg = RefineConfig(method="cg", steps=8, sample=N_TRAIN, curvature=curvature, damping=None)
    with QueryEngine(raw_index, device="cpu") as e:
        ids, labels = e._refine_sample(cfg)
        if curvature == "sampled":
            labels = sampled_labels(e.model, ids, labels, e.pad_id, cfg.seed, cfg.batch)
            assert labels != e._refine_sample(cfg)[1] and [len(y) for y in labels] == [len(y) for y in data.labels]
        Gs = dense_gradients(model, ids, labels)
        T = dense_gradients(model, data.input_ids, data.labels)  # the index's rows, independently
        curv = {n: preconditioner_curvature(e.pre.get("ekfac"), n, DAMPING) for n in LAYERS}
        dims = {n: e.space.dim(n) for n in LAYERS}
        F = Gs.T @ Gs / len(Gs)
        A = F + np.diag(np.concatenate([np.full(dims[n], curv[n].delta) for n in LAYERS]))
        _, grads = _query_grads(e, QUERIES)
        G = np.concatenate([grads[n].double().numpy() for n in LAYERS], 1)
        X = [refine_solve({n: grads[n][j].double() for n in LAYERS}, curv, _dense_hvp(F, dims), cfg.steps, "cg")[0]
             for j in range(len(QUERIES))]
        want = np.array([np.concatenate([x[n].numpy() for n in LAYERS]) for x in X]) @ T.T
        exact = np.linalg.solve(A, G.T).T @ T.T
        plain = e.scores(QUERIES, method="ekfac", damping=DAMPING)
        got = e.scores(QUERIES, method="ekfac", damping=DAMPING, refine=cfg)
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())  # float32 products, 8 CG steps
    for j, x in enumerate(X):
        x0 = refine_solve({n: grads[n][j].double() for n in LAYERS}, curv, _dense_hvp(F, dims), 0)[0]
        r0, r8 = (np.linalg.norm(A @ np.concatenate([v[n].numpy() for n in LAYERS]) - G[j]) for v in (x0, x))
        assert r8 < 0.5 * r0, (r0, r8)
    assert np.linalg.norm(got - exact) < np.linalg.norm(plain - exact)


def test_cli_refine_curvature_reaches_the_engine(raw_index):
    """``--refine-curvature sampled`` ranks by the engine's sampled-Fisher refined scores (not GGN's)."""
    from click.testing import CliRunner

    from gradindex.cli import main

    cfg = RefineConfig(steps=2, sample=N_TRAIN, curvature="sampled")
    with QueryEngine(raw_index, device="cpu") as e:
        want = e.scores(QUERIES[:1], method="ekfac", refine=cfg)[0]
        ggn = e.scores(QUERIES[:1], method="ekfac", refine=RefineConfig(steps=2, sample=N_TRAIN))[0]
    assert not np.allclose(want, ggn)
    r = CliRunner().invoke(main, ["query", str(raw_index), "--text", QUERIES[0], "-k", "3", "--method", "ekfac",
                                  "--device", "cpu", "--json", "--refine", "cg", "--refine-steps", "2",
                                  "--refine-sample", str(N_TRAIN), "--refine-curvature", "sampled"])
    assert r.exit_code == 0, r.output
    hits = json.loads(r.output.strip().splitlines()[-1])
    np.testing.assert_allclose([h["score"] for h in hits], np.sort(want)[::-1][:3], rtol=1e-6)
