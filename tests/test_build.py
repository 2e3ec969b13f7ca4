"""The offline builder: store contents, resume after a kill, refusals, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import make_texts

from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import batch_gradients
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.model import load_causal_lm
from gradindex.spec.manifest import IndexMismatchError, read_manifest
from gradindex.store import Store
from gradindex.store.builder import BuildConfig, build_store


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _store_arrays(index_dir):
    with Store(index_dir) as s:
        out = {k: s.column(k) for k in ("ids", "loss", "num_tokens", "token_hash", "finite")}
        out.update({f"grads/{n}": np.concatenate([b[n] for _, b in s.iter_blocks([n])]) for n in s.layers})
    return out


def test_store_rows_match_in_memory_capture(gpt2_dir, text_jsonl, tmp_path):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=4, seed=2), batch_size=5, shard_size=16)
    res = build_store(model, tok, data, tmp_path / "idx", cfg, progress=False)
    m = read_manifest(tmp_path / "idx")
    assert m["status"] == "complete" and m["counts"]["examples"] == len(data) == 40
    assert sorted(p.name for p in (tmp_path / "idx" / "store").iterdir()) == sorted(
        [f"shard-0000{k}.h5" for k in range(3)] + [f"shard-0000{k}.rowhash.npy" for k in range(3)])  # + row hashes
    arrays = _store_arrays(tmp_path / "idx")
    assert arrays["ids"].tolist() == list(range(40))
    with GradientCapture(model, None, ProjectedRows(RowSpace(cfg.projection))) as cap:
        bg = batch_gradients(model, cap, data.input_ids[10:13], data.labels[10:13], tok.pad_token_id)
    for n, v in bg.grads.items():
        assert arrays[f"grads/{n}"].shape == (40, 32)
        np.testing.assert_allclose(arrays[f"grads/{n}"][10:13], v.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(arrays["loss"][10:13], bg.loss.numpy(), rtol=1e-5)
    assert arrays["num_tokens"].tolist() == [len(x) - 1 for x in data.input_ids]
    assert arrays["finite"].all() and res.examples_computed == 40
    # A re-run with the same arguments is a no-op resume.
    again = build_store(model, tok, data, tmp_path / "idx", cfg, progress=False)
    assert again.examples_computed == 0


def _build_cmd(model_dir, data, out, storage="fp32"):
    return [sys.executable, "-m", "gradindex.cli", "build", str(model_dir), str(data), "--out", str(out),
            "--projection", "8", "--batch-size", "4", "--shard-size", "16", "--quiet", "--device", "cpu",
            "--storage", storage, "--precondition", "none"]


@pytest.mark.slow
@pytest.mark.parametrize("storage, n, kill_after", [("fp32", 600, 4), ("int4", 128, 2)])
def test_killed_build_resumes_to_identical_store(gpt2_dir, tmp_path, storage, n, kill_after):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_texts(n, seed=4)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"  # the uninterrupted build, in this process (what _build_cmd asks for)
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse("8"), batch_size=4, shard_size=16, storage=storage)
    records = tokenize_records(load_records(data), tok, 512)
    build_store(model, tok, records, ref, cfg, progress=False)

    out = tmp_path / "killed"
    proc = subprocess.Popen(_build_cmd(gpt2_dir, data, out, storage), env=env)
    store = out / "store"
    deadline = time.time() + 120
    while time.time() < deadline and not (store / f"shard-{kill_after:05d}.h5").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert read_manifest(out)["status"] == "building", "the build finished before it could be killed"
    done = sorted(p.name for p in store.glob("shard-*.h5"))
    assert 0 < len(done) < n // 16
    res = build_store(model, tok, records, out, cfg, progress=False)  # the resume, as the CLI's re-run does it
    assert read_manifest(out)["status"] == "complete" and 0 < res.examples_computed < n
    a, b = _store_arrays(ref), _store_arrays(out)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with Store(ref) as s_ref, Store(out) as s_out:  # the codes themselves, not only their decoding
        assert s_ref.storage == s_out.storage == storage
        for k in range(len(s_ref.paths)):
            for n in s_ref.layers:
                np.testing.assert_array_equal(s_ref._file(k)["grads"][n][:], s_out._file(k)["grads"][n][:])


def test_resume_with_other_settings_is_refused_naming_the_difference(gpt2_dir, llama_dir, text_jsonl, tmp_path):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    out = tmp_path / "idx"
    build_store(model, tok, data, out, BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8)), progress=False)
    with pytest.raises(IndexMismatchError, match="projection differs"):
        build_store(model, tok, data, out, BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8, seed=1)),
                    progress=False)
    with pytest.raises(IndexMismatchError, match=r"layer set differs \(only in the index: transformer\.h\.0\.attn"):
        build_store(model, tok, data, out, BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8),
                                                       layers=("*.mlp.*",)), progress=False)  # (names, not a cut)
    with pytest.raises(IndexMismatchError, match="data set differs"):
        build_store(model, tok, tokenize_records(load_records(text_jsonl), tok, 8), out,
                    BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8), max_length=64), progress=False)
    other, _ = load_causal_lm(gpt2_dir, device="cpu")
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight.add_(0.01)
    with pytest.raises(IndexMismatchError, match="model differs"):
        build_store(other, tok, data, out, BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8)), progress=False)
    # Nothing already written was touched by the refusals.
    assert read_manifest(out)["status"] == "complete" and len(Store(out)) == 40


def test_nonfinite_gradients_are_flagged_and_zeroed(gpt2_dir, tokenizer, tmp_path):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    bad_token = tok("fish")["input_ids"][0]
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    with torch.no_grad():
        model.transformer.wte.weight[bad_token] = float("nan")
    texts = ["the cat sat", "fish ate dog", "red sun over hills", "fish bread"]
    data = tokenize_records(load_records(_write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])), tok, 32)
    res = build_store(model, tok, data, tmp_path / "idx", BuildConfig.raw(batch_size=4), progress=False)
    assert res.manifest["nonfinite_ids"] == [1, 3]
    arrays = _store_arrays(tmp_path / "idx")
    assert arrays["finite"].tolist() == [True, False, True, False]
    for k, v in arrays.items():
        if k.startswith("grads/"):
            assert np.isfinite(v).all() and not v[1].any() and v[0].any()


# ---- CLI ------------------------------------------------------------------------------------

def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_cli_build_reads_every_data_format(gpt2_dir, tmp_path):
    import datasets

    rows = [{"prompt": "the cat", "completion": " sat on a mat"}, {"prompt": "dog", "completion": " ran far away"}]
    _write_jsonl(tmp_path / "pc.jsonl", rows)
    (tmp_path / "pc.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_csv(tmp_path / "pc.csv")
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "pc.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "pc_ds")
    ref = tokenize_records(load_records(tmp_path / "pc.jsonl"), load_causal_lm(gpt2_dir)[1], 64)
    n_completion = [sum(x != -100 for x in lab[1:]) for lab in ref.labels]
    losses = []
    for name in ("pc.jsonl", "pc.json", "pc.csv", "pc.parquet", "pc_ds"):
        r = _cli("build", gpt2_dir, tmp_path / name, "--out", tmp_path / f"i_{name}", "--quiet")
        assert r.exit_code == 0, r.output
        assert "built" in r.output
        with Store(tmp_path / f"i_{name}") as s:
            losses.append(s.column("loss"))
            assert s.column("num_tokens").tolist() == n_completion
    for v in losses[1:]:
        np.testing.assert_allclose(v, losses[0], rtol=1e-6)
    # pre-tokenized input with labels
    _write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}])
    r = _cli("build", gpt2_dir, tmp_path / "tok.jsonl", "--out", tmp_path / "i_tok", "--quiet", "--projection", "none")
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "i_tok") as s:
        assert s.column("num_tokens").tolist() == [2]
        assert s.dims["transformer.h.0.mlp.c_fc"] == 128 * 33


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_field", "no field 'body'.*--text-field"),
        ("empty", "empty"),
        ("bad_layers", "matched no module"),
        ("not_causal", "not a causal LM"),
        ("not_an_index", "not empty and holds no gradindex index"),
        ("bad_format", "cannot read"),
        ("bad_projection", "KAxKG"),
    ],
)
def test_cli_bad_input_gets_a_clear_error(case, message, gpt2_dir, text_jsonl, tmp_path):
    args = ["build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", "--quiet"]
    if case == "missing_field":
        args += ["--text-field", "body"]
    elif case == "empty":
        (tmp_path / "e.jsonl").write_text("")
        args[2] = tmp_path / "e.jsonl"
    elif case == "bad_layers":
        args += ["--layers", "mlp.*"]
    elif case == "not_causal":
        from transformers import DistilBertConfig

        DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32).save_pretrained(tmp_path / "db")
        args[1] = tmp_path / "db"
    elif case == "not_an_index":
        (tmp_path / "idx").mkdir()
        (tmp_path / "idx" / "precious.txt").write_text("keep me")
    elif case == "bad_format":
        (tmp_path / "d.txt").write_text("hello")
        args[2] = tmp_path / "d.txt"
    elif case == "bad_projection":
        args += ["--projection", "big"]
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code != 0
    import re

    assert re.search(message, r.output), r.output
    if case == "not_an_index":
        assert (tmp_path / "idx" / "precious.txt").read_text() == "keep me"


def test_cli_truncation_is_counted_and_said(gpt2_dir, text_jsonl, tmp_path):
    r = _cli("build", gpt2_dir, text_jsonl, "--out", tmp_path / "idx", "--max-length", "8", "--quiet")
    assert r.exit_code == 0
    m = read_manifest(tmp_path / "idx")
    assert m["counts"]["truncated"] > 0
    assert f"{m['counts']['truncated']} of 40 examples were longer than --max-length 8" in r.output
    with Store(tmp_path / "idx") as s:
        assert s.column("num_tokens").max() == 7


def test_cli_layers_lists_default_selection(gpt2_dir):
    r = _cli("layers", gpt2_dir)
    assert r.exit_code == 0
    assert "* transformer.h.1.mlp.c_fc  conv1d 32->128 +bias" in r.output
    assert "  lm_head" in r.output


# ---- identity: every value of the model, its dtype, --overwrite -----------------------------------

def _old_sampled_fingerprint(model) -> str:
    """The fingerprint before this change: a strided sample of ≤ 65,536 values per parameter."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}".encode())
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 65536)
        h.update(flat[::step][:65536].to(torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()


def test_a_weight_the_old_sampler_skipped_is_refused_for_resume_and_query(tokenizer, tmp_path):
    from fixtures.tiny import save_model_dir, tiny_gpt2
    from gradindex.index import IndexConfig
    from gradindex.pipeline import build_index
    from gradindex.query import QueryEngine

    model = tiny_gpt2(vocab_size=len(tokenizer), n_layer=1, n_embd=192, n_head=4)  # c_fc: 147,456 weights
    model_dir = save_model_dir(model, tokenizer, tmp_path / "m")
    model, tok = load_causal_lm(model_dir, device="cpu")
    texts = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_texts(6, seed=3, max_words=8)])
    data = tokenize_records(load_records(texts), tok, 16)
    out = tmp_path / "idx"
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4), layers=("*.mlp.c_fc",))
    build_index(model, tok, data, out, cfg, index=IndexConfig(factory="Flat"), model_id=str(model_dir),
                progress=False)
    other, _ = load_causal_lm(model_dir, device="cpu")
    old = _old_sampled_fingerprint(other)
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight.view(-1)[1] += 0.5  # odd index: stride 2 skipped it
    assert _old_sampled_fingerprint(other) == old
    with pytest.raises(IndexMismatchError, match="model differs"):
        build_store(other, tok, data, out, cfg, progress=False)
    with pytest.raises(IndexMismatchError, match="does not fit the index.*model differs"):
        QueryEngine(out, model=other, tokenizer=tok)
    QueryEngine(out, model=model, tokenizer=tok).close()


def test_bfloat16_resume_of_a_float32_partial_store_is_refused_naming_the_dtype(gpt2_dir, text_jsonl, tmp_path):
    out = tmp_path / "idx"
    args = ["build", gpt2_dir, text_jsonl, "--out", out, "--shard-size", "16", "--no-index", "--quiet"]
    assert _cli(*args).exit_code == 0
    m = read_manifest(out)
    m["status"] = "building"  # as a kill leaves it: the last shard not yet written
    (out / "manifest.json").write_text(json.dumps(m))
    (out / "store" / "shard-00002.h5").unlink()
    before = {p.name: p.read_bytes() for p in (out / "store").iterdir()}
    r = CliRunner().invoke(main, [str(a) for a in args + ["--dtype", "bfloat16"]])
    assert r.exit_code != 0
    assert 'model dtype differs (index: "float32", now: "bfloat16")' in r.output
    assert "model differs" not in r.output  # implied by the dtype; not named twice
    assert {p.name: p.read_bytes() for p in (out / "store").iterdir()} == before
    assert read_manifest(out)["dtype"] == "float32"
    assert _cli(*args).exit_code == 0 and read_manifest(out)["status"] == "complete"


def test_overwrite_replaces_the_index_whatever_it_holds(gpt2_dir, text_jsonl, tmp_path):
    out = tmp_path / "idx"
    args = ["build", gpt2_dir, text_jsonl, "--out", out, "--no-index", "--quiet"]
    assert _cli(*args).exit_code == 0
    # same settings: --overwrite recomputes every example (it used to resume, computing nothing)
    r = _cli(*args, "--overwrite")
    assert r.exit_code == 0 and "(40 computed now)" in r.output
    # other settings that a plain resume refuses
    r = CliRunner().invoke(main, [str(a) for a in args + ["--storage", "int8"]])
    assert r.exit_code != 0 and "transcode (--transcode, with its --storage and --damping) differs" in r.output
    r = _cli(*args, "--storage", "int8", "--dtype", "bfloat16", "--overwrite")
    assert r.exit_code == 0
    m = read_manifest(out)
    assert m["build"]["storage"] == "int8" and m["dtype"] == "bfloat16"
    with Store(out) as s:
        assert s.storage == "int8"
    # a corrupt manifest: the error names --overwrite, and --overwrite replaces it
    (out / "manifest.json").write_text("{not json")
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code != 0 and "corrupt" in r.output and "--overwrite" in r.output
    assert _cli(*args, "--overwrite").exit_code == 0 and read_manifest(out)["status"] == "complete"
