"""Fused mixture-of-experts weights: per-expert per-example gradients equal torch.func's on tiny Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss configs (with padding); the share of non-embedding parameters
attributed; an expert layout no rule covers is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace, select_layers
from gradindex.capture.batch import batch_gradients
from gradindex.capture.hooks import attributed_share, unhooked_weights
from gradindex.data import per_example_loss

V = 96


def configs() -> dict:
    common = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=24, moe_intermediate_size=24, shared_expert_intermediate_size=20,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False)),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=8, intermediate_size=24, moe_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
        "gpt_oss": lambda: _gpt_oss(common),
    }


def _gpt_oss(common: dict) -> torch.nn.Module:
    """A tiny gpt-oss: transposed expert weights with biases, interleaved and clamped gate/up (swiglu_limit
    small enough that some clamps bind), a biased router."""
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **common, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        layer_types=["sliding_attention", "full_attention"], sliding_window=4))
    with torch.no_grad():
        for layer in model.model.layers:  # (the biases and sinks start at zero; make them count)
            for p in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias, layer.mlp.router.bias):
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("arch", list(configs()))
def test_per_expert_gradients_equal_torch_func(arch):
    torch.manual_seed(0)
    model = configs()[arch]().eval()
    seqs = [[5, 9, 12, 40, 7, 3, 22, 61], [8, 1, 30], [14, 2, 2, 9, 60, 33]]
    with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec(kind="none", k_a=0, k_g=0)))) as cap:
        experts = [n for n in cap.infos if cap.infos[n].kind == "expert"]
        assert len(experts) == 2 * 4 * 2  # two matrices of four experts, two blocks
        rows = batch_gradients(model, cap, seqs, seqs, pad_id=0).grads
    share = attributed_share(model, cap.modules)
    assert share >= 0.95, share
    assert not [g for g in unhooked_weights(model, cap.modules) if "experts" in g]
    fused = {n: p for n, p in model.named_parameters() if ".experts." in n}
    worst = 0.0
    for b, ids in enumerate(seqs):
        x = torch.tensor([ids])

        def loss(params, x=x):
            out = torch.func.functional_call(model, {**dict(model.named_parameters()), **params},
                                             kwargs={"input_ids": x, "use_cache": False})
            return per_example_loss(out.logits, x)[0].sum()

        ref = torch.func.grad(loss)({n: p.detach() for n, p in fused.items()})
        for name in experts:
            group, side, e = name.rsplit(".", 2)
            bias = ref.get(f"{group}.{side}_bias")
            want = cap.infos[name].weight_grad_to_G(ref[f"{group}.{side}"][int(e)],
                                                    None if bias is None else bias[int(e)]).reshape(-1)
            got = rows[name][b].detach()
            if want.norm() == 0:  # no token of this example was routed to expert e
                assert got.abs().max() == 0
                continue
            worst = max(worst, float((got - want).norm() / want.norm()))
    assert worst <= 1e-5, worst


def test_the_attributed_share_per_architecture():
    out = {}
    for arch, make in configs().items():
        model = make()
        out[arch] = attributed_share(model, select_layers(model))
    assert all(s >= 0.95 for s in out.values()), out


def test_an_expert_layout_no_rule_covers_is_one_line():
    torch.manual_seed(0)
    model = configs()["mixtral"]()
    for layer in model.model.layers:
        layer.mlp.experts.has_post_expert_norm = True  # a norm after the experts: no rule computes it
    with pytest.raises(ValueError, match=r"model\.layers\.\*\.mlp\.experts\.gate_up_proj is a fused 3-D weight.*"
                                         r"--layers"):
        select_layers(model)
    chosen = select_layers(model, ["*self_attn*"])  # the other layers, chosen by name, are fine
    assert chosen and all("self_attn" in n for n in chosen)


def test_padding_and_batch_composition_do_not_change_expert_rows():
    torch.manual_seed(0)
    model = configs()["olmoe"]().eval()
    seqs = [[5, 9, 12, 40, 7, 3], [8, 1, 30]]
    spec = ProjectionSpec(k_a=4, k_g=4, seed=1)
    with GradientCapture(model, None, ProjectedRows(RowSpace(spec))) as cap:
        both = batch_gradients(model, cap, seqs, seqs, pad_id=0).grads
        alone = batch_gradients(model, cap, seqs[1:], seqs[1:], pad_id=0).grads
    for n in both:
        assert torch.allclose(both[n][1], alone[n][0], rtol=1e-4, atol=1e-6), n


def test_an_moe_index_end_to_end(tmp_path, tokenizer, text_jsonl):
    """Default build (per-expert projection, EK-FAC per expert, transcode) and a query on a tiny Mixtral."""
    import json

    from click.testing import CliRunner

    from fixtures.tiny import save_model_dir
    from gradindex.cli import main
    from gradindex.query import QueryEngine

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    model_dir = save_model_dir(model, tokenizer, tmp_path / "mixtral")
    out = tmp_path / "index"
    r = CliRunner().invoke(main, ["build", str(model_dir), str(text_jsonl), "--out", str(out), "--device", "cpu",
                                  "--quiet", "--max-length", "32"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    layers = json.loads((out / "manifest.json").read_text())["build"]["layers"]
    assert sum(v["kind"] == "expert" for v in layers.values()) == 16
    with QueryEngine(out, device="cpu") as engine:
        res = engine.query("the cat sat on a mat", k=3)
        assert res.method == "ekfac-selfnorm" and len(res.hits) == 3  # a query's default
