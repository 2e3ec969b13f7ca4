"""Captured per-example gradients equal torch.func gradients computed independently."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.func import functional_call, grad

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace, projection_matrix, select_layers
from gradindex.capture.batch import batch_gradients
from gradindex.capture.routing import choose_route
from gradindex.data import IGNORE, per_example_loss
from gradindex.model import load_causal_lm


def _examples(tokenizer):
    texts = ["the cat sat on a mat", "dog ran far away from home and ate fish at noon under blue sky",
             "red sun", "old town river near green hills with some bread"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    labels = [list(x) for x in ids]
    labels[1] = [IGNORE] * 4 + labels[1][4:]  # a prompt whose loss is masked
    return ids, labels


def _reference(model, ids, labels):
    """Per-example weight gradients by torch.func on each example alone (no padding)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(p, x, y):
        logits = functional_call(model, p, (x.unsqueeze(0),)).logits
        return per_example_loss(logits, y.unsqueeze(0))[0].sum()

    return [grad(loss_fn)(params, torch.tensor(x), torch.tensor(y)) for x, y in zip(ids, labels)]


def _G(capture, name, g):
    info = capture.infos[name]
    return info.weight_grad_to_G(g[name + ".weight"], g.get(name + ".bias"))


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("which", ["gpt2_dir", "llama_dir"])
@pytest.mark.parametrize(("proj", "route"), [("none", "materialized"), ("8x6", "factorized"),
                                             ("8x6", "materialized")])  # unprojected rows have one route
def test_stored_rows_equal_torch_func_gradients(request, tokenizer, which, route, proj):
    model, tok = load_causal_lm(request.getfixturevalue(which), device="cpu")
    spec = ProjectionSpec.parse(proj, seed=3)
    ids, labels = _examples(tok)
    assert len({len(x) for x in ids}) > 1, "the batch must be padded"
    ref = _reference(model, ids, labels)
    model.requires_grad_(False)
    with GradientCapture(model, None, rows := ProjectedRows(RowSpace(spec), route)) as cap:
        bg = batch_gradients(model, cap, ids, labels, tok.pad_token_id)
    assert set(rows.route_counts) == {route}, "the route under test was not the one that ran"
    assert set(bg.grads) == set(select_layers(model))
    for name, rows in bg.grads.items():
        expect = []
        for i in range(len(ids)):
            G = _G(cap, name, ref[i])
            if not spec.is_identity:
                P_a = projection_matrix(spec, name, "a", G.shape[1])
                P_g = projection_matrix(spec, name, "g", G.shape[0])
                G = P_g @ G @ P_a.T
            expect.append(G.reshape(-1))
        # Relative error per row; a row that is analytically ~0 (e.g. attention queries of a
        # one-key sequence) is measured against the layer's largest row instead.
        floor = 1e-3 * max(float(e.norm()) for e in expect)
        for i, e in enumerate(expect):
            err = float((rows[i] - e).norm()) / max(float(e.norm()), floor)
            assert err < 1e-4, (name, i, err)
    assert all(p.grad is None for p in model.parameters()), "weight-free capture left .grad"


def test_routes_agree_and_auto_uses_cost_model(gpt2_dir, tokenizer):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    ids, labels = _examples(tok)
    spec = ProjectionSpec(k_a=32, k_g=32, seed=1)
    out = {}
    for route in ("factorized", "materialized", "auto"):
        with GradientCapture(model, None, rows := ProjectedRows(RowSpace(spec), route)) as cap:
            out[route] = batch_gradients(model, cap, ids, labels, tok.pad_token_id).grads
            counts = dict(rows.route_counts)
        if route == "auto":
            auto_counts = Counter(counts)
        else:
            assert set(counts) == {route}
    for name in out["auto"]:
        assert _rel(out["factorized"][name], out["materialized"][name]) < 1e-5
        assert _rel(out["auto"][name], out["factorized"][name]) < 1e-5
    # auto took, layer by layer, the route the cost model picks for this batch's shape (computed here
    # from the layers' sizes, not read back from the capture); both routes occur, so a constant fails
    B, T = len(ids), max(map(len, ids))
    space = RowSpace(spec).bind(GradientCapture(model).infos)
    want = Counter(choose_route(B, T, i.n_in_total, i.n_out, space.dims(n)[1], space.dims(n)[0])
                   for n, i in space.infos.items())
    assert auto_counts == want and len(want) == 2, (auto_counts, want)


def test_live_capture_in_a_training_loop_matches_weight_free(gpt2_dir, tokenizer):
    """Tensor hooks inside a user's own loss.backward() give the same rows as the offline path."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    ids, labels = _examples(tok)
    spec = ProjectionSpec(k_a=8, k_g=8, seed=0)
    with GradientCapture(model, None, ProjectedRows(RowSpace(spec))) as cap:
        offline = batch_gradients(model, cap, ids, labels, tok.pad_token_id).grads
    model.requires_grad_(True)
    from gradindex.data import collate

    b = collate(ids, labels, tok.pad_token_id)
    with GradientCapture(model, None, ProjectedRows(RowSpace(spec)), weight_free=False) as cap:
        cap.set_mask(b["attention_mask"])
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        per_example_loss(logits, b["labels"])[0].sum().backward()
        live = cap.pop()
    assert model.transformer.h[0].mlp.c_fc.weight.grad is not None
    for name in offline:
        assert _rel(live[name], offline[name]) < 1e-5


def test_gradients_do_not_depend_on_batch_composition(gpt2_dir, tokenizer):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    ids, labels = _examples(tok)
    spec = ProjectionSpec(k_a=8, k_g=8)
    with GradientCapture(model, None, ProjectedRows(RowSpace(spec))) as cap:
        full = batch_gradients(model, cap, ids, labels, tok.pad_token_id).grads
        alone = batch_gradients(model, cap, ids[2:3], labels[2:3], tok.pad_token_id).grads
    for name in full:
        assert _rel(alone[name][0], full[name][2]) < 1e-5


def test_bf16_model_accumulates_in_fp32(gpt2_dir, tokenizer):
    model32, tok = load_causal_lm(gpt2_dir, device="cpu")
    model16, _ = load_causal_lm(gpt2_dir, dtype="bfloat16", device="cpu")
    ids, labels = _examples(tok)
    spec = ProjectionSpec(k_a=8, k_g=8)
    res = {}
    for key, m in (("32", model32), ("16", model16)):
        with GradientCapture(m, None, ProjectedRows(RowSpace(spec))) as cap:
            res[key] = batch_gradients(m, cap, ids, labels, tok.pad_token_id).grads
    for name in res["32"]:
        assert res["16"][name].dtype == torch.float32
        assert _rel(res["16"][name], res["32"][name]) < 0.1


def test_layer_pattern_that_matches_nothing_names_real_modules(gpt2_dir):
    model, _ = load_causal_lm(gpt2_dir, device="cpu")
    with pytest.raises(ValueError, match=r"matched no module.*transformer\.h\.0"):
        select_layers(model, ["mlp.*"])
    chosen = select_layers(model, ["*.mlp.*"])
    assert list(chosen) == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                            "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"]
    default = select_layers(model)
    assert "lm_head" not in default and len(default) == 8
