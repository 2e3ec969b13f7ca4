"""True Fisher: factors from labels sampled from the model, checked against autograd and E_y[g gᵀ]."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import gradindex.capture.batch as batch_mod
from gradindex.capture import ProjectionSpec, projection_matrix, select_layers
from gradindex.capture.sampling import label_uniforms
from gradindex.cli import main
from gradindex.data import IGNORE, Tokenized, load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import FitConfig, fit_preconditioner
from gradindex.precondition.factors import model_covariance
from gradindex.precondition.files import precond_path, read_layers
from gradindex.store import Store


def _output_grads(model, layers, ids, labels):
    """Per-token output gradients ``{layer: [T, N_o]}`` of one example's summed loss, by autograd."""
    outs = {}

    def keep(name):
        def hook(mod, inp, out):
            out.retain_grad()
            outs[name] = out

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in layers.items()]
    try:
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]
        y = torch.tensor(labels[1:])
        keep = y != IGNORE
        torch.nn.functional.cross_entropy(logits[:-1][keep], y[keep], reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
    return {n: o.grad[0] for n, o in outs.items()}, logits.detach()


def _sampled(logits, labels, u):
    """Independent inverse-CDF draw: the number of CDF entries at or below each uniform."""
    cdf = torch.softmax(logits[:-1].double(), -1).cumsum(-1)  # [T-1, V]
    y = (cdf <= u[:, None].double()).sum(-1).clamp_max(logits.shape[-1] - 1)
    return [labels[0]] + [int(t) if lab != IGNORE else IGNORE for t, lab in zip(y, labels[1:])]


@pytest.mark.parametrize("head", ["fused", "plain"])
def test_true_fisher_S_equals_autograd_with_the_same_sampled_labels(gpt2_dir, text_jsonl, head, monkeypatch):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    data.labels[2] = [IGNORE] * 3 + data.labels[2][3:]  # a masked prompt keeps its targets masked
    rows, spec, seed = [0, 2, 5, 7, 11], ProjectionSpec(k_a=6, k_g=5, seed=1), 4
    if head == "plain":  # the model's own logits, sampled by batch.sampled_labels
        monkeypatch.setattr(batch_mod, "plain_head", lambda *a: None)
    layers = select_layers(model)
    got = model_covariance(model, tok, data, rows, list(layers), spec, batch_size=3, fisher="true", seed=seed)
    emp = model_covariance(model, tok, data, rows, list(layers), spec, batch_size=3)
    model.requires_grad_(True)
    ref = {n: torch.zeros(spec.k_g, spec.k_g, dtype=torch.float64) for n in layers}
    for r in rows:
        ids, labels = data.input_ids[r], data.labels[r]
        _, logits = _output_grads(model, layers, ids, labels)
        model.zero_grad()
        sampled = _sampled(logits, labels, label_uniforms(seed, [r], [len(ids)])[0])
        g, _ = _output_grads(model, layers, ids, sampled)
        model.zero_grad()
        for n, gt in g.items():
            gp = gt.double() @ projection_matrix(spec, n, "g", gt.shape[1]).double().T  # [T, k_g]
            ref[n] += gp.T @ gp
    for n in layers:
        err = np.linalg.norm(got.S[n] - ref[n].numpy()) / np.linalg.norm(ref[n].numpy())
        assert err < 1e-5, (n, err)
        assert np.allclose(got.A[n], emp.A[n], rtol=1e-6), "A does not depend on the labels"
        assert np.linalg.norm(got.S[n] - emp.S[n]) > 0.05 * np.linalg.norm(emp.S[n]), "labels were not resampled"


def test_true_fisher_expectation_is_the_analytic_one_on_an_enumerable_vocabulary():
    from fixtures.tiny import tiny_gpt2

    V, R = 16, 1500
    model = tiny_gpt2(vocab_size=V, n_layer=1, n_embd=8, n_head=2, seed=3)
    model.requires_grad_(True)
    ids = [3, 9, 1, 14, 7, 2]
    layers = select_layers(model)
    # Analytic: targets at different positions are independent and E[p - e_y] = 0, so
    # E[Σ_s g_s g_sᵀ] = Σ_s Σ_t Σ_y p_t(y) h_ts(y) h_ts(y)ᵀ with h_ts(y) = ∂(-log p_t(y))/∂out_s.
    ana = {n: torch.zeros(m.nf, m.nf, dtype=torch.float64) for n, m in layers.items()}
    _, logits = _output_grads(model, layers, ids, list(ids))
    model.zero_grad()
    p = torch.softmax(logits.double(), -1)  # [T, V]
    for t in range(len(ids) - 1):
        for y in range(V):
            lab = [IGNORE] * len(ids)
            lab[t + 1] = y
            g, _ = _output_grads(model, layers, ids, lab)
            model.zero_grad()
            for n, gt in g.items():
                ana[n] += p[t, y] * gt.double().T @ gt.double()
    data = Tokenized([list(ids)] * R, [list(ids)] * R, 0, "input_ids")
    tok = SimpleNamespace(pad_token_id=0)
    spec = ProjectionSpec(kind="none", k_a=0, k_g=0)
    true = model_covariance(model, tok, data, range(R), list(layers), spec, batch_size=250, fisher="true", seed=0)
    emp = model_covariance(model, tok, data, range(2), list(layers), spec, batch_size=2)
    for n in layers:
        a = ana[n].numpy()
        err_true = np.linalg.norm(true.S[n] / R - a) / np.linalg.norm(a)
        err_emp = np.linalg.norm(emp.S[n] / 2 - a) / np.linalg.norm(a)
        assert err_true < 0.05 and err_emp > 10 * err_true  # measured ~0.02 and ~1.2, (n, err_true, err_emp)


def test_true_fisher_fit_keeps_stored_rows_and_records_itself(tmp_path, gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    out = tmp_path / "idx"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=6, k_g=5, seed=1), batch_size=8, max_length=64,
                      precondition="ekfac")
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    with Store(out) as st:
        before = {n: np.concatenate([b[n] for _, b in st.iter_blocks([n])]) for n in st.layers}
    emp = read_layers(precond_path(out, "ekfac"), ("A", "S", "Lambda"))
    r = CliRunner().invoke(main, ["precondition", str(out), "--method", "ekfac", "--fisher", "true", "--seed", "2",
                                  "--device", "cpu", "--quiet"])
    assert r.exit_code == 0 and "true Fisher" in r.output, r.output
    with Store(out) as st:
        after = {n: np.concatenate([b[n] for _, b in st.iter_blocks([n])]) for n in st.layers}
    assert all(np.array_equal(before[n], after[n]) for n in before), "stored rows must keep the observed labels"
    true = read_layers(precond_path(out, "ekfac"), ("A", "S", "Lambda"))
    entry = json.loads((out / "manifest.json").read_text())["preconditioners"]["ekfac"]
    assert entry["fit"]["fisher"] == "true" and entry["fit"]["fisher_seed"] == 2
    n = next(iter(true))
    assert np.allclose(true[n]["A"], emp[n]["A"], rtol=1e-6)
    for k in ("S", "Lambda"):
        assert not np.allclose(true[n][k], emp[n][k], rtol=0.05), k
    # built with --fisher true: no factors collected in the build pass (they would be the empirical ones)
    out2 = tmp_path / "idx2"
    build_index(model, tok, data, out2, replace(cfg, fisher="true", fisher_seed=2), model_id=str(gpt2_dir),
                data_id=str(text_jsonl), progress=False)
    with Store(out2) as st:
        assert all("covariance" not in h5py.File(p, "r") for p in st.paths)
    built = read_layers(precond_path(out2, "ekfac"), ("A", "S", "Lambda"))
    assert np.allclose(built[n]["Lambda"], true[n]["Lambda"], rtol=1e-9)
    # the true Fisher's Λ* is the mean square of sampled-label rows rotated into its eigenbasis:
    # with the same seed a second fit reproduces it exactly
    fit_preconditioner(out, FitConfig(method="ekfac", fisher="true", seed=2, device="cpu"), model, tok, data)
    again = read_layers(precond_path(out, "ekfac"))
    assert np.allclose(again[n]["Lambda"], true[n]["Lambda"], rtol=1e-9)


def test_a_true_fisher_full_space_fit_is_refused_not_fitted_empirically(default_index, gpt2_dir, text_jsonl, tmp_path):
    """precondition --space full --fisher true wrote the empirical fit and recorded "fisher": "true"."""
    import shutil

    from gradindex.checksum import read_checksums
    from tests.conftest import refused

    with pytest.raises(ValueError, match="the full-space fit .* takes the empirical Fisher"):
        FitConfig(method="ekfac", space="full", fisher="true")
    d = tmp_path / "idx"
    shutil.copytree(default_index, d)
    before = read_checksums(d)
    res = CliRunner().invoke(main, ["precondition", str(d), "--method", "ekfac", "--space", "full", "--fisher",
                                    "true", "--device", "cpu"])
    refused(res.exit_code, res.output, None, "--fisher true is the stored-space fit's", "drop --fisher true")
    assert read_checksums(d) == before and not precond_path(d, "ekfac-full").exists()
    out = tmp_path / "b"
    res = CliRunner().invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--rerank-fit",
                                    "--fisher", "true", "--device", "cpu", "--quiet"])
    refused(res.exit_code, res.output, out, "--fisher true is the stored-space fit's")
