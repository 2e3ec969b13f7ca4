"""Issue 31's bad input on every command that takes a model (build, plan, layers, query, explain, audit, serve,
dedup and outliers with ``--model``, precondition with chat ``--fit-data``): a GGUF file transformers cannot
de-quantize (an unknown architecture, a file whose tensors are not its architecture's, a torn file, not a GGUF),
a chat file whose template the tokenizer lacks (or a template that cannot render), an adapter whose base is not
the given model (other width, other model type and layer names, same shapes and other weights, a hub id). Each is
one ``Error:`` line naming the fix, exit 2, no traceback, nothing written."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from click.testing import CliRunner

from fixtures.tiny import CHATML_TRAINING, chat_tokenizer, save_model_dir, tiny_gpt2, tiny_llama, tiny_qwen2
from gradindex.cli import main
from tests.conftest import refused
from tests.conftest import write_jsonl as _jsonl

CHATS = [[{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"it is {i}"}]
         for i in range(6)]
TEXTS = [f"what is {i} plus {i % 4}" for i in range(8)]
BUILD = ["--device", "cpu", "--projection", "4", "--quiet"]
NEEDS_PEFT = "peft is not installed (pip install 'gradindex[peft]' or '[dev]')"


def _run(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def _files(d) -> dict:
    """Every file of ``d`` but its lock files (a writer records itself in them): size and modification time."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")}


def _refused(*a, **k) -> str:
    """:func:`tests.conftest.refused`, the one ``dedup: vectors`` progress line aside."""
    return refused(*a, skip=("plan:", "dedup: vectors"), **k)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer has no chat template, text and chat data, a template file, query files, a text
    index of the model (answered exactly: --transcode none, so precondition may fit it again)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    tok = chat_tokenizer(TEXTS + [m["content"] for c in CHATS for m in c], template=None)
    w = {"root": root, "tok": tok, "model": save_model_dir(tiny_qwen2(vocab_size=len(tok)), tok, root / "model"),
         "text": _jsonl(root / "text.jsonl", [{"text": t} for t in TEXTS]),
         "chat": _jsonl(root / "chat.jsonl", [{"messages": c} for c in CHATS]),
         "queries": _jsonl(root / "q.jsonl", [{"text": "what is 3"}]),
         "chat_queries": _jsonl(root / "cq.jsonl", [{"messages": CHATS[1]}]), "index": root / "index"}
    (root / "chat.jinja").write_text(CHATML_TRAINING)
    code, output = _run("build", w["model"], w["text"], "--out", w["index"], "--transcode", "none", *BUILD)
    assert code == 0, output
    return w


@pytest.fixture
def no_serving(monkeypatch):
    """``gradindex serve`` fails the test where it would start serving (its refusal must come first)."""
    import gradindex.apps.serve

    def served(*a, **k):
        raise AssertionError("serve started on a model it should have refused")

    monkeypatch.setattr(gradindex.apps.serve, "serve", served)


def _on_every_command(w, model, tmp_path, *fix: str) -> None:
    """``model`` refused alike by each command that takes one; nothing written by those that write."""
    idx, cpu = w["index"], ("--device", "cpu")
    runs = [(("build", model, w["text"], "--out", tmp_path / "b", *BUILD), tmp_path / "b"),
            (("plan", model, w["text"], "--batches", "0", *cpu), None), (("layers", model), None),
            (("query", idx, "--model", model, "--text", "what is 3", *cpu), None),
            (("explain", idx, "--model", model, "--text", "what is 3", "--id", "0", *cpu), None),
            (("audit", idx, "--queries", w["queries"], "--out", tmp_path / "a", "--model", model, *cpu),
             tmp_path / "a"),
            (("serve", idx, "--model", model, *cpu), None),
            (("dedup", idx, "--out", tmp_path / "d", "--model", model), tmp_path / "d"),
            (("outliers", idx, "--model", model), None)]
    before = _files(idx)
    for args, out in runs:
        _refused(*_run(*args), out, *fix)
    assert _files(idx) == before


# GGUF ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_files(world):
    """A readable tiny Llama GGUF, and that file under an unknown architecture, under another one transformers
    reads (its tensors then not that architecture's), torn after its header's start, and not a GGUF at all."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'gradindex[gguf]' or '[dev]')")
    from fixtures.tiny import write_llama_gguf

    root = world["root"] / "gguf"
    root.mkdir()
    tok = chat_tokenizer(TEXTS, template=CHATML_TRAINING)
    model = tiny_llama(vocab_size=len(tok), n_layer=2, hidden=32, n_head=4, intermediate=48, attention_bias=False,
                       n_kv_head=2)
    good = write_llama_gguf(model, tok, root / "good.gguf")
    files = {a: write_llama_gguf(model, tok, root / f"{a}.gguf", arch=a) for a in ("zzzarch", "mamba")}
    (root / "torn.gguf").write_bytes(good.read_bytes()[:200])
    (root / "junk.gguf").write_bytes(b"not a gguf file " * 8)
    return {**files, "torn": root / "torn.gguf", "junk": root / "junk.gguf"}


@pytest.mark.parametrize("kind, fix", [
    ("zzzarch", ("holds a 'zzzarch' model, an architecture transformers cannot de-quantize from GGUF",
                 "reads GGUF architectures", "llama", "convert the 'zzzarch' model to a model folder")),
    ("mamba", ("weight(s) missing", "the file's tensors are not those transformers reads as a 'mamba' model",
               "convert it again", "pass the model folder it was converted from")),
    ("torn", ("is not a readable GGUF file", "truncated or corrupt: download or convert it again")),
    ("junk", ("is not a readable GGUF file", "GGUF magic invalid", "download or convert it again"))])
def test_a_gguf_transformers_cannot_read_on_every_command(world, gguf_files, kind, fix, tmp_path, no_serving):
    if kind == "mamba":  # (a model's weights are read: the commands that read its tokenizer alone take it)
        for args in (("build", gguf_files[kind], world["text"], "--out", tmp_path / "b", *BUILD),
                     ("query", world["index"], "--model", gguf_files[kind], "--text", "what is 3", "--device", "cpu")):
            _refused(*_run(*args), tmp_path / "b", *fix)
        return
    _on_every_command(world, gguf_files[kind], tmp_path, *fix)


# chat template --------------------------------------------------------------------------------------------
def test_a_chat_file_without_a_template_on_every_command(world, tmp_path, monkeypatch):
    w, cpu, fix = world, ("--device", "cpu"), ("no chat template", "--chat-template FILE", "chat_template.jinja")
    convo = json.dumps(CHATS[1])
    _refused(*_run("build", w["model"], w["chat"], "--out", tmp_path / "b", *BUILD), tmp_path / "b", *fix)
    _refused(*_run("plan", w["model"], w["chat"], "--batches", "0", *cpu), None, *fix)
    before = _files(w["index"])
    _refused(*_run("query", w["index"], "--messages", convo, *cpu), None, *fix)
    _refused(*_run("query", w["index"], "--queries", w["chat_queries"], *cpu), None, *fix)
    _refused(*_run("explain", w["index"], "--messages", convo, "--id", "0", *cpu), None, *fix)
    _refused(*_run("audit", w["index"], "--queries", w["chat_queries"], "--out", tmp_path / "a", *cpu),
             tmp_path / "a", *fix)
    for space in ("stored", "full"):  # (a fit on other data: one or two model passes over it)
        _refused(*_run("precondition", w["index"], "--method", "ekfac", "--fit-data", w["chat"], "--space", space,
                       "--quiet", *cpu), None, *fix)
    assert _files(w["index"]) == before


def test_a_chat_template_given_as_a_file(world, tmp_path):
    """--chat-template FILE: a Jinja file, or the tokenizer_config.json holding one (its JSON was rendered as the
    template before: every conversation wrapped in the file's JSON text)."""
    w = world
    code, output = _run("plan", w["model"], w["chat"], "--batches", "0", "--device", "cpu", "--chat-template",
                        w["root"] / "chat.jinja")
    assert code == 0, output
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML_TRAINING}))
    code, output = _run("build", w["model"], w["chat"], "--out", tmp_path / "idx", "--chat-template", config, *BUILD)
    assert code == 0, output
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["chat_template"] == CHATML_TRAINING
    config.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    _refused(*_run("build", w["model"], w["chat"], "--out", tmp_path / "no", "--chat-template", config, *BUILD),
             tmp_path / "no", "is a JSON file with no 'chat_template' text", "pass a Jinja chat template file")


@pytest.mark.parametrize("template, fix", [
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
    ("{{ raise_exception('system turns are not supported') }}", "system turns are not supported"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "does not render them")], ids=["syntax", "raises", "no-assistant"])
def test_a_chat_template_that_cannot_render(world, template, fix, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(template)
    out = tmp_path / "idx"
    _refused(*_run("build", world["model"], world["chat"], "--out", out, "--chat-template", f, *BUILD), out,
             "row 0: the chat template", fix, "--chat-template FILE")


# adapters -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(world):
    """Adapters of other bases than the world's model (wider; GPT-2, other layer names; same shapes, other
    weights), the world's own adapter and an index built with it."""
    pytest.importorskip("peft", reason=NEEDS_PEFT)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_adapter import make_adapter

    root, tok = world["root"] / "adapters", world["tok"]
    wide = save_model_dir(tiny_qwen2(vocab_size=len(tok), hidden=48, intermediate=64), tok, root / "wide")
    twin = save_model_dir(tiny_qwen2(vocab_size=len(tok), seed=1), tok, root / "twin")
    gpt2 = save_model_dir(tiny_gpt2(vocab_size=len(tok), n_embd=32), tok, root / "gpt2")
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(gpt2),
                          LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))
    lora.save_pretrained(root / "of-gpt2")
    out = {"wide": make_adapter(wide, root / "of-wide", hidden=48), "gpt2": root / "of-gpt2",
           "twin": make_adapter(twin, root / "of-twin"), "own": make_adapter(world["model"], root / "own"),
           "twin_model": twin, "wide_model": wide, "index": root / "index"}
    code, output = _run("build", world["model"], world["text"], "--out", out["index"], "--adapter", out["own"], *BUILD)
    assert code == 0, output
    return out


@pytest.mark.parametrize("which, why", [("wide", "config.json differs in hidden_size"),
                                        ("gpt2", "config.json differs in"), ("twin", "its weights differ")])
def test_an_adapter_of_another_base(world, adapters, which, why, tmp_path):
    fix = ("does not fit this base model", why, "pass the base model it was trained from")
    out = tmp_path / "idx"
    _refused(*_run("build", world["model"], world["text"], "--out", out, "--adapter", adapters[which], *BUILD), out,
             *fix)
    _refused(*_run("plan", world["model"], world["text"], "--batches", "0", "--device", "cpu", "--adapter",
                   adapters[which]), None, *fix)


def test_an_adapter_index_queried_with_another_base(adapters, no_serving):
    """The index's adapter on another --model: refused before the model is used (its base is checked)."""
    for other, why in ((adapters["twin_model"], "its weights differ"), (adapters["wide_model"], "hidden_size")):
        for cmd in (("query", "--text", "what is 3"), ("explain", "--text", "what is 3", "--id", "0"), ("serve",)):
            _refused(*_run(cmd[0], adapters["index"], "--model", other, *cmd[1:], "--device", "cpu"), None,
                     "does not fit this base model", why, "pass the base model it was trained from")


def _named(adapter, tmp_path, name: str, base_class: str | None = None):
    """A copy of ``adapter`` whose config names ``name`` as its base (and ``base_class`` as PEFT's class)."""
    copy = tmp_path / f"adapter-{name.replace('/', '-')}-{base_class}"
    shutil.copytree(adapter, copy)
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = name
    if base_class:
        cfg["auto_mapping"] = {"base_model_class": base_class, "parent_library": "transformers"}
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    return copy


def _hub_cache(root, repo: str, model_dir):
    """A Hugging Face hub cache holding ``model_dir``'s files as the snapshot of ``repo``."""
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    shutil.copytree(model_dir, snap)
    (root / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (root / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    return root


def test_an_adapter_naming_a_hub_base(world, adapters, tmp_path, monkeypatch, caplog):
    """A base named by hub id: compared with the hub cache's copy where there is one; where there is none, a
    model class the adapter records is compared, else a warning says it cannot be checked; an adapter given as
    the model whose hub base is not here names the fix."""
    import huggingface_hub.constants

    repo, text = "someorg/tiny-qwen", world["text"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    twin = _named(adapters["twin"], tmp_path, repo)
    with caplog.at_level(logging.WARNING, logger="gradindex.adapter"):
        code, output = _run("plan", world["model"], text, "--batches", "0", "--device", "cpu", "--adapter", twin)
    assert code == 0, output
    assert "gradindex cannot check" in caplog.text and repo in caplog.text, caplog.text
    llama = _named(adapters["twin"], tmp_path, repo, "LlamaForCausalLM")
    _refused(*_run("build", world["model"], text, "--out", tmp_path / "b", "--adapter", llama, *BUILD),
             tmp_path / "b", "it was trained on a LlamaForCausalLM", "is a Qwen2ForCausalLM",
             "pass the base model it was trained from")
    _refused(*_run("build", twin, text, "--out", tmp_path / "b", *BUILD), tmp_path / "b",
             f"names its base model '{repo}'", "not on this machine", "--adapter")
    cache = _hub_cache(tmp_path / "cache", repo, adapters["twin_model"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    _refused(*_run("build", world["model"], text, "--out", tmp_path / "b", "--adapter", twin, *BUILD),
             tmp_path / "b", "does not fit this base model", f"trained on the model in '{repo}'", "weights differ")
    code, output = _run("build", twin, text, "--out", tmp_path / "ok", *BUILD)  # the cached base, loaded
    assert code == 0, output


def test_a_missing_model_path_or_a_file_is_named_for_what_it_is(tmp_path, text_jsonl):
    """Both said "has no config.json"."""
    res = CliRunner().invoke(main, ["layers", str(tmp_path / "nope")])
    refused(res.exit_code, res.output, None, "nope' does not exist")
    res = CliRunner().invoke(main, ["layers", str(text_jsonl)])
    refused(res.exit_code, res.output, None, "is a file, not a model directory")
