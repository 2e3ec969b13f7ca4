"""A ``.gguf`` file wherever gradindex takes a model: de-quantized by transformers, its tokenizer and chat
template read from the file, the file (path and hash) recorded as the index's model.

The GGUF is written here from a tiny Llama (``fixtures.tiny.write_llama_gguf``: float32 tensors, llama keys and
tensor names, llama.cpp's rotary row order), beside the same model saved as a folder: the two build the same
rows. Opt-in (``GRADINDEX_REAL_LLM=1``, the cached file present): the registry's real SmolLM2-135M GGUF.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'gradindex[gguf]' or '[dev]')")

from fixtures.tiny import CHATML_TRAINING, chat_tokenizer, save_model_dir, tiny_llama, write_llama_gguf  # noqa: E402
from gradindex.checksum import file_digest  # noqa: E402
from gradindex.cli import main  # noqa: E402

CHATS = [[{"role": "user", "content": f"what is {i} plus {i % 5}"},
          {"role": "assistant", "content": f"it is {i + i % 5}, the cat says"}] for i in range(16)]
BUILD = ["--projection", "8", "--storage", "fp32", "--transcode", "none", "--precondition", "none",
         "--device", "cpu", "--quiet"]
SMOLLM2_GGUF = Path(os.environ.get("GRADINDEX_CACHE", "/work/cache")) / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _model(tok, seed: int = 0):
    return tiny_llama(vocab_size=len(tok), n_layer=2, hidden=32, n_head=4, intermediate=48, seed=seed,
                      attention_bias=False, n_kv_head=2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same tiny Llama and chat tokenizer (with its template) as a model folder and as a GGUF file,
    chat training data, and the index each builds."""
    root = tmp_path_factory.mktemp("gguf")
    tok = chat_tokenizer([m["content"] for c in CHATS for m in c], vocab_size=300, template=CHATML_TRAINING)
    model = _model(tok)
    folder = save_model_dir(model, tok, root / "folder")
    (root / "file").mkdir()
    gguf = write_llama_gguf(model, tok, root / "file" / "tiny.gguf")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    for src, out in ((folder, root / "from-folder"), (gguf, root / "from-gguf")):
        r = CliRunner().invoke(main, ["build", str(src), str(data), "--out", str(out), *BUILD], catch_exceptions=False)
        assert r.exit_code == 0, r.output
    return {"root": root, "tok": tok, "folder": folder, "gguf": gguf, "data": data,
            "from_folder": root / "from-folder", "from_gguf": root / "from-gguf"}


def _rows(index_dir) -> dict[str, np.ndarray]:
    from gradindex.store import Store

    with Store(index_dir) as st:
        return st.read_rows(np.arange(len(CHATS)))


def test_a_gguf_file_builds_the_rows_its_model_folder_builds(pair):
    a, b = _rows(pair["from_folder"]), _rows(pair["from_gguf"])
    assert sorted(a) == sorted(b) and len(a) == 14  # 2 blocks x 7 linears
    for n in a:
        assert np.abs(a[n]).max() > 0
        np.testing.assert_allclose(b[n], a[n], rtol=0, atol=1e-6, err_msg=n)
    m = json.loads((pair["from_gguf"] / "manifest.json").read_text())
    mf = json.loads((pair["from_folder"] / "manifest.json").read_text())
    assert m["model_id"] == str(pair["gguf"].resolve())
    assert m["model_file"] == {"path": str(pair["gguf"].resolve()), "format": "gguf", "architecture": "llama",
                               "bytes": pair["gguf"].stat().st_size, "blake2b": file_digest(pair["gguf"])}
    assert "model_file" not in mf
    assert m["chat_template"] == CHATML_TRAINING  # the template the GGUF holds
    assert m["build"]["tokenizer"] == mf["build"]["tokenizer"]  # the file's tokenizer is the folder's
    info = CliRunner().invoke(main, ["info", str(pair["from_gguf"])])
    assert info.exit_code == 0 and "gguf file, llama" in info.output, info.output


def test_a_gguf_index_answers_queries_as_its_folder_twin(pair):
    convo = json.dumps(CHATS[5])
    got = []
    for idx in (pair["from_folder"], pair["from_gguf"]):  # the GGUF index reopens its model from the file
        r = CliRunner().invoke(main, ["query", str(idx), "--messages", convo, "-k", "4", "--json", "--device", "cpu",
                                      "--method", "graddot"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        got.append(json.loads(r.output.strip().splitlines()[-1]))
    assert [h["id"] for h in got[0]] == [h["id"] for h in got[1]]
    np.testing.assert_allclose([h["score"] for h in got[1]], [h["score"] for h in got[0]], rtol=1e-5)


def test_a_query_with_another_gguf_file_is_refused(pair, tmp_path):
    other = write_llama_gguf(_model(pair["tok"], seed=1), pair["tok"], tmp_path / "other.gguf")
    r = CliRunner().invoke(main, ["query", str(pair["from_gguf"]), "--model", str(other), "--text", "what is 3",
                                  "--device", "cpu"])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "does not fit the index" in lines[0] and "model differs" in lines[0], lines[0]


def test_a_gguf_architecture_transformers_cannot_read_is_one_line(pair, tmp_path):
    phi = write_llama_gguf(_model(pair["tok"]), pair["tok"], tmp_path / "phi.gguf", arch="phi2")
    out = tmp_path / "idx"
    r = CliRunner().invoke(main, ["build", str(phi), str(pair["data"]), "--out", str(out), *BUILD])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert "'phi2' model, an architecture transformers cannot de-quantize" in lines[0]
    assert "convert the 'phi2' model to a model folder" in lines[0]
    assert not out.exists() or not any(out.iterdir())
    torn = tmp_path / "torn.gguf"
    torn.write_bytes(pair["gguf"].read_bytes()[:100])
    r = CliRunner().invoke(main, ["layers", str(torn)])
    assert r.exit_code == 2 and "is not a readable GGUF file" in r.output, r.output


def test_plan_takes_a_gguf(pair):
    r = CliRunner().invoke(main, ["plan", str(pair["gguf"]), str(pair["data"]), "--projection", "8", "--device",
                                  "cpu", "--batches", "1", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output.strip().splitlines()[-1])
    assert plan["examples"] == len(CHATS) and len(plan["layers"]) == 14


def test_layers_of_a_gguf_are_its_folders(pair):
    a = CliRunner().invoke(main, ["layers", str(pair["folder"])])
    b = CliRunner().invoke(main, ["layers", str(pair["gguf"])])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    keep = [ln for ln in b.output.splitlines() if ln[:2] in ("* ", "  ", "! ") or "selected" in ln]
    assert keep == [ln for ln in a.output.splitlines() if ln[:2] in ("* ", "  ", "! ") or "selected" in ln]


@pytest.mark.skipif(os.environ.get("GRADINDEX_REAL_LLM") != "1" or not SMOLLM2_GGUF.is_file(),
                    reason=f"opt-in: GRADINDEX_REAL_LLM=1 and {SMOLLM2_GGUF} (benchmarks/smollm2.py fetches it)")
def test_layers_of_the_real_smollm2_gguf():
    r = CliRunner().invoke(main, ["layers", str(SMOLLM2_GGUF)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "210 layers selected" in r.output, r.output[-500:]
    assert "* model.layers.29.mlp.down_proj  linear 1536->576" in r.output


def test_without_the_gguf_package_the_error_names_the_extra(pair, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # (import gguf raises ImportError)
    r = CliRunner().invoke(main, ["build", str(pair["gguf"]), str(pair["data"]), "--out", str(tmp_path / "x"),
                                  *BUILD])
    assert r.exit_code == 2 and "pip install 'gradindex[gguf]'" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_a_gguf_beside_another_models_files_reads_its_own(pair, tmp_path):
    import shutil

    from fixtures.tiny import train_tokenizer
    from gradindex.model import load_tokenizer

    other = train_tokenizer(["hello there big world"] * 3, vocab_size=280)
    other.save_pretrained(tmp_path)  # another tokenizer's files in the GGUF's folder
    (tmp_path / "config.json").write_text((pair["folder"] / "config.json").read_text().replace('"llama"', '"gpt2"'))
    shutil.copy(pair["gguf"], tmp_path / "tiny.gguf")
    tok = load_tokenizer(tmp_path / "tiny.gguf")
    assert len(tok) == len(pair["tok"]) and tok.chat_template == CHATML_TRAINING
    r = CliRunner().invoke(main, ["layers", str(tmp_path / "tiny.gguf")])
    assert r.exit_code == 0 and "14 layers selected" in r.output, r.output
