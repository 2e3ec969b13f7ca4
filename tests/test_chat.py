"""Chat records: the chat template's tokens, labels on the assistant turns only (equal to TRL's),
and a chat training set with chat queries end to end (build, query, explain, audit, serve)."""

from __future__ import annotations

import json

import datasets
import pytest
from click.testing import CliRunner

from fixtures.tiny import CHATML, CHATML_TRAINING, chat_tokenizer, save_model_dir, tiny_qwen2
from gradindex.chat import NO_TEMPLATE, chat_tokens, render_turns
from gradindex.cli import main
from gradindex.data import IGNORE, tokenize_records

TOPICS = [("what colour is the sky", "the sky is blue"), ("where does the cat sit", "the cat sits on the mat"),
          ("what does the dog eat", "the dog eats fish at noon"), ("where is the old town", "near the green hills"),
          ("what is two plus two", "two plus two is four"), ("who ran far away", "some dog ran far from home")]


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        q, a = TOPICS[i % len(TOPICS)]
        turns = [{"role": "user", "content": f"{q} {i}"}, {"role": "assistant", "content": f"{a} {i}"}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "answer briefly"}] + turns
        if i % 4 == 1:
            turns += [{"role": "user", "content": "and then"}, {"role": "assistant", "content": "the red sun"}]
        out.append(turns)
    return out


@pytest.fixture(scope="module")
def chat_tok():
    return chat_tokenizer([m["content"] for c in conversations(12) for m in c])


def _decoded_targets(tok, ids, labels):
    return tok.decode([t for t, y in zip(ids, labels) if y != IGNORE])


def test_assistant_turns_alone_are_targets_with_either_template(chat_tok):
    convo = conversations(2)[1]  # user, assistant, user, assistant
    ids, labels = chat_tokens(chat_tok, convo, 0)
    assert ids == list(chat_tok.apply_chat_template(convo, tokenize=True, return_dict=True)["input_ids"])
    assert _decoded_targets(chat_tok, ids, labels) == "the cat sits on the mat 1<|im_end|>\nthe red sun<|im_end|>\n"
    # the same vocabulary, a template without {% generation %} markers: the prefix rule finds the same targets
    plain = chat_tokenizer([m["content"] for c in conversations(12) for m in c], template=CHATML)
    assert chat_tokens(plain, convo, 0) == (ids, labels)


def test_labels_equal_trls_assistant_only_loss(chat_tok, tmp_path):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'gradindex[dev]' installs it)")
    from trl import SFTConfig, SFTTrainer

    convos = conversations(8)
    ds = datasets.Dataset.from_dict({"messages": convos})
    model = tiny_qwen2(vocab_size=len(chat_tok))
    cfg = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=256, report_to=[],
                    use_cpu=True, packing=False, dataset_num_proc=None)
    trainer = SFTTrainer(model, args=cfg, train_dataset=ds, processing_class=chat_tok)
    theirs = trainer.train_dataset
    batch = trainer.data_collator([theirs[i] for i in range(len(theirs))])
    ours = tokenize_records(ds, chat_tok, 256)
    assert ours.field == "messages"
    for i in range(len(convos)):
        n = len(ours.input_ids[i])
        assert theirs[i]["input_ids"] == ours.input_ids[i]
        assert batch["labels"][i, :n].tolist() == ours.labels[i]
        assert (batch["labels"][i, n:] == IGNORE).all()


def test_bad_chat_records_are_one_line_errors(chat_tok):
    no_reply = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ValueError, match="row 0: the conversation has no assistant turn.*add the assistant"):
        tokenize_records(no_reply, chat_tok, 64)
    bare = chat_tokenizer(["hi there"], template=None)
    ok = datasets.Dataset.from_dict({"messages": conversations(1)})
    with pytest.raises(ValueError, match="no chat template.*--chat-template FILE"):
        tokenize_records(ok, bare, 64)
    assert "--chat-template FILE" in NO_TEMPLATE
    not_turns = datasets.Dataset.from_dict({"messages": [["hello"]]})
    with pytest.raises(ValueError, match="turn 0 of 'messages' is not"):
        tokenize_records(not_turns, chat_tok, 64)


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory, chat_tok):
    """A tiny Qwen2 whose tokenizer has no template, a chat training file, and an index built with
    --chat-template."""
    root = tmp_path_factory.mktemp("chat")
    bare = chat_tokenizer([m["content"] for c in conversations(12) for m in c], template=None)
    model_dir = save_model_dir(tiny_qwen2(vocab_size=len(bare)), bare, root / "model")
    template = root / "chatml.jinja"
    template.write_text(CHATML_TRAINING)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(24)))
    out = root / "index"
    r = CliRunner().invoke(main, ["build", str(model_dir), str(data), "--out", str(out), "--projection", "8",
                                  "--device", "cpu", "--quiet", "--chat-template", str(template)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return model_dir, data, out, template


def test_a_build_without_a_template_names_the_fix(chat_build, tmp_path):
    model_dir, data, _, _ = chat_build
    r = CliRunner().invoke(main, ["build", str(model_dir), str(data), "--out", str(tmp_path / "x"), "--device", "cpu"])
    assert r.exit_code != 0 and "--chat-template FILE" in r.output
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_chat_queries_end_to_end(chat_build):
    from fastapi.testclient import TestClient

    from gradindex.apps.serve import create_app
    from gradindex.query import QueryEngine

    model_dir, data, out, _ = chat_build
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat_template"] == CHATML_TRAINING and manifest["counts"]["text_field"] == "messages"
    convo = conversations(24)[7]
    r = CliRunner().invoke(main, ["query", str(out), "--messages", json.dumps(convo), "-k", "3", "--json",
                                  "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    hits = json.loads(r.output.strip().splitlines()[-1])
    with QueryEngine(out, device="cpu") as engine:
        ref = engine.query({"messages": convo}, k=3)
        assert [h["id"] for h in hits] == [h.id for h in ref.hits]
        assert ref.hits[0].id == 7  # the training conversation itself
        assert ref.hits[0].text == render_turns(convo)
        assert ref.hits[0].text.startswith("[user] ") and "\n[assistant] " in ref.hits[0].text
        body = TestClient(create_app(engine)).post("/query", json={"messages": convo, "k": 3}).json()
        assert [h["id"] for h in body["hits"]] == [h.id for h in ref.hits]
    r = CliRunner().invoke(main, ["explain", str(out), "--messages", json.dumps(convo), "--id", "7",
                                  "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "turns:" in r.output and "[assistant] " + convo[-1]["content"] in r.output
    queries = out.parent / "queries.jsonl"
    queries.write_text(json.dumps({"messages": convo}) + "\n")
    r = CliRunner().invoke(main, ["audit", str(out), "--queries", str(queries), "--out", str(out.parent / "audit"),
                                  "--device", "cpu", "--no-dedup"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = [json.loads(line) for line in (out.parent / "audit" / "queries.jsonl").read_text().splitlines()]
    assert report[0]["text"].startswith("[user] ") and report[0]["hits"][0]["id"] == 7
    assert "[assistant] " in report[0]["hits"][0]["text"]
    assert "[assistant] the cat sits on the mat 7" in (out.parent / "audit" / "report.html").read_text()
