"""The default pipeline on many causal-LM architectures, each a tiny model built from its config.

Per architecture: the layers hooked by default (every linear layer of the attention and the MLP,
not the embeddings nor the LM head), the default ``gradindex build`` (auto projection, EK-FAC,
int4 rows in the whitened eigenbasis) and ``verify``, ``query``, ``explain``, ``outliers``, ``dedup``
and ``audit``. For a few, GradDot scores of an unprojected float32 build against per-example
gradients from ``torch.func``, and the default index's EK-FAC ranking against full-space EK-FAC.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner

from gradindex.capture import GradientCapture, select_layers, unhooked_weights
from gradindex.cli import main
from tests.conftest import make_texts

LLAMA_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QKVO = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
FUSED = ("query_key_value", "dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
              intermediate_size=48)

# name -> (config class, config arguments, hooked modules of each block, what the case covers)
ARCHS = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, n_positions=128),
             ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), "Conv1D, fused qkv, tied"),
    "llama": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, tie_word_embeddings=False),
              QKVO + LLAMA_MLP, "GQA, bias-less, untied"),
    "mistral": ("MistralConfig", dict(COMMON, num_key_value_heads=2), QKVO + LLAMA_MLP, "GQA, untied"),
    "qwen2": ("Qwen2Config", dict(COMMON, num_key_value_heads=2, tie_word_embeddings=True),
              QKVO + LLAMA_MLP, "GQA, q/k/v bias only, tied"),
    "gpt_neox": ("GPTNeoXConfig", COMMON, tuple("attention." + s for s in FUSED[:2]) + FUSED[2:],
                 "fused qkv, untied"),
    "opt": ("OPTConfig", dict(COMMON, ffn_dim=48, word_embed_proj_dim=32, dropout=0.0),
            ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj", "fc1", "fc2"),
            "MLP on flattened [B*T, d] tokens, tied"),
    "phi": ("PhiConfig", COMMON, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense",
                                  "mlp.fc1", "mlp.fc2"), "partial rotary, LM head bias, untied"),
    "phi3": ("Phi3Config", dict(COMMON, num_key_value_heads=2),
             ("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"),
             "fused qkv and gate/up, GQA, bias-less"),
    "gemma": ("GemmaConfig", dict(COMMON, num_key_value_heads=1, head_dim=8), QKVO + LLAMA_MLP,
              "multi-query, tied, scaled embeddings"),
    "gemma2": ("Gemma2Config", dict(COMMON, num_key_value_heads=2, head_dim=8, sliding_window=16),
               QKVO + LLAMA_MLP, "logit soft-capping (model's own logits), sliding window"),
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4),
              tuple("self_attention." + s for s in FUSED[:2]) + FUSED[2:], "fused qkv, ALiBi, tied"),
    "falcon": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
               tuple("self_attention." + s for s in FUSED[:2]) + FUSED[2:], "fused multi-query qkv, bias-less"),
}
N = 16
DUP = (3, 11)  # example 11 repeats example 3: dedup must group them
QUERY = "the cat sat on a mat near the old town"


def _cli(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def tiny_model(arch: str, vocab_size: int):
    cls_name, kw, _, _ = ARCHS[arch]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    torch.manual_seed(0)
    cfg = cls(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    texts = make_texts(N, seed=5, max_words=16)
    texts[DUP[1]] = texts[DUP[0]]
    p = tmp_path_factory.mktemp("arch-data") / "train.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return p


_BUILT: dict[str, tuple] = {}


@pytest.fixture
def built(request, tmp_path_factory, tokenizer, data_file):
    """``arch -> (model dir, default index)``, built once per module."""
    from fixtures.tiny import save_model_dir

    def get(arch: str):
        if arch not in _BUILT:
            root = tmp_path_factory.mktemp(arch)
            model_dir = save_model_dir(tiny_model(arch, len(tokenizer)), tokenizer, root / "model")
            _cli("build", model_dir, data_file, "--out", root / "idx", "--device", "cpu", "--quiet")
            _BUILT[arch] = (model_dir, root / "idx")
        return _BUILT[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_default_layers_build_and_apps(arch, built, tokenizer, tmp_path):
    from gradindex.model import load_causal_lm

    model_dir, idx = built(arch)
    model, _ = load_causal_lm(model_dir, device="cpu")
    # (a) every linear layer of attention and MLP in each block, nothing else (no embeddings, no LM head)
    chosen = select_layers(model)
    block_list = next(iter(chosen)).split(".0.")[0]
    assert len(model.get_submodule(block_list)) == 2
    want = {f"{block_list}.{i}.{s}" for i in range(2) for s in ARCHS[arch][2]}
    assert set(chosen) == want
    assert unhooked_weights(model, chosen) == []  # no weight matrix of a block is left out
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ("untied" in ARCHS[arch][3], ", tied" in ARCHS[arch][3]) in ((not tied, tied), (False, False))
    # (b) the default build is complete and verifies
    assert "intact" in _cli("verify", idx)
    # (d) the apps on it
    hits = json.loads(_cli("query", idx, "--text", QUERY, "-k", 3, "--json").splitlines()[0])
    assert len(hits) == 3 and all(0 <= h["id"] < N and np.isfinite(h["score"]) for h in hits)
    ex = json.loads(_cli("explain", idx, "--text", QUERY, "--id", hits[0]["id"], "--json").splitlines()[0])
    assert ex["id"] == hits[0]["id"] and abs(sum(ex["query"]["scores"]) - ex["score"]) <= 1e-3 * abs(ex["score"])
    assert len(ex["train"]["tokens"]) == len(ex["train"]["scores"]) > 1
    out = [json.loads(x) for x in _cli("outliers", idx, "--top", 3, "--json", "--no-text").splitlines()]
    assert len(out) == 3 and out[0]["self_influence"] >= out[-1]["self_influence"] > 0
    _cli("dedup", idx, "--out", tmp_path / "groups.jsonl", "--quiet")
    groups = [json.loads(x) for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert any(set(DUP) <= set(g["ids"]) for g in groups), groups
    if arch in ("llama", "opt", "falcon"):  # the report, on three (it is the slowest app)
        (tmp_path / "q.jsonl").write_text(json.dumps({"text": QUERY}) + "\n")
        _cli("audit", idx, "--queries", tmp_path / "q.jsonl", "--out", tmp_path / "report", "--k", 3, "--outliers", 3)
        assert (tmp_path / "report" / "report.html").stat().st_size > 1000


def _scores(idx, method: str, text: str) -> np.ndarray:
    hits = json.loads(_cli("query", idx, "--text", text, "-k", N, "--method", method, "--json").splitlines()[0])
    s = np.full(N, np.nan)
    s[[h["id"] for h in hits]] = [h["score"] for h in hits]
    assert not np.isnan(s).any()
    return s


def _ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x)).astype(float)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "opt"])
def test_scores_match_torch_func_and_default_ranks_like_full_space(arch, built, data_file, tmp_path):
    """GradDot of an unprojected float32 build = ⟨∇L_q, ∇L_t⟩ over the hooked layers' weights and biases
    from torch.func; the default index ranks like full-space EK-FAC."""
    from torch.func import functional_call, grad

    from gradindex.model import load_causal_lm

    model_dir, idx = built(arch)
    full = tmp_path / "full"
    _cli("build", model_dir, data_file, "--out", full, "--projection", "none", "--storage", "fp32",
         "--transcode", "none", "--device", "cpu", "--quiet")
    model, tok = load_causal_lm(model_dir, device="cpu")
    names = [f"{m}.{p}" for m, mod in select_layers(model).items() for p, _ in mod.named_parameters(recurse=False)]
    params = {k: v.detach() for k, v in model.named_parameters() if k in names}
    assert len(params) == len(names)

    def loss(p, ids):
        logits = functional_call(model, p, (ids[None],)).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")

    def flat(text):
        g = grad(loss)(params, torch.tensor(tok(text)["input_ids"]))
        return torch.cat([g[k].reshape(-1) for k in names]).double()

    texts = [json.loads(x)["text"] for x in data_file.read_text().splitlines()]
    train = torch.stack([flat(t) for t in texts])
    want = (train @ flat(QUERY)).detach().numpy()
    got = _scores(full, "graddot", QUERY)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    rho = np.corrcoef(_ranks(_scores(full, "ekfac", QUERY)), _ranks(_scores(idx, "ekfac", QUERY)))[0, 1]
    assert rho >= 0.95


def test_in_loop_capture_of_flattened_mlp_equals_offline_build(tmp_path, tokenizer):
    """OPT runs its MLP on tokens flattened to [B*T, d]: in-loop rows fold them back into examples."""
    from fixtures.tiny import save_model_dir
    from gradindex.data import records_from_texts, tokenize_records
    from gradindex.integrations import GradIndexCapture
    from tests.test_integrations import _offline, _rows, assert_rows_close, plain_loop

    data = tokenize_records(records_from_texts(make_texts(8, seed=3, max_words=12)), tokenizer, 64)
    model_dir = save_model_dir(tiny_model("opt", len(tokenizer)), tokenizer, tmp_path / "opt")
    off = _offline(model_dir, tokenizer, data, tmp_path / "off")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    plain_loop(model, data, tokenizer.pad_token_id,
               cap=lambda opt: GradIndexCapture(model, tmp_path / "live", optimizer=opt, projection="8",
                                                shard_size=16))
    assert_rows_close(_rows(tmp_path / "live")[1], _rows(off)[1], 1e-4)


def test_a_layer_not_run_once_per_token_is_refused(tokenizer):
    model = tiny_model("llama", len(tokenizer))
    cap = GradientCapture(model)
    name = next(iter(cap.infos))
    cap.set_mask(torch.ones(2, 5))
    a, g = cap.per_token(name, torch.zeros(10, 32), torch.zeros(10, 32))  # flattened tokens fold back
    assert a.shape == (2, 5, 32) and g.shape == (2, 5, 32)
    with pytest.raises(ValueError, match=r"not the batch's 2 x 5 token positions.*--layers"):
        cap.per_token(name, torch.zeros(7, 32), torch.zeros(7, 32))  # e.g. padding removed, or routed tokens


def _save(model, tokenizer, path):
    from fixtures.tiny import save_model_dir

    return save_model_dir(model, tokenizer, path)


def test_unsupported_models_are_refused_with_the_fix(tmp_path, tokenizer):
    V = len(tokenizer)
    bart = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                   decoder_ffn_dim=16, max_position_embeddings=64)
    llama = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, tie_word_embeddings=False)
    gpt2 = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=64, pad_token_id=0)
    cases = {
        "bart": (transformers.BartForConditionalGeneration(bart), r"encoder-decoder 'bart' model.*decoder-only"),
        "headless": (transformers.LlamaModel(llama),
                     r"saved as LlamaModel, with no causal LM head; 1 weight\(s\) missing: lm_head.weight.*random"),
        "classifier": (transformers.GPT2ForSequenceClassification(gpt2),
                       r"saved as GPT2ForSequenceClassification, not a causal LM: its weights score.weight"),
    }
    for case, (model, message) in cases.items():
        r = CliRunner().invoke(main, ["layers", str(_save(model, tokenizer, tmp_path / case))])
        assert r.exit_code == 2 and "AutoModelForCausalLM" in r.output, (case, r.output)
        assert re.search(message, " ".join(r.output.split())), (case, r.output)
    # an architecture that exists only as code in the model's folder: refused, never run nor asked about
    custom = _save(transformers.LlamaForCausalLM(llama), tokenizer, tmp_path / "custom")
    cfg = json.loads((custom / "config.json").read_text())
    cfg.update(model_type="mycustomlm", auto_map={"AutoModelForCausalLM": "modeling_my.MyLM"})
    (custom / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["layers", str(custom)], input="y\n")
    assert r.exit_code == 2 and re.search(r"'mycustomlm' model defined by code .*does not run", r.output), r.output


def test_mixture_of_experts_fused_experts_are_hooked_and_the_router_named(tmp_path, tokenizer):
    cfg = transformers.MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     num_local_experts=2, num_experts_per_tok=1)
    model = transformers.MixtralForCausalLM(cfg)
    chosen = select_layers(model)
    assert {"model.layers.0.mlp.experts.gate_up_proj.1", "model.layers.0.mlp.experts.down_proj.0"} <= set(chosen)
    left = unhooked_weights(model, chosen)
    assert left == ["model.layers.*.mlp.gate.weight"], left  # the router: a plain parameter, no rule
    out = _cli("layers", _save(model, tokenizer, tmp_path / "moe"))
    assert "* model.layers.0.mlp.experts.down_proj.1  expert 16->16" in out
    assert "! model.layers.*.mlp.gate.weight" in out and "% of the non-embedding parameters" in out
