"""What a stored row holds: per-layer projection sizes from a budget, exact layers, the K-FAC-whitened basis.

Rows are checked against torch.func per-example gradients mapped independently (projection
matrices drawn per layer, whitening from factors computed here with plain forward hooks).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_capture import _G, _examples, _reference

from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, ProjectionSpec, RowSpace, projection_matrix
from gradindex.capture.allocation import allocate, capture_cost, stored_numbers
from gradindex.capture.batch import batch_gradients
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import build_indices
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, IndexConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import IndexMismatchError, read_manifest
from gradindex.store import Store
from gradindex.store.basis import read_basis
from gradindex.store.builder import build_store

WIDTHS = {"small": (9, 8), "wide": (65, 256), "tall": (257, 64), "mid": (65, 64)}


@pytest.mark.parametrize("rule", ["ratio", "equal"])
@pytest.mark.parametrize("budget", [400, 4000, 40000])
def test_allocation_spends_at_most_the_budget_and_keeps_small_layers_exact(rule, budget):
    plan = allocate(WIDTHS, budget, rule)
    assert set(plan) == set(WIDTHS)
    used = stored_numbers(WIDTHS, plan)
    assert used * 4 <= budget
    assert used * 4 > budget / 4, "the plan wastes most of the budget"
    for n, (k_a, k_g) in plan.items():
        assert 0 <= k_a < WIDTHS[n][0] and 0 <= k_g < WIDTHS[n][1]
    if rule == "equal" and budget >= 4000:
        assert plan["small"] == (0, 0), "a layer narrower than k is stored exactly"


@pytest.mark.parametrize("budget", [400, 4000, 40000])
def test_cost_allocation_keeps_ratios_numbers_per_layer_at_the_least_capture_cost(budget):
    """Against every split of the same layer's numbers (brute force): none within them is cheaper."""
    ratio, cost = allocate(WIDTHS, budget, "ratio"), allocate(WIDTHS, budget, "cost")
    assert stored_numbers(WIDTHS, cost) * 4 <= budget
    for n, (a, g) in WIDTHS.items():
        want = (ratio[n][0] or a) * (ratio[n][1] or g)
        k_a, k_g = cost[n][0] or a, cost[n][1] or g
        assert 0.98 * want <= k_a * k_g <= want
        splits = [(x, y) for x in range(1, a + 1) for y in range(1, g + 1) if 0.98 * want <= x * y <= want]
        assert capture_cost(a, g, k_a, k_g) == min(capture_cost(a, g, x, y) for x, y in splits)
        assert capture_cost(a, g, k_a, k_g) <= capture_cost(a, g, ratio[n][0] or a, ratio[n][1] or g)
    assert capture_cost(257, 1024, *[k or w for k, w in zip(allocate({"fc": (257, 1024)}, 2 * 33000, "cost")["fc"],
                                                            (257, 1024))]) \
        < 0.6 * capture_cost(257, 1024, *[k or w for k, w in zip(allocate({"fc": (257, 1024)}, 2 * 33000,
                                                                          "ratio")["fc"], (257, 1024))])


def test_allocation_edges():
    full = 4 * sum(a * g for a, g in WIDTHS.values())
    assert allocate(WIDTHS, full, "ratio") == {n: (0, 0) for n in WIDTHS}
    with pytest.raises(ValueError, match="below the minimum"):
        allocate(WIDTHS, 8, "ratio")
    with pytest.raises(ValueError, match="eigenvalues"):
        allocate(WIDTHS, 4000, "spectrum")
    ratio = allocate(WIDTHS, 20000, "ratio")
    assert ratio["tall"][0] > ratio["mid"][0], "ratio: k grows with the side's width"
    flat = {n: (np.ones(a), np.ones(g)) for n, (a, g) in WIDTHS.items()}
    peaked = dict(flat, wide=(np.r_[1.0, np.zeros(64)], np.r_[1.0, np.zeros(255)]))
    assert allocate(WIDTHS, 20000, "spectrum", spectra=peaked)["wide"] < \
        allocate(WIDTHS, 20000, "spectrum", spectra=flat)["wide"]


def test_per_layer_spec_draws_the_pinned_stream_and_round_trips():
    uniform = ProjectionSpec(k_a=4, k_g=6, seed=3)
    per_layer = ProjectionSpec(k_a=0, k_g=0, seed=3, sizes=(("x", 4, 6), ("y", 0, 2)))
    for side, n in (("a", 10), ("g", 12)):
        assert torch.equal(projection_matrix(uniform, "x", side, n), projection_matrix(per_layer, "x", side, n))
    assert per_layer.layer_sizes("y") == (0, 2)
    with pytest.raises(ValueError, match="not projected"):
        projection_matrix(per_layer, "y", "a", 10)
    assert ProjectionSpec.from_dict(json.loads(json.dumps(per_layer.to_dict()))) == per_layer


def _mixed_spec(model) -> ProjectionSpec:
    with GradientCapture(model) as cap:
        names = list(cap.infos)
    sizes = [(names[0], 0, 0), (names[1], 0, 5), (names[2], 7, 0)] + [(n, 6, 4) for n in names[3:]]
    return ProjectionSpec(k_a=0, k_g=0, seed=4, sizes=tuple(sizes))


def _expected(spec, name, G, W_a=None, W_g=None):
    """``P_g W_g G W_aᵀ P_aᵀ`` with each factor present only where the spec/basis has it."""
    k_a, k_g = spec.layer_sizes(name)
    G = G.double()
    if W_a is not None:
        G = G @ torch.as_tensor(W_a).double().T
    if W_g is not None:
        G = torch.as_tensor(W_g).double() @ G
    if k_a:
        G = G @ projection_matrix(spec, name, "a", G.shape[1]).double().T
    if k_g:
        G = projection_matrix(spec, name, "g", G.shape[0]).double() @ G
    return G


@pytest.mark.parametrize("route", ["factorized", "materialized", "auto"])
def test_mixed_per_layer_sizes_equal_torch_func_gradients(gpt2_dir, tokenizer, route):
    """An exact layer, one-side-exact layers and projected ones in one capture, every route."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    spec = _mixed_spec(model)
    ids, labels = _examples(tok)
    ref = _reference(model, ids, labels)
    model.requires_grad_(False)
    space = RowSpace(spec)
    with GradientCapture(model, None, ProjectedRows(space, route)) as cap:
        bg = batch_gradients(model, cap, ids, labels, tok.pad_token_id)
    for name, rows in bg.grads.items():
        assert rows.shape[1] == space.dim(name)
        for i in range(len(ids)):
            e = _expected(spec, name, _G(cap, name, ref[i])).reshape(-1)
            assert float((rows[i].double() - e).norm()) <= 1e-4 * float(e.norm()) + 1e-9, (name, i)
    first = next(iter(cap.infos))
    assert space.dims(first) == (cap.infos[first].n_out, cap.infos[first].n_in_total)


def _data(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    return model, tok, tokenize_records(load_records(text_jsonl), tok, 48)


def test_budget_build_fits_indexes_and_queries_with_mixed_shapes(gpt2_dir, text_jsonl, tmp_path):
    """A budget that leaves small layers exact: manifest shapes, stored rows, fit, index and query agree."""
    model, tok, data = _data(gpt2_dir, text_jsonl)
    out = tmp_path / "idx"
    cfg = BuildConfig.raw(budget="3/8", allocation="equal", shard_size=16, precondition="ekfac", max_length=48)
    build_index(model, tok, data, out, cfg, index=IndexConfig(factory="Flat"), model_id=str(gpt2_dir),
                data_id=str(text_jsonl), progress=False)
    m = read_manifest(out)
    spec = ProjectionSpec.from_dict(m["build"]["projection"])
    shapes = {n: (v["rows"], v["cols"]) for n, v in m["build"]["layers"].items()}
    assert {spec.layer_sizes(n) == (0, 0) for n in shapes} == {True, False}, "some layers exact, some projected"
    assert len(set(shapes.values())) > 1
    full = 4 * sum(v["n_out"] * (v["n_in"] + v["bias"]) for v in m["build"]["layers"].values())
    assert 4 * sum(r * c for r, c in shapes.values()) <= full * 3 / 8
    ref = _reference(model, data.input_ids[:3], data.labels[:3])
    with Store(out) as st, GradientCapture(model) as cap:
        assert st.dims == {n: r * c for n, (r, c) in shapes.items()}
        rows = st.read_rows(np.arange(3))
        for n in shapes:
            for i in range(3):
                e = _expected(spec, n, _G(cap, n, ref[i])).reshape(-1).numpy()
                assert np.allclose(rows[n][i], e, rtol=1e-4, atol=1e-6 * np.abs(e).max()), n
    with QueryEngine(out, gpt2_dir, device="cpu") as eng:
        toks = eng.tokenize([data.input_ids[5]])
        q, _, _ = eng.gradients(toks)
        hit = eng.search(q, k=40, method="ekfac", texts=False)[0].hits
        exact = score_matrix(out, q, "ekfac", device="cpu")[0]
        assert [h.id for h in hit[:5]] == list(np.argsort(-exact, kind="stable")[:5])
        assert np.allclose([h.score for h in hit], exact[[h.id for h in hit]], rtol=1e-4)
    with pytest.raises(IndexMismatchError, match="projection differs"):
        build_store(model, tok, data, out, BuildConfig.raw(budget="1/16", allocation="equal", shard_size=16,
                                                       max_length=48), progress=False)


def _kfac_factors(model, data, names):
    """Full-space ``A`` (inputs with the bias 1) from plain forward hooks, ``S`` from torch.func output grads."""
    sums, toks = {}, 0
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, i, o, n=n: sums.setdefault(n, []).append(i[0][0].double()))
             for n in names]
    with torch.no_grad():
        for x in data.input_ids:
            model(input_ids=torch.tensor([x]))
            toks += len(x)
    for h in hooks:
        h.remove()
    A = {}
    for n in names:
        a = torch.cat(sums[n])  # [tokens, N_i]
        a1 = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        A[n] = (a1.T @ a1 / toks).numpy()
    return A


def test_kfac_basis_rows_methods_and_queries(gpt2_dir, text_jsonl, tmp_path):
    """Whitened rows are ``P_g W_g G W_a P_aᵀ`` with ``W = (F + δ)^{-1/2}``; kfac is their dot product;
    graddot is refused; the query applies the same maps."""
    model, tok, data = _data(gpt2_dir, text_jsonl)
    out = tmp_path / "w"
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--projection",
                                    "auto", "--budget", "1/16", "--projection-basis", "kfac", "--shard-size",
                                    "16", "--max-length", "48", "--device", "cpu", "--quiet",
                                    "--precondition", "ekfac", "--storage", "fp32"])
    assert res.exit_code == 0, res.output
    m = read_manifest(out)
    assert m["build"]["basis"]["kind"] == "kfac"
    basis = read_basis(out)
    names = list(m["build"]["layers"])
    A = _kfac_factors(model, data, names)
    for n in names[:2]:
        lam, Q = np.linalg.eigh(A[n])
        lam = np.clip(lam, 0, None)
        W = (Q / np.sqrt(lam + 1.0 * lam.mean())) @ Q.T
        assert np.allclose(basis.W_a[n], W, rtol=2e-3, atol=2e-3 * np.abs(W).max())
    spec = ProjectionSpec.from_dict(m["build"]["projection"])
    ref = _reference(model, data.input_ids[:2], data.labels[:2])
    with Store(out) as st, GradientCapture(model) as cap:
        rows = st.read_rows(np.arange(2))
        for n in names:
            for i in range(2):
                e = _expected(spec, n, _G(cap, n, ref[i]), basis.W_a[n], basis.W_g[n]).reshape(-1).numpy()
                assert np.allclose(rows[n][i], e, rtol=1e-3, atol=1e-4 * np.abs(e).max()), n
    with QueryEngine(out, gpt2_dir, device="cpu") as eng:
        q, _, _ = eng.gradients(eng.tokenize([data.input_ids[3]]))
        with Store(out) as st:
            every = st.read_rows(np.arange(len(data)))
        for n in names:
            own = every[n][3]
            assert np.allclose(q[n][0].numpy(), own, rtol=1e-4, atol=1e-5 * np.abs(own).max())
        r = eng.search(q, k=3, method="kfac", texts=False)[0]
        dots = sum(np.asarray(q[n], np.float64) @ every[n].T.astype(np.float64) for n in names)[0]
        assert r.hits[0].id == int(np.argmax(dots)) and r.damping == 1.0
        assert eng.search(q, k=3, method="ekfac", texts=False)[0].hits
        with pytest.raises(ValueError, match="not graddot"):
            eng.search(q, k=3, method="graddot")
    res = CliRunner().invoke(main, ["query", str(out), "--text", "the cat", "--method", "graddot", "--device", "cpu"])
    assert res.exit_code != 0 and "Error:" in res.output and "kfac" in res.output and "Traceback" not in res.output


def test_compact_into_ekfac_eigenbasis_keeps_ekfac_scores(gpt2_dir, text_jsonl, tmp_path):
    """Rows rotated and scaled by the fitted EK-FAC: their dot products are the source's EK-FAC scores."""
    model, tok, data = _data(gpt2_dir, text_jsonl)
    src, out = tmp_path / "src", tmp_path / "eig"
    build_index(model, tok, data, src, BuildConfig.raw(projection=ProjectionSpec(k_a=6, k_g=5, seed=1), shard_size=16,
                                                   max_length=48, collect_covariance=True), progress=False)
    args = ["compact", str(src), "--out", str(out), "--quiet", "--index-type", "Flat"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "Error:" in res.output and "--method ekfac" in res.output  # no fit yet
    res = CliRunner().invoke(main, ["precondition", str(src), "--method", "ekfac", "--quiet", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert read_manifest(out)["build"]["basis"]["kind"] == "ekfac"
    queries = [data.input_ids[7], data.input_ids[20]]
    with _engine(src, model, tok) as a, \
            _engine(out, model, tok) as b:
        qa, _, _ = a.gradients(a.tokenize(queries))
        qb, _, _ = b.gradients(b.tokenize(queries))
        ref = score_matrix(src, qa, "ekfac", damping=DEFAULT_DAMPING, device="cpu")
        got = score_matrix(out, qb, "ekfac", device="cpu")
        # (the rotated rows round through float16 as every ekfac transcode's do, store.basis.stored_rows: ~2e-4)
        assert np.allclose(got, ref, rtol=1e-3, atol=1e-5 * np.abs(ref).max())
        hits = b.search(qb, k=5, method="ekfac", texts=False)
        assert [h.id for h in hits[0].hits] == list(np.argsort(-ref[0], kind="stable")[:5])
        for bad in ("graddot", "kfac"):
            with pytest.raises(ValueError, match="ekfac"):
                b.search(qb, k=5, method=bad)
    res = CliRunner().invoke(main, args[:3] + [str(tmp_path / "eig4"), "--storage", "int4", "--no-index", "--quiet"])
    assert res.exit_code == 0, res.output
    coded = score_matrix(tmp_path / "eig4", qb, "ekfac", device="cpu")
    assert read_manifest(tmp_path / "eig4")["build"]["storage"] == "int4"
    assert min(np.corrcoef(coded[i], ref[i])[0, 1] for i in range(len(ref))) > 0.95


def _engine(index_dir, model, tok):
    if not (index_dir / "faiss").exists():
        build_indices(index_dir, IndexConfig(factory="Flat"), progress=False)
    return QueryEngine(index_dir, model=model, tokenizer=tok)


@pytest.mark.slow
def test_rowspace_benchmark_quick_mode_agrees_with_the_library(tmp_path):
    """The benchmark's simulated recipes score exactly as an index built by the library does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rowspace.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rowspace", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {(r["allocation"], r["basis"], r["storage"]) for r in res["rows"]} >= {
        ("equal", "raw", "fp32"), ("ratio", "kfac", "fp32"), ("spectrum", "raw", "fp32"), ("ratio", "raw", "int4")}
    assert all(0 <= r["top10"] <= 1 and r["bytes"] > 0 for r in res["rows"])
    assert min(res["library_check"]["score_correlation"].values()) > 0.999


# -- one capture transform: dense side maps (row basis) and Adam's scales/weights together ---------------
def _mixed_transforms(cap, seed: int = 0):
    """Layer → LayerTransform: a dense map on one side, scales on the other, entrywise weights on some."""
    from gradindex.capture.transform import LayerTransform

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, info) in enumerate(cap.infos.items()):
        na, no = info.n_in_total, info.n_out
        dense_a = torch.randn(na - 1 if i % 2 else na, na, generator=gen)  # a map may change the side's size
        scale_g = torch.rand(no, generator=gen) + 0.5
        W = torch.rand(no, na, generator=gen) + 0.5 if i % 3 == 0 else None
        out[name] = LayerTransform(g=scale_g, map_a=dense_a, elementwise=W)
    return out


@pytest.mark.parametrize("route", ["factorized", "materialized", "auto"])
def test_dense_maps_scales_and_entrywise_weights_equal_torch_func_gradients(gpt2_dir, tokenizer, route):
    """Rows are ``P_g diag(d_g) (W ⊙ G) M_aᵀ P_aᵀ`` on exact, one-side-exact and projected layers alike."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    spec = _mixed_spec(model)
    ids, labels = _examples(tok)
    ref = _reference(model, ids, labels)
    model.requires_grad_(False)
    with GradientCapture(model) as probe:
        transforms = _mixed_transforms(probe)
    space = RowSpace(spec, transforms)
    with GradientCapture(model, None, rows_of := ProjectedRows(space, route)) as cap:
        bg = batch_gradients(model, cap, ids, labels, tok.pad_token_id)
    for name, rows in bg.grads.items():
        t = transforms[name]
        assert rows.shape[1] == space.dim(name)
        for i in range(len(ids)):
            G = _G(cap, name, ref[i]).double()
            if t.elementwise is not None:
                G = G * t.elementwise.double()
            e = _expected(spec, name, G, W_a=t.map_a, W_g=torch.diag(t.g.double())).reshape(-1)
            assert float((rows[i].double() - e).norm()) <= 1e-4 * float(e.norm()) + 1e-9, (name, i)
    weighted = [n for n, t in transforms.items() if t.elementwise is not None]
    assert rows_of.route_counts["materialized"] >= len(weighted), "entrywise weights need the materialized route"


def test_covariance_with_a_transform_is_refused_only_for_entrywise_weights(gpt2_dir, tokenizer):
    from gradindex.capture.transform import LayerTransform

    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    spec = ProjectionSpec.parse("6x4", seed=1)
    with GradientCapture(model) as probe:
        transforms = _mixed_transforms(probe)
    with pytest.raises(ValueError, match="entrywise"):
        GradientCapture(model, None, KfacSums(RowSpace(spec, transforms)))
    maps = {n: LayerTransform(g=t.g, map_a=t.map_a) for n, t in transforms.items()}
    ids, labels = _examples(tok)
    model.requires_grad_(False)
    kfac = KfacSums(RowSpace(spec, maps))
    with GradientCapture(model, None, kfac) as cap:
        batch_gradients(model, cap, ids, labels, tok.pad_token_id)
    name = next(iter(cap.infos))
    P_a = projection_matrix(spec, name, "a", maps[name].map_a.shape[0]).double()
    M_a = P_a @ maps[name].map_a.double()  # the factor is of mapped rows: M_a Σ ā āᵀ M_aᵀ
    plain = KfacSums(RowSpace(ProjectionSpec.parse("none")))
    with GradientCapture(model, None, plain) as cap:
        batch_gradients(model, cap, ids, labels, tok.pad_token_id)
    expect = M_a @ plain.A[name] @ M_a.T
    assert torch.allclose(kfac.A[name], expect, rtol=1e-4, atol=1e-6 * float(expect.abs().max()))


def test_optimizer_state_with_the_kfac_basis_is_refused():
    with pytest.raises(ValueError, match="projection-basis raw"):
        BuildConfig.raw(optimizer_state="state.safetensors", basis="kfac")


def test_verify_names_a_flipped_byte_in_the_row_basis(gpt2_dir, text_jsonl, tmp_path):
    """``basis.h5`` is hashed into checksums.json when written; ``gradindex verify`` names a flipped byte."""
    model, tok, data = _data(gpt2_dir, text_jsonl)
    out = tmp_path / "idx"
    build_store(model, tok, data, out, BuildConfig.raw(projection=ProjectionSpec.parse("4"), basis="kfac",
                                                   basis_examples=8, shard_size=16, max_length=48), progress=False)
    ok = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.output)
    assert report["damaged"] == [] and "basis.h5" not in report["unrecorded"]
    path = out / "basis.h5"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    bad = CliRunner().invoke(main, ["verify", str(out)])
    assert bad.exit_code == 1, bad.output
    assert "DAMAGED basis.h5" in bad.output, bad.output
    assert ",KFAC@" in bad.output and "--repair" in bad.output and "--overwrite" not in bad.output, \
        "the repair makes the basis again with the build's factor pass (tests/test_basis_restore.py), keeping the rows"


def test_the_resume_command_names_the_budget_basis_and_optimizer_options():
    from gradindex.spec.manifest import build_command

    proj = {"kind": "gaussian", "k_a": 0, "k_g": 0, "seed": 3, "sizes": {"h.0.mlp": [4, 0]}}
    m = {"model_id": "M", "data_id": "D", "config": {"budget": "1/16", "allocation": "equal"},
         "build": {"projection": proj, "basis": {"kind": "kfac", "damping": 0.3, "examples": 8}}}
    cmd = build_command("IDX", m)
    for part in ("--rows auto:1/16:equal,KFAC@0.3,fp32", "--fit-examples 8", "--seed 3"):
        assert part in cmd, (part, cmd)
    m = {"config": {"budget": "1/16", "optimizer_state": "/s/adam.safetensors", "adam_mode": "factored"},
         "build": {"projection": proj, "optimizer": {"mode": "factored"}}}
    cmd = build_command("IDX", m)
    for part in ("--rows auto:1/16:ratio,ADAM:factored,fp32", "--optimizer-state /s/adam.safetensors"):
        assert part in cmd, (part, cmd)
    plain = build_command("IDX", {"build": {"projection": {"kind": "gaussian", "k_a": 8, "k_g": 6, "seed": 0}}})
    assert "--rows P8x6,fp32" in plain and "basis" not in plain
