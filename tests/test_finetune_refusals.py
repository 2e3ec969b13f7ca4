"""Issue 19's bad input through ``gradindex build``: an adapter that does not fit the base, a chat record
without an assistant turn, a tokenizer without a chat template and none given, an MoE layout no rule
covers. Each is one ``Error:`` line that names the fix, with nothing written to ``--out``."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from fixtures.tiny import CHATML_TRAINING, chat_tokenizer, save_model_dir, tiny_qwen2
from gradindex.cli import main

CHATS = [[{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"it is {i}"}]
         for i in range(6)]


def _build(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["build", *map(str, args), "--device", "cpu", "--projection", "4"])
    return r.exit_code, r.output


def _refused(code: int, output: str, out, *fix: str) -> None:
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("plan:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), output
    assert "Traceback" not in output
    for words in fix:
        assert words in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer has no chat template, and the template file to give it."""
    root = tmp_path_factory.mktemp("refusals")
    tok = chat_tokenizer([m["content"] for c in CHATS for m in c], template=None)
    model_dir = save_model_dir(tiny_qwen2(vocab_size=len(tok)), tok, root / "model")
    template = root / "chatml.jinja"
    template.write_text(CHATML_TRAINING)
    return model_dir, template


def _chat_file(path, chats) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def test_a_chat_record_without_an_assistant_turn(chat_model, tmp_path):
    model_dir, template = chat_model
    data = _chat_file(tmp_path / "d.jsonl", CHATS[:3] + [[{"role": "user", "content": "hello?"}]] + CHATS[3:])
    out = tmp_path / "idx"
    _refused(*_build(model_dir, data, "--out", out, "--chat-template", template), out,
             "row 3", "no assistant turn", "add the assistant")


def test_a_tokenizer_without_a_chat_template_and_none_given(chat_model, tmp_path):
    model_dir, _ = chat_model
    data = _chat_file(tmp_path / "d.jsonl", CHATS)
    out = tmp_path / "idx"
    _refused(*_build(model_dir, data, "--out", out), out, "no chat template", "--chat-template FILE")


def test_an_adapter_that_does_not_fit_the_base(chat_model, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'gradindex[peft]' or '[dev]')")
    from tests.test_adapter import make_adapter

    model_dir, template = chat_model
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    other = save_model_dir(tiny_qwen2(vocab_size=len(tok), hidden=48, n_head=4, intermediate=64), tok,
                           tmp_path / "other")
    wrong = make_adapter(other, tmp_path / "wrong")
    data = _chat_file(tmp_path / "d.jsonl", CHATS)
    out = tmp_path / "idx"
    _refused(*_build(model_dir, data, "--out", out, "--chat-template", template, "--adapter", wrong), out,
             "does not fit this base model", "base model it was trained from")


def test_an_moe_layout_no_rule_covers(tmp_path, monkeypatch):
    import gradindex.model

    tok = chat_tokenizer([m["content"] for c in CHATS for m in c], template=None)
    torch.manual_seed(0)
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    model_dir = save_model_dir(moe, tok, tmp_path / "moe")
    load = gradindex.model.load_causal_lm

    def with_a_norm_after_the_experts(*a, **k):  # a layout (as muse_spark's) that no capture rule computes
        model, tokenizer = load(*a, **k)
        for layer in model.model.layers:
            layer.mlp.experts.has_post_expert_norm = True
        return model, tokenizer

    monkeypatch.setattr(gradindex.model, "load_causal_lm", with_a_norm_after_the_experts)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"what is {i} it is {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "idx"
    _refused(*_build(model_dir, data, "--out", out), out,
             "model.layers.*.mlp.experts.gate_up_proj is a fused 3-D weight", "--layers", "register_group")
