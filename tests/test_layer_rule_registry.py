"""Layer rules are one registry: a module type whose rule is registered in this test file alone (no other
module touched) is hooked by the default selection, captured on both routes and stored by a build, and its
rows equal torch.func per-example gradients of the module's own weight (projected by the same matrices)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace, projection_matrix, select_layers
from gradindex.capture.batch import batch_gradients
from gradindex.capture.layers import _RULES, LayerInfo, register_layer, stack
from gradindex.data import per_example_loss
from gradindex.model import load_causal_lm


class Doubled(nn.Module):
    """``y = 2 (x Wᵀ) + b``: a weight matrix no built-in rule covers (not an ``nn.Linear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * (x @ self.weight.T) + self.bias


@pytest.fixture
def doubled_rule():
    """Its rule: ``G = Σ_t g_t (2 a_t)ᵀ`` — the factors are twice the input and the output gradient."""
    @register_layer(Doubled)
    def doubled(m: Doubled) -> LayerInfo:
        return LayerInfo(m.weight.shape[1], m.weight.shape[0], True, "doubled", stack,
                         factors=lambda mod, inputs, grad_output: (2 * inputs[0], grad_output))

    yield doubled
    del _RULES[Doubled]


def _model(gpt2_dir):
    """The tiny GPT-2 with block 0's ``mlp.c_fc`` (a Conv1D) replaced by the same function as a Doubled."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    fc = model.transformer.h[0].mlp.c_fc
    model.transformer.h[0].mlp.c_fc = Doubled(fc.weight.detach().T.contiguous() / 2, fc.bias.detach().clone())
    return model, tok


@pytest.mark.parametrize(("proj", "route"), [("none", "materialized"), ("8x6", "factorized"),
                                             ("8x6", "materialized")])
def test_a_registered_layer_rule_is_captured_like_torch_func(doubled_rule, gpt2_dir, proj, route):
    model, tok = _model(gpt2_dir)
    name = "transformer.h.0.mlp.c_fc"
    assert name in select_layers(model)  # the default selection hooks it
    texts = ["the cat sat on a mat", "red sun over green hills far away", "old town"]
    ids = [tok(t)["input_ids"] for t in texts]
    labels = [list(x) for x in ids]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(p, x, y):
        return per_example_loss(functional_call(model, p, (x.unsqueeze(0),)).logits, y.unsqueeze(0))[0].sum()

    ref = [grad(loss_fn)(params, torch.tensor(x), torch.tensor(y)) for x, y in zip(ids, labels, strict=True)]
    spec = ProjectionSpec.parse(proj, seed=2)
    model.requires_grad_(False)
    with GradientCapture(model, [name], visitor := ProjectedRows(RowSpace(spec), route)) as cap:
        rows = batch_gradients(model, cap, ids, labels, tok.pad_token_id).grads[name]
    assert cap.infos[name].kind == "doubled" and set(visitor.route_counts) == {route}
    for i, g in enumerate(ref):
        G = torch.cat([g[name + ".weight"], g[name + ".bias"][:, None]], dim=1)  # [N_o, N_i + 1]
        if not spec.is_identity:
            G = projection_matrix(spec, name, "g", G.shape[0]) @ G @ projection_matrix(spec, name, "a", G.shape[1]).T
        err = float((rows[i] - G.reshape(-1)).norm() / G.norm())
        assert err < 1e-4, (i, err)


def test_a_registered_layer_rule_is_stored_by_a_build(doubled_rule, gpt2_dir, text_jsonl, tmp_path):
    from gradindex.data import load_records, tokenize_records
    from gradindex.pipeline import BuildConfig, build_index

    model, tok = _model(gpt2_dir)
    data = tokenize_records(load_records(text_jsonl), tok, 32)
    res, _ = build_index(model, tok, data, tmp_path / "idx", BuildConfig.raw(projection=ProjectionSpec.parse("4"),
                                                                               max_length=32), progress=False)
    layer = res.manifest["build"]["layers"]["transformer.h.0.mlp.c_fc"]
    assert layer["kind"] == "doubled" and (layer["rows"], layer["cols"]) == (4, 4)
