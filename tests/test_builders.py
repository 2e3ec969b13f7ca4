"""The builders/ recipes run as a user runs them (subprocesses, a tiny model from a config, tmp dirs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_texts
from tests.test_integrations import _rows, assert_rows_close

ROOT = Path(__file__).resolve().parents[1]
N = 24


def run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gpt2_dir):
    d = tmp_path_factory.mktemp("builders")
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(N, seed=5, max_words=16)))
    common = ["--model", str(gpt2_dir), "--data", str(data), "--projection", "8", "--device", "cpu"]
    run("builders/offline.py", *common, "--out", str(d / "offline"), "--no-index")
    return d, common


@pytest.mark.slow
def test_hf_trainer_recipe_at_lr0_equals_offline_recipe(setup):
    d, common = setup
    out = run("builders/hf_trainer.py", *common, "--out", str(d / "hf"), "--lr", "0", "--batch-size", "4",
              "--accum", "2")
    assert f"captured {N} examples over 3 steps" in out
    ids, live = _rows(d / "hf")
    assert (ids == np.arange(N)).all()
    assert_rows_close(live, _rows(d / "offline")[1], 1e-4)


@pytest.mark.slow
def test_plain_loop_recipe_then_python_m_gradindex(setup):
    d, common = setup
    out = run("builders/plain_loop.py", *common, "--out", str(d / "plain"), "--lr", "1e-3", "--batch-size", "4",
              "--epochs", "2")
    assert f"captured {N} examples over 12 steps" in out
    assert (d / "plain-model" / "config.json").exists()
    assert f"{N} examples" in run("-m", "gradindex", "info", str(d / "plain"))
    from click.testing import CliRunner

    from gradindex.cli import main

    r = CliRunner().invoke(main, ["index", str(d / "plain"), "--cpu-index"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["query", str(d / "plain"), "--text", "the cat sat", "-k", "3", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.splitlines()[-1])
    assert len(res) == 3 and all(0 <= h["id"] < N for h in res)


@pytest.mark.slow
def test_trl_sft_recipe(setup):
    pytest.importorskip("trl")
    d, common = setup
    out = run("builders/trl_sft.py", *common, "--out", str(d / "trl"), "--lr", "0", "--batch-size", "4")
    assert f"captured {N} examples over 6 steps" in out
    ids, live = _rows(d / "trl")
    assert (ids == np.arange(N)).all()
    # TRL's fused LM head (chunked log-prob kernel) computes its own backward: on CPU its per-example
    # gradients differ from the plain head's by ~0.5% (tokens, losses and the loss scale agree)
    assert_rows_close(live, _rows(d / "offline")[1], 2e-2)


@pytest.mark.slow
def test_select_plain_loop_recipe_trains_on_the_kept_fraction(setup, tmp_path):
    d, common = setup
    target = tmp_path / "target.jsonl"
    target.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(6, seed=9, max_words=12)))
    args = [a for a in common if a != "--projection" and a != "8"]
    out = run("builders/select_plain_loop.py", *args, "--projection", "8", "--target", str(target),
              "--out", str(tmp_path / "model"), "--batch-size", "8", "--keep", "0.5", "--refresh-every", "1")
    assert f"trained on {N // 2} of {N} examples (top)" in out and "3 target refreshes" in out
    assert (tmp_path / "model" / "config.json").exists()


@pytest.mark.slow
def test_trl_lora_chat_recipe_finds_the_planted_facts(tmp_path):
    """LoRA SFT with TRL on chats with planted facts, the index captured in training: EK-FAC ranks each fact's
    conversation first for the fact asked in other words; the adapter reloads as the index's model."""
    for pkg in ("trl", "peft"):
        pytest.importorskip(pkg, reason=f"{pkg} is not installed (pip install 'gradindex[dev]' installs it)")
    out = run("builders/trl_lora_chat.py", "--out", str(tmp_path / "idx"))
    ranks = json.loads(out.strip().splitlines()[-1])["planted_ranks"]
    assert ranks["ekfac"] == [1, 1, 1, 1], out
    m = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert m["build"]["adapter_fingerprint"] and all(".lora_" in n for n in m["build"]["layers"])
    assert m["chat_template"] and m["counts"]["text_field"] == "messages"
    assert (tmp_path / "idx-work" / "adapter" / "adapter_config.json").is_file()
    assert "[assistant] " in (tmp_path / "idx-audit" / "report.html").read_text()
