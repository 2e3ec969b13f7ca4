"""Optimizer-aware influence: rows stored as ``P_g (G ⊘ (√v + ε)) P_aᵀ`` from a real AdamW state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import make_texts
from safetensors.torch import load_file, save_file
from torch.func import functional_call, grad

from gradindex.capture import ProjectionSpec, projection_matrix
from gradindex.capture.adam import load_second_moments, save_second_moments
from gradindex.cli import main
from gradindex.data import collate, load_records, per_example_loss, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, IndexConfig, build_index
from gradindex.precondition import FitConfig, available_methods, fit_preconditioner
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import IndexMismatchError, read_manifest
from gradindex.store import Store

EPS = 1e-8


class NotATensor:
    """A pickled object that ``weights_only=True`` must refuse."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer):
    """A tiny GPT-2 after 6 AdamW steps, its optimizer state (torch and safetensors) and data."""
    from fixtures.tiny import save_model_dir, tiny_gpt2

    d = tmp_path_factory.mktemp("adam")
    model = tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=4, seed=5)
    texts = make_texts(24, seed=7)
    seqs = [tokenizer(t)["input_ids"] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(6):
        b = collate(seqs[4 * step: 4 * step + 4], seqs[4 * step: 4 * step + 4], tokenizer.pad_token_id)
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model_dir = save_model_dir(model, tokenizer, d / "model")
    torch.save(opt.state_dict(), d / "opt.pt")
    save_second_moments(opt, model, d / "adam.safetensors")
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:10]))
    return {"dir": d, "model": model_dir, "pt": d / "opt.pt", "st": d / "adam.safetensors", "data": data}


def _build(trained, out, proj="8x6", index=None, **cfg):
    model, tok = load_causal_lm(trained["model"], device="cpu")
    data = tokenize_records(load_records(trained["data"]), tok, 64)
    bcfg = BuildConfig.raw(projection=ProjectionSpec.parse(proj, seed=2), batch_size=4, max_length=64, **cfg)
    build_index(model, tok, data, out, bcfg, index=index, model_id=str(trained["model"]),
                data_id=str(trained["data"]), progress=False)
    return model, tok, data


def _reference_G(model, data):
    """Per-example parameter gradients by torch.func, each example alone."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(p, x, y):
        logits = functional_call(model, p, (x.unsqueeze(0),)).logits
        return per_example_loss(logits, y.unsqueeze(0))[0].sum()

    return [grad(loss_fn)(params, torch.tensor(x), torch.tensor(y)) for x, y in zip(data.input_ids, data.labels)]


def _as_G(t, name):  # Conv1D weight [N_i, N_o] and bias [N_o] → [N_o, N_i+1]
    return torch.cat([t[name + ".weight"].T, t[name + ".bias"][:, None]], dim=1).double()


def _adam_weight(V: torch.Tensor, mode: str | None, eps: float = EPS) -> torch.Tensor:
    """The dense Adam weight on ``G`` ``[N_o, N_i+1]`` (ones for plain gradients)."""
    if mode is None:
        return torch.ones_like(V)
    if mode == "exact":
        return 1.0 / (V.sqrt() + eps)
    # Adafactor's rank-1 v ≈ r cᵀ / Σr, square root split between the sides, √ε added to each
    r, c = V.sum(1), V.sum(0)
    s = r.sum()
    return 1.0 / ((torch.sqrt(r / s.sqrt()) + eps**0.5)[:, None] * (torch.sqrt(c / s.sqrt()) + eps**0.5)[None])


def _dense_rows(ref, v, name, mode, spec) -> np.ndarray:
    """``[n, k_g·k_a]`` rows ``P_g (G ⊙ W) P_aᵀ`` of layer ``name`` from torch.func gradients ``ref``."""
    V = _as_G(v, name)  # [N_o, N_i+1]
    W = _adam_weight(V, mode)
    P_g = projection_matrix(spec, name, "g", V.shape[0]).double()
    P_a = projection_matrix(spec, name, "a", V.shape[1]).double()
    return np.stack([(P_g @ (_as_G(g, name) * W) @ P_a.T).reshape(-1).numpy() for g in ref])


def _stored(out):
    with Store(out) as st:
        return {n: np.concatenate([b[n] for _, b in st.iter_blocks([n])]) for n in st.layers}


@pytest.mark.parametrize("mode,source,route", [("exact", "pt", "auto"), ("factored", "st", "factorized"),
                                               ("factored", "pt", "materialized")])
def test_rows_equal_dense_adam_preconditioned_projection(tmp_path, trained, mode, source, route):
    out = tmp_path / "idx"
    model, tok, data = _build(trained, out, optimizer_state=str(trained[source]), adam_mode=mode, route=route)
    sd = torch.load(trained["pt"], weights_only=True)
    v = {n: sd["state"][i]["exp_avg_sq"] for i, (n, _) in enumerate(model.named_parameters())}
    ref = _reference_G(model, data)
    rows = _stored(out)
    spec = ProjectionSpec.parse("8x6", seed=2)
    for name, got in rows.items():
        expect = _dense_rows(ref, v, name, mode, spec)
        err = np.linalg.norm(got - expect) / np.linalg.norm(expect)
        assert err < 1e-4, (name, err)
    m = read_manifest(out)
    assert m["build"]["optimizer"]["mode"] == mode and len(m["build"]["optimizer"]["sha256"]) == 64
    assert available_methods(out) == ["adam"]
    if mode == "exact":
        assert m["routes"] == {"materialized": len(rows) * 3}, "exact mode needs the materialized route"


def test_factored_exact_and_plain_rows_differ_as_much_as_their_dense_references(tmp_path, trained):
    """How far each mode's rows are from exact Adam's is what the dense torch.func references say, to
    1e-4 (a build that ignored ``adam_mode``, or applied the exact weight in factored mode, gives
    correlation 1 where the reference gives less)."""
    rows, modes = {}, {"exact": "exact", "factored": "factored", "plain": None}
    for name, mode in modes.items():
        kw = {"optimizer_state": str(trained["st"]), "adam_mode": mode} if mode else {}
        model, _, data = _build(trained, tmp_path / name, **kw)
        rows[name] = np.concatenate(list(_stored(tmp_path / name).values()), axis=1)
    sd = torch.load(trained["pt"], weights_only=True)
    v = {n: sd["state"][i]["exp_avg_sq"] for i, (n, _) in enumerate(model.named_parameters())}
    ref, spec = _reference_G(model, data), ProjectionSpec.parse("8x6", seed=2)
    layers = list(_stored(tmp_path / "exact"))
    dense = {name: np.concatenate([_dense_rows(ref, v, n, mode, spec) for n in layers], axis=1)
             for name, mode in modes.items()}
    for k in ("factored", "plain"):
        got = float(np.corrcoef(rows["exact"].ravel(), rows[k].ravel())[0, 1])
        want = float(np.corrcoef(dense["exact"].ravel(), dense[k].ravel())[0, 1])
        assert want < 0.999 and abs(got - want) < 1e-4, (k, got, want)


def test_a_live_optimizer_state_file_keeps_the_optimizers_eps(tmp_path):
    """The state file written during training records the optimizer's eps; read back, it is that eps,
    not the default 1e-8 (it was, when the training-time writer left eps out of the metadata)."""
    from fixtures.tiny import tiny_gpt2
    from gradindex.integrations.optimizer_state import save_second_moments as save_live

    model = tiny_gpt2(vocab_size=50, n_layer=1, n_embd=16, n_head=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    ids = torch.randint(0, 50, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    entry = save_live(opt, model, tmp_path, step=1)
    moments = load_second_moments(tmp_path / entry["file"], model)
    assert set(moments.eps.values()) == {1e-3}
    offline = save_second_moments(opt, model, tmp_path / "offline.safetensors")
    assert set(load_second_moments(offline, model).eps.values()) == {1e-3}


def test_queries_get_the_same_transform_and_methods_do_not_mix(tmp_path, trained):
    out = tmp_path / "idx"
    model, tok, data = _build(trained, out, index=IndexConfig(), optimizer_state=str(trained["pt"]),
                              adam_mode="factored")
    rows = _stored(out)
    with QueryEngine(out, device="cpu", use_gpu=False) as eng:
        q, _, _ = eng.gradients(eng.tokenize([load_records(trained["data"])[3]["text"]]))
        for n, r in rows.items():
            assert np.allclose(q[n][0].numpy(), r[3], rtol=1e-4, atol=1e-6 * np.abs(r[3]).max())
        res = eng.query(load_records(trained["data"])[3]["text"], k=3, method="adam")
        dots = sum(rows[n] @ q[n][0].double().numpy() for n in rows)
        assert res.hits[0].id == int(np.argmax(dots)) and np.isclose(res.hits[0].score, dots.max(), rtol=1e-5)
        with pytest.raises(ValueError, match="adam only"):
            eng.query("the cat", method="graddot")
        norms = np.sqrt(sum((rows[n].astype(np.float64) ** 2).sum(1) for n in rows))
        sn = eng.query(load_records(trained["data"])[3]["text"], k=10, method="adam-selfnorm")
        assert np.allclose([h.score for h in sn.hits], np.sort(dots / norms)[::-1], rtol=1e-4)
    s = score_matrix(out, {n: v.numpy() for n, v in q.items()}, "adam", device="cpu")
    assert np.allclose(s[0], dots, rtol=1e-5)
    with pytest.raises(ValueError, match="Adam-preconditioned"):
        fit_preconditioner(out, FitConfig(method="kfac"), model, tok, data)
    plain = tmp_path / "plain"
    _build(trained, plain)
    with pytest.raises(ValueError, match="--optimizer-state"):
        score_matrix(plain, {n: v.numpy() for n, v in q.items()}, "adam", device="cpu")
    with pytest.raises(ValueError, match="K-FAC"):
        BuildConfig.raw(optimizer_state=str(trained["pt"]), precondition="ekfac")
    # a changed state file is another index: resuming into it, or querying with it, is refused
    other = tmp_path / "other.safetensors"
    t = load_file(str(trained["st"]))
    save_file({k: v * 2 for k, v in t.items()}, str(other))
    with pytest.raises(IndexMismatchError, match="optimizer"):
        QueryEngine(out, device="cpu", use_gpu=False, optimizer_state=other)
    with pytest.raises(IndexMismatchError, match="optimizer"):
        _build(trained, out, optimizer_state=str(other), adam_mode="factored")


def test_loading_refuses_pickles_and_mismatched_states(tmp_path, trained, tokenizer):
    from fixtures.tiny import tiny_gpt2

    model, _ = load_causal_lm(trained["model"], device="cpu")
    sd = torch.load(trained["pt"], weights_only=True)
    a = load_second_moments(trained["pt"], model)
    b = load_second_moments(trained["st"], model)
    assert set(a.v) == set(b.v) == {n for n, _ in model.named_parameters()}
    assert all(torch.allclose(a.v[n], b.v[n]) for n in a.v) and set(a.eps.values()) == {EPS}

    bad = tmp_path / "pickled.pt"
    torch.save({**sd, "extra": NotATensor()}, bad)
    with pytest.raises(ValueError, match="weights_only=True"):
        load_second_moments(bad, model)
    st = load_file(str(trained["st"]))
    renamed = tmp_path / "renamed.safetensors"
    save_file({"other." + k: v for k, v in st.items()}, str(renamed))
    with pytest.raises(ValueError, match="does not have"):
        load_second_moments(renamed, model)
    # HF Trainer-style groups (weights first, then biases and norms) cannot be mapped by model order
    names = [n for n, _ in model.named_parameters()]
    order = [i for i, n in enumerate(names) if n.endswith(".weight") and "ln" not in n]
    order += [i for i in range(len(names)) if i not in order]
    regrouped = {"state": {j: sd["state"][i] for j, i in enumerate(order)},
                 "param_groups": [{**sd["param_groups"][0], "params": list(range(len(order)))}]}
    torch.save(regrouped, tmp_path / "regrouped.pt")
    with pytest.raises(ValueError, match="another order"):
        load_second_moments(tmp_path / "regrouped.pt", model)
    # ... but named groups (optimizer given named_parameters) map by name
    named = {**regrouped, "param_groups": [{**regrouped["param_groups"][0], "param_names": [names[i] for i in order]}]}
    torch.save(named, tmp_path / "named.pt")
    assert torch.equal(load_second_moments(tmp_path / "named.pt", model).v[names[0]], a.v[names[0]])
    small = tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=16, n_head=4)
    with pytest.raises(ValueError, match="shape"):
        load_second_moments(trained["pt"], small)
    r = CliRunner().invoke(main, ["build", str(trained["model"]), str(trained["data"]), "--out",
                                  str(tmp_path / "x"), "--optimizer-state", str(bad), "--quiet"])
    lines = [ln for ln in r.output.splitlines() if not ln.startswith("plan: ")]  # build prints its plan first
    assert r.exit_code != 0 and lines[0].startswith("Error: ") and "Traceback" not in r.output


def test_cli_builds_an_adam_index_that_info_lists_and_query_answers(tmp_path, trained):
    out = tmp_path / "idx"
    r = CliRunner().invoke(main, ["build", str(trained["model"]), str(trained["data"]), "--out", str(out),
                                  "--projection", "8", "--optimizer-state", str(trained["st"]),
                                  "--adam-mode", "factored", "--device", "cpu", "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0 and "methods    adam" in r.output, r.output
    r = CliRunner().invoke(main, ["query", str(out), "--text", "the cat sat", "-k", "2", "--json",
                                  "--device", "cpu", "--cpu-index"])
    assert r.exit_code == 0, r.output  # the default method of an Adam index is adam (graddot is refused)
    assert len(json.loads(r.output.splitlines()[-1])) == 2
    r = CliRunner().invoke(main, ["query", str(out), "--text", "the cat", "--method", "ekfac", "--cpu-index"])
    assert r.exit_code != 0 and "adam only" in r.output
