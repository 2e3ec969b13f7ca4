"""K-FAC / EK-FAC fits and their application, against dense float64 computations (exact space)."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gradindex.capture import ProjectionSpec
from gradindex.cli import main
from gradindex.data import collate, load_records, per_example_loss, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import (
    FitConfig,
    available_methods,
    fit_preconditioner,
    load_preconditioner,
    self_influence,
)
from gradindex.precondition.files import precond_path
from gradindex.spec.manifest import IndexMismatchError, read_manifest, write_manifest
from gradindex.store import Store

LAYERS = ("*.attn.c_proj",)  # [32, 33] per example: 1056 numbers, small enough for dense matrices
MAX_LEN = 48




def _build(model_dir, data_path, out, **cfg):
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(load_records(data_path), tok, MAX_LEN)
    cfg = BuildConfig.raw(
        projection=ProjectionSpec.parse("none"),
        layers=LAYERS,
        max_length=MAX_LEN,
        batch_size=4,
        shard_size=16,
        **cfg,
    )
    return build_index(
        model, tok, data, out, cfg, model_id=str(model_dir), data_id=str(data_path), progress=False
    )[0]


@pytest.fixture(scope="module")
def exact_index(tmp_path_factory, gpt2_dir, text_jsonl):
    """Unprojected store of 40 examples in 3 shards, factors from the build pass, EK-FAC (+ K-FAC) fitted."""
    out = tmp_path_factory.mktemp("exact") / "idx"
    _build(gpt2_dir, text_jsonl, out, collect_covariance=True, precondition="ekfac")
    return out


@pytest.fixture(scope="module")
def one_big_batch(gpt2_dir, text_jsonl, exact_index):
    """Independent reference: A, S and per-example G of every layer from one padded batch (float64)."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, MAX_LEN)
    names = list(read_manifest(exact_index)["build"]["layers"])
    mods = dict(model.named_modules())
    acts, outs = {}, {}

    def hook(name):
        def fn(mod, inp, out):
            acts[name] = inp[0].detach()
            outs[name] = out

        return fn

    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    b = collate(data.input_ids, data.labels, tok.pad_token_id)
    loss, _ = per_example_loss(
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]
    )
    grads = torch.autograd.grad(loss.sum(), [outs[n] for n in names])
    for h in handles:
        h.remove()
    m = b["attention_mask"].double().unsqueeze(-1)  # [B, T, 1]
    ref = {}
    for n, g in zip(names, grads, strict=True):
        a = torch.cat([acts[n].double(), torch.ones_like(m)], -1) * m  # [B, T, N_i+1]
        g = g.double() * m  # [B, T, N_o]
        tokens = m.sum()
        ref[n] = {
            "A": torch.einsum("bti,btj->ij", a, a) / tokens,
            "S": torch.einsum("bti,btj->ij", g, g) / tokens,
            "G": torch.einsum("bto,bti->boi", g, a).reshape(len(data), -1),
        }  # G: [N, N_o·(N_i+1)]
    return ref


def _file(index, method, layer):
    with h5py.File(precond_path(index, method), "r") as f:
        return {k: f["layers"][layer][k][:] for k in f["layers"][layer]}


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def test_factors_from_streaming_build_pass_equal_one_big_batch(exact_index, one_big_batch):
    assert len(Store(exact_index).paths) == 3
    fit = read_manifest(exact_index)["preconditioners"]["ekfac"]["fit"]
    assert fit["source"] == "build pass" and fit["examples"] == 40
    for n, ref in one_big_batch.items():
        f = _file(exact_index, "kfac", n)
        assert _rel(f["A"], ref["A"]) < 1e-5 and _rel(f["S"], ref["S"]) < 1e-5, n
        lam, Q = f["lambda_A"], f["Q_A"]
        assert _rel(Q @ np.diag(lam) @ Q.T, f["A"]) < 1e-10


def test_model_pass_factors_equal_build_pass_factors(tmp_path, gpt2_dir, text_jsonl, exact_index):
    out = tmp_path / "idx"
    _build(gpt2_dir, text_jsonl, out)  # no factors collected
    res = CliRunner().invoke(main, ["precondition", str(out), "--method", "kfac", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "factors from the model pass" in res.output
    assert available_methods(out) == ["graddot", "cosine", "kfac"]
    for n in read_manifest(out)["build"]["layers"]:
        a, b = _file(out, "kfac", n), _file(exact_index, "kfac", n)
        assert _rel(a["A"], b["A"]) < 1e-6 and _rel(a["S"], b["S"]) < 1e-6
    np.testing.assert_allclose(self_influence(out, "kfac"), self_influence(exact_index, "kfac"), rtol=1e-5)
    m = read_manifest(out)
    m["model_id"] = str(tmp_path / "moved-model")
    write_manifest(out, m)
    res = CliRunner().invoke(main, ["precondition", str(out), "--method", "ekfac", "--quiet"])
    assert res.exit_code != 0 and "is not found" in res.output and "--precondition" in res.output


def test_fit_on_a_sample_or_another_set_and_in_float32(tmp_path, text_jsonl, exact_index):
    idx = tmp_path / "idx"
    shutil.copytree(exact_index, idx)
    fit_preconditioner(idx, FitConfig(method="kfac", fit_data=str(text_jsonl), precision="float32"))
    fit = read_manifest(idx)["preconditioners"]["kfac"]["fit"]
    assert fit["source"] == "model pass" and fit["examples"] == 40
    for n in read_manifest(idx)["build"]["layers"]:
        assert _rel(_file(idx, "kfac", n)["A"], _file(exact_index, "kfac", n)["A"]) < 1e-6
    np.testing.assert_allclose(self_influence(idx, "kfac"), self_influence(exact_index, "kfac"), rtol=1e-4)
    fit_preconditioner(idx, FitConfig(method="kfac", fit_examples=10, seed=3))
    fit = read_manifest(idx)["preconditioners"]["kfac"]["fit"]
    assert fit["examples"] == 10 and fit["sample_seed"] == 3
    n = next(iter(read_manifest(idx)["build"]["layers"]))
    assert _rel(_file(idx, "kfac", n)["A"], _file(exact_index, "kfac", n)["A"]) > 1e-3


@pytest.mark.parametrize("damping", [0.1, 1e-3])
def test_kfac_inverse_equals_dense_kronecker_inverse(exact_index, damping):
    P = load_preconditioner(exact_index, "kfac")
    g = torch.Generator().manual_seed(0)
    for n in P.layers:
        f = _file(exact_index, "kfac", n)
        A, S = f["A"], f["S"]
        delta = damping * np.trace(S) / len(S) * np.trace(A) / len(A)  # mean of λ_S λ_Aᵀ
        H = np.kron(S, A) + delta * np.eye(len(S) * len(A))
        v = torch.randn(3, H.shape[0], generator=g, dtype=torch.float64)
        expect = np.linalg.solve(H, v.numpy().T).T
        assert _rel(P.apply(n, v, damping=damping).numpy(), expect) < 1e-6, n


def test_ekfac_inverse_equals_dense_eigenbasis_inverse(exact_index, one_big_batch):
    P = load_preconditioner(exact_index, "ekfac")
    rows = Store(exact_index).read_rows(np.arange(40))
    g = torch.Generator().manual_seed(1)
    for n in P.layers:
        f = _file(exact_index, "ekfac", n)
        Q = np.kron(f["Q_S"], f["Q_A"])  # columns: eigenvectors of S ⊗ A, row-major vec
        lam = (rows[n].astype(np.float64) @ Q) ** 2  # [N, D] coefficients² of the stored rows
        assert _rel(f["Lambda"].reshape(-1), lam.mean(0)) < 1e-10
        assert _rel(f["Lambda"].reshape(-1), ((one_big_batch[n]["G"].numpy() @ Q) ** 2).mean(0)) < 1e-4
        H = Q @ np.diag(f["Lambda"].reshape(-1) + 0.1 * f["Lambda"].mean()) @ Q.T
        v = torch.randn(3, H.shape[0], generator=g, dtype=torch.float64)
        assert _rel(P.apply(n, v, damping=0.1).numpy(), np.linalg.solve(H, v.numpy().T).T) < 1e-6, n


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_whitening_squared_is_the_inverse(exact_index, method):
    P = load_preconditioner(exact_index, method)
    g = torch.Generator().manual_seed(2)
    for n in P.layers:
        x, y = torch.randn(2, 4, 1056, generator=g, dtype=torch.float64)
        lhs = (P.apply(n, x, -0.5, 0.05) * P.apply(n, y, -0.5, 0.05)).sum(1)
        rhs = (P.apply(n, x, -1.0, 0.05) * y).sum(1)
        assert _rel(lhs, rhs) < 1e-10
        assert P.apply(n, x.float()).dtype == torch.float32


def test_self_influence_is_written_per_method_and_computed_at_other_damping(exact_index):
    rows = Store(exact_index).read_rows(np.arange(40))
    P = load_preconditioner(exact_index, "ekfac")
    for damping in (0.1, 0.7):  # 0.1 was written at fit time, 0.7 is computed from the store
        expect = sum(
            (P.apply(n, torch.from_numpy(r).double(), damping=damping) * torch.from_numpy(r).double()).sum(1)
            for n, r in rows.items()
        ).numpy()
        np.testing.assert_allclose(self_influence(exact_index, "ekfac", damping), expect, rtol=1e-6)
    norms = sum((r.astype(np.float64) ** 2).sum(1) for r in rows.values())
    np.testing.assert_allclose(self_influence(exact_index, "graddot"), norms, rtol=1e-6)


def test_methods_are_listed_and_unfitted_ones_name_the_command(tmp_path, exact_index):
    assert available_methods(exact_index) == ["graddot", "cosine", "kfac", "ekfac"]
    assert "ekfac-selfnorm" in available_methods(exact_index, selfnorm=True)
    assert load_preconditioner(exact_index, "graddot").is_identity
    bare = tmp_path / "bare"
    shutil.copytree(exact_index, bare, ignore=shutil.ignore_patterns("precond"))
    m = read_manifest(bare)
    m.pop("preconditioners")
    write_manifest(bare, m)
    with pytest.raises(FileNotFoundError, match=r"gradindex precondition .* --method kfac"):
        load_preconditioner(bare, "kfac")
    with pytest.raises(ValueError, match="is not one of"):
        load_preconditioner(bare, "cosine-selfnorm")


def test_an_interrupted_index_still_lists_its_methods(tmp_path, exact_index):
    """Listing by path reads the manifest alone (no store opened, no hash check): an index whose build was killed
    (status ``building``, its last shard not yet written) lists what it has fitted, as before the OpenStore step;
    opening its store is still refused."""
    from gradindex.precondition.fullspace import full_space_methods
    from gradindex.store.opened import OpenStore

    killed = tmp_path / "killed"
    shutil.copytree(exact_index, killed)
    m = read_manifest(killed)
    m["status"] = "building"
    write_manifest(killed, m)
    sorted((killed / "store").glob("shard-*.h5"))[-1].unlink()
    assert available_methods(killed) == available_methods(exact_index) == ["graddot", "cosine", "kfac", "ekfac"]
    assert full_space_methods(killed) == full_space_methods(exact_index) == ["graddot", "cosine", "kfac", "ekfac"]
    with pytest.raises(ValueError, match="is not complete"):
        OpenStore(killed)


def test_preconditioner_fitted_on_another_model_is_refused(tmp_path, exact_index):
    other = tmp_path / "other"
    shutil.copytree(exact_index, other)
    m = read_manifest(other)
    m["build"]["model_fingerprint"] = "0" * 32
    write_manifest(other, m)
    with pytest.raises(IndexMismatchError, match="another model.*gradindex precondition"):
        load_preconditioner(other, "ekfac")
    with pytest.raises(IndexMismatchError):
        self_influence(other, "kfac")
    attrs = h5py.File(precond_path(exact_index, "kfac"), "r").attrs
    assert (
        json.loads(attrs["fp_model_fingerprint"]) == read_manifest(exact_index)["build"]["model_fingerprint"]
    )


def test_auto_precision_rotates_wide_layers_in_float32_to_the_float64_fit(tmp_path, exact_index, monkeypatch):
    from gradindex.precondition import fit as fit_mod

    shapes = {"wide": (313, 104), "narrow": (48, 49)}  # a default row of the peers workload; 2,352 numbers
    assert fit_mod.layer_dtypes("auto", shapes) == {"wide": torch.float32, "narrow": torch.float64}
    assert set(fit_mod.layer_dtypes("float64", shapes).values()) == {torch.float64}
    assert FitConfig().precision == "auto"
    idx = tmp_path / "idx"
    shutil.copytree(exact_index, idx)
    monkeypatch.setattr(fit_mod, "AUTO_FLOAT32_NUMBERS", 0)  # every layer of the tiny model counts as wide
    fit_preconditioner(idx, FitConfig(method="ekfac"))  # exact_index: the same fit in float64 (its layers are narrow)
    for n in read_manifest(idx)["build"]["layers"]:
        a, b = _file(idx, "ekfac", n), _file(exact_index, "ekfac", n)
        np.testing.assert_array_equal(a["Q_A"], b["Q_A"])  # the factors and eigenbases do not depend on it
        assert 0 < _rel(a["Lambda"], b["Lambda"]) < 1e-5, n  # float32 rotations: round-off only
    for m in ("kfac", "ekfac", "graddot"):
        np.testing.assert_allclose(self_influence(idx, m), self_influence(exact_index, m), rtol=1e-5)
