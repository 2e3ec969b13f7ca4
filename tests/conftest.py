"""Fixtures: small models built from configs, local tokenizers and data; no network."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models and indices: on a shared CPU, OpenMP spin-waits of a second thread cost 10-50x."""
    import faiss

    n_torch, n_faiss = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(n_torch)
    faiss.omp_set_num_threads(n_faiss)

WORDS = ("the cat sat on a mat while some dog ran far away from home and ate fish bread at noon "
         "under blue sky with red sun over green hills near old town river").split()


def make_texts(n: int, seed: int = 0, min_words: int = 3, max_words: int = 30) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(min_words, max_words + 1, (1,), generator=g))
        idx = torch.randint(len(WORDS), (L,), generator=g).tolist()
        out.append(" ".join(WORDS[i] for i in idx))
    return out


def write_jsonl(path, rows):
    """``rows`` as a JSONL file at ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def refused(code: int, output: str, out=None, *fix: str, skip: tuple[str, ...] = ("plan:",)) -> str:
    """A CLI refusal: exit 2, one ``Error:`` line (lines starting with ``skip`` aside) holding every ``fix``, no
    traceback, and ``out`` not created or left empty. Returns the error line."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(skip)]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), output
    assert "Traceback" not in output
    for words in fix:
        assert words in lines[0], lines[0]
    if out is not None:
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    return lines[0]


@pytest.fixture(scope="session")
def tokenizer():
    from fixtures.tiny import train_tokenizer

    return train_tokenizer(make_texts(200, seed=1) + [" ".join(WORDS)], vocab_size=300)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, tokenizer):
    from fixtures.tiny import save_model_dir, tiny_gpt2

    return save_model_dir(tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=4),
                          tokenizer, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer):
    from fixtures.tiny import save_model_dir, tiny_llama

    return save_model_dir(tiny_llama(vocab_size=len(tokenizer), n_layer=2, hidden=32, n_head=4, intermediate=48),
                          tokenizer, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def text_jsonl(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(p, "w") as f:
        for t in make_texts(40, seed=2):
            f.write(json.dumps({"text": t}) + "\n")
    return p


def raw_tiny_index(out, gpt2_dir, text_jsonl, seed: int, precondition: str, max_length: int):
    """A complete tiny GPT-2 index at ``out``: float32 rows projected 8 x 8 (``seed``), ``precondition`` fitted,
    its default tier built."""
    from gradindex.capture import ProjectionSpec
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import build_indices
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig, build_index

    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, max_length)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=8, seed=seed), shard_size=16,
                          precondition=precondition, max_length=max_length)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, progress=False)
    return out


@pytest.fixture(scope="session")
def audit_index(tmp_path_factory, gpt2_dir, text_jsonl):
    """A complete tiny GPT-2 index (float32 store, EK-FAC fitted, flat FAISS) for the apps' tests."""
    return raw_tiny_index(tmp_path_factory.mktemp("audit") / "index", gpt2_dir, text_jsonl, 3, "ekfac", 64)


@pytest.fixture(scope="session")
def default_index(tmp_path_factory, gpt2_dir, text_jsonl):
    """A tiny GPT-2 index built with the defaults (rows in the EK-FAC eigenbasis, int4), 3 shards, FAISS built."""
    from gradindex.data import load_records, tokenize_records
    from gradindex.index import build_indices
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig, build_index

    out = tmp_path_factory.mktemp("default") / "index"
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 48)
    cfg = BuildConfig(shard_size=16, max_length=48)  # `gradindex build`'s defaults
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, progress=False)
    return out
