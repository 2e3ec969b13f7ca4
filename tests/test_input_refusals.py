"""Bad input refused in one ``Error:`` line that names the fix, exit 2, nothing written; each case went wrong
before (a fix the command does not take, a silent build on another model, a traceback, an ``IndexError`` after
writing, other rows without a word):

a. a chat query where neither the index nor the tokenizer has a chat template (the fix named was
   ``--chat-template FILE``, which ``query`` does not take);
b. ``build BASE --adapter DIR`` where the adapter was trained on another local model of the same shapes;
c. a chat turn without ``content`` (a Jinja ``UndefinedError`` traceback);
d. a tokenizer larger than the model's input embedding (an ``IndexError`` in the capture, after writing);
e. another tokenizer with the same weights (a query's text became other ids: other rows, silently).
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from fixtures.tiny import (
    CHATML_TRAINING,
    chat_tokenizer,
    save_model_dir,
    stdlib_corpus,
    tiny_gpt2,
    tiny_qwen2,
    train_tokenizer,
)
from gradindex.cli import main
from tests.conftest import refused as _refused
from tests.conftest import write_jsonl as _jsonl

TEXTS = [f"what is {i} plus {i % 4}, the cat asks" for i in range(12)]
CHATS = [[{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"it is {i}"}]
         for i in range(6)]
BUILD = ["--device", "cpu", "--projection", "4", "--quiet"]


def _run(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer has no chat template, and a text index built from it."""
    root = tmp_path_factory.mktemp("bare")
    tok = chat_tokenizer(TEXTS + [m["content"] for c in CHATS for m in c], template=None)
    model_dir = save_model_dir(tiny_qwen2(vocab_size=len(tok)), tok, root / "model")
    data = _jsonl(root / "text.jsonl", [{"text": t} for t in TEXTS])
    code, output = _run("build", model_dir, data, "--out", root / "index", *BUILD)
    assert code == 0, output
    return model_dir, data, root / "index"


# a. ---------------------------------------------------------------------------------------------------
def test_a_chat_query_where_nothing_has_a_template_names_a_fix_the_query_takes(bare, tmp_path):
    model_dir, _, index = bare
    convo = json.dumps(CHATS[1])
    msg = _refused(*_run("query", index, "--messages", convo, "--device", "cpu"), None,
                   "no chat template", "chat_template.jinja", "--prompt/--completion")
    assert "a build takes one with --chat-template FILE" in msg  # (the build's fix, said as the build's)
    queries = _jsonl(tmp_path / "q.jsonl", [{"messages": CHATS[2]}])
    _refused(*_run("query", index, "--queries", queries, "--device", "cpu"), None, "chat_template.jinja")
    # the fix named works: the same weights with a template beside them (the text index's tokenizer
    # fingerprint has no template part, so the folder is still the index's model)
    fixed = tmp_path / "model"
    shutil.copytree(model_dir, fixed)
    (fixed / "chat_template.jinja").write_text(CHATML_TRAINING)
    code, output = _run("query", index, "--messages", convo, "--model", fixed, "--device", "cpu", "--json")
    assert code == 0, output


# b. ---------------------------------------------------------------------------------------------------
def test_an_adapter_trained_on_another_model_of_the_same_shapes(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'gradindex[peft]' or '[dev]')")
    from tests.test_adapter import make_adapter

    tok = train_tokenizer(TEXTS, vocab_size=300)
    trained_on = save_model_dir(tiny_qwen2(vocab_size=len(tok), seed=0), tok, tmp_path / "a")
    other = save_model_dir(tiny_qwen2(vocab_size=len(tok), seed=1), tok, tmp_path / "b")  # same shapes
    adapter = make_adapter(trained_on, tmp_path / "adapter")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "idx"
    msg = _refused(*_run("build", other, data, "--out", out, "--adapter", adapter, *BUILD), out,
                   "does not fit this base model", f"trained on the model in '{trained_on}'",
                   "its weights differ", "base model it was trained from")
    assert "base_model_name_or_path" in msg
    code, output = _run("build", trained_on, data, "--out", out, "--adapter", adapter, *BUILD)
    assert code == 0, output  # its own base (and a copy of it elsewhere) is taken
    copy = tmp_path / "copy"
    shutil.copytree(trained_on, copy)
    code, output = _run("build", copy, data, "--out", tmp_path / "idx2", "--adapter", adapter, *BUILD)
    assert code == 0, output


# c. ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("turn", [{"role": "user"}, {"role": "user", "content": None}], ids=["absent", "null"])
def test_a_chat_turn_without_content(turn, tmp_path):
    tok = chat_tokenizer([m["content"] for c in CHATS for m in c], template=CHATML_TRAINING)
    model_dir = save_model_dir(tiny_qwen2(vocab_size=len(tok)), tok, tmp_path / "model")
    bad = [turn, {"role": "assistant", "content": "it is"}]
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CHATS[:2] + [bad] + CHATS[2:]])
    out = tmp_path / "idx"
    _refused(*_run("build", model_dir, data, "--out", out, *BUILD), out,
             "row 2: turn 0 (user) of 'messages' has no 'content'", "fix or drop that row")


def test_a_tool_call_turn_needs_no_content():
    from gradindex.chat import check_messages

    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    got = check_messages([{"role": "user", "content": "hi"}, call, {"role": "assistant", "content": "done"}], 0)
    assert "content" not in got[1] and got[1]["tool_calls"]


# d. ---------------------------------------------------------------------------------------------------
def test_a_tokenizer_larger_than_the_embedding(tmp_path):
    big = train_tokenizer(stdlib_corpus(limit=3000), vocab_size=4096)
    assert len(big) == 4096
    model_dir = save_model_dir(tiny_gpt2(vocab_size=512, n_embd=32), big, tmp_path / "model")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in stdlib_corpus(limit=8)])
    out = tmp_path / "idx"
    _refused(*_run("build", model_dir, data, "--out", out, *BUILD), out,
             "has 4,096 tokens but the model's input embedding has 512 rows", "another model's tokenizer",
             "tokenizer.save_pretrained(MODEL_DIR)")


# e. ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """One model's weights twice: with the tokenizer it was built with, and with another of the same size;
    an index built from the first."""
    root = tmp_path_factory.mktemp("twins")
    tok = train_tokenizer(TEXTS, vocab_size=300)
    other = train_tokenizer([t.upper() for t in TEXTS], vocab_size=len(tok))
    model = tiny_qwen2(vocab_size=max(len(tok), len(other)))
    own, foreign = save_model_dir(model, tok, root / "own"), save_model_dir(model, other, root / "foreign")
    data = _jsonl(root / "d.jsonl", [{"text": t} for t in TEXTS])
    code, output = _run("build", own, data, "--out", root / "index", *BUILD)
    assert code == 0, output
    return own, foreign, root / "index", tok, other


def test_a_query_with_another_tokenizer_of_the_same_weights_is_refused(twins):
    own, foreign, index, _, _ = twins
    manifest = json.loads((index / "manifest.json").read_text())
    assert set(manifest["build"]["tokenizer"]) == {"size", "vocabulary", "merges", "special_tokens", "encoding"}
    _refused(*_run("query", index, "--model", foreign, "--text", TEXTS[3], "--device", "cpu"), None,
             f"the tokenizer of '{foreign}' is not the one that built this index", "its vocabulary differs",
             "its merges differ", "use the tokenizer the index was built with")
    code, output = _run("query", index, "--model", own, "--text", TEXTS[3], "--device", "cpu")
    assert code == 0, output


def test_the_tokenizer_check_names_what_differs_and_skips_old_indices(twins, tmp_path):
    from gradindex.fingerprint import check_tokenizer, tokenizer_fingerprint
    from gradindex.model import load_tokenizer
    from gradindex.spec.manifest import IndexMismatchError

    def check_index_tokenizer(manifest: dict, tokenizer, index_dir="") -> None:  # what the query engine checks
        check_tokenizer(manifest["build"].get("tokenizer"), tokenizer, "the query's tokenizer", index_dir)

    own, foreign, index, tok, other = twins
    manifest = json.loads((index / "manifest.json").read_text())
    check_index_tokenizer(manifest, load_tokenizer(own), index)  # its own, as the build loaded it
    with pytest.raises(IndexMismatchError, match="the query's tokenizer is not the one that built the index in"):
        check_index_tokenizer(manifest, load_tokenizer(foreign), index)
    # the tokenizer object the folder was saved from splits digits otherwise: transformers reloads a Qwen2
    # folder's tokenizer with Qwen2's pre-tokenizer, and the text-splitting part sees it
    with pytest.raises(IndexMismatchError, match=r"^[^;]*its text splitting \(normalizer"):
        check_index_tokenizer(manifest, tok, index)
    chat = tokenizer_fingerprint(chat_tokenizer(TEXTS, template=CHATML_TRAINING), chat=True)
    templated = chat_tokenizer(TEXTS, template=CHATML_TRAINING.replace("<|im_start|>", "<|im_start|> "))
    with pytest.raises(IndexMismatchError, match="its chat template differs") as e:
        check_index_tokenizer({"build": {"tokenizer": chat}}, templated)
    assert "vocabulary" not in str(e.value)  # only what differs is named
    # an index built before tokenizers were fingerprinted opens with any tokenizer, the CLI's too
    check_index_tokenizer({"build": {}}, other)
    old = tmp_path / "old"
    shutil.copytree(index, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["build"]["tokenizer"]
    (old / "manifest.json").write_text(json.dumps(m))
    for f in (old / "faiss").glob("*.json"):  # (the FAISS key holds the build identity of its store)
        meta = json.loads(f.read_text())
        if isinstance(meta.get("key", {}).get("identity"), dict):
            meta["key"]["identity"].pop("tokenizer", None)
            f.write_text(json.dumps(meta))
    code, output = _run("query", old, "--model", foreign, "--text", TEXTS[3], "--device", "cpu")
    assert code == 0, output


def test_a_resumed_build_with_another_tokenizer_is_refused(twins, tmp_path):
    own, foreign, _, _, _ = twins
    data = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}])
    out = tmp_path / "idx"
    code, output = _run("build", own, data, "--out", out, "--no-index", *BUILD)
    assert code == 0, output
    # token ids: the data fingerprint is the same whatever the tokenizer; the tokenizer's is not
    msg = _refused(*_run("build", foreign, data, "--out", out, "--no-index", *BUILD), None,
                   "holds another index, so it cannot be resumed", "tokenizer differs: its vocabulary differs")
    assert "model differs" not in msg


def test_an_engine_given_another_tokenizer_is_refused(twins):
    from transformers import AutoModelForCausalLM

    from gradindex.query import QueryEngine
    from gradindex.spec.manifest import IndexMismatchError

    own, _, index, _, other = twins
    model = AutoModelForCausalLM.from_pretrained(own)
    with pytest.raises(IndexMismatchError, match="its vocabulary differs"):
        QueryEngine(index, model=model, tokenizer=other, device="cpu").close()
