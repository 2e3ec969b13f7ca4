"""The planted-facts step of the real-LLM benchmark (benchmarks/real_llm.py ``facts``): its cache keys, the
per-epoch snapshots it may take its fine-tune from, and how it names the rows that outrank a source."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import smollm2
from benchmarks.real_llm import misses, row_kind


def test_the_fact_count_keys_the_cache_and_the_default_keeps_its_name():
    r = smollm2.Recipe()
    assert smollm2.finetune_dir(160, 0, r, Path("/c")).name == f"ft-n160-s0-{r.key()}"  # the n=160 cache stays valid
    assert smollm2.finetune_dir(512, 0, r, Path("/c"), facts=40).name == f"ft-n512-f40-s0-{r.key()}"
    assert replace(r, epochs=2).key() != r.key()


def test_misses_name_what_outranks_a_source():
    cs = smollm2.chat_set(120, facts=6, held_out=3, seed=3)
    facts = [smollm2.asdict(f) for f in cs.facts]
    texts = [" ".join(m["content"] for m in r["messages"]) for r in cs.records]
    kinds = [row_kind(t, i, facts[0], facts) for i, t in enumerate(texts)]
    assert sorted(i for i, k in enumerate(kinds) if k == "source") == sorted(facts[0]["rows"])
    assert kinds.count("names the entity") == 3 and kinds.count("value word") >= 1
    assert "another fact's source" in kinds and "documentation" in kinds
    score = np.zeros((6, 120))
    for j, f in enumerate(facts):
        score[j, f["rows"]] = 1.0
    entity_row = kinds.index("names the entity")
    score[0, entity_row] = 2.0  # fact 0's source is second, behind a conversation naming its entity
    out = misses(score, {"facts": facts}, texts)
    assert [m["fact"] for m in out] == [0] and out[0]["source_rank"] == 2
    assert out[0]["above"] == [{"row": entity_row, "kind": "names the entity", "score": 2.0}]


@pytest.mark.slow
def test_an_epoch_snapshot_is_the_shorter_recipe(tmp_path):
    """The learning rate is constant, so the adapter after epoch 2 of a 3-epoch run is the 2-epoch recipe's."""
    from fixtures.tiny import chat_tokenizer, save_model_dir, tiny_llama

    cs = smollm2.chat_set(40, facts=3, held_out=1, seed=1)
    tok = chat_tokenizer([m["content"] for r in cs.records for m in r["messages"]], vocab_size=300)
    base = save_model_dir(tiny_llama(vocab_size=len(tok), n_layer=1, hidden=16, n_head=2, intermediate=24), tok,
                          tmp_path / "base")
    recipe = smollm2.Recipe(rank=2, alpha=4, lr=1e-2, epochs=3, batch_size=8, max_length=96)
    seen = {}

    def keep(model, epoch, seconds):
        seen[epoch] = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora" in k}

    smollm2.train_lora(base, cs.records, recipe, 5, on_epoch=keep)
    short, _ = smollm2.train_lora(base, cs.records, replace(recipe, epochs=2), 5)
    two = {k: v for k, v in short.state_dict().items() if "lora" in k}
    assert sorted(seen) == [1, 2, 3] and two.keys() == seen[2].keys()
    assert all(torch.equal(two[k], seen[2][k]) for k in two)
    assert not all(torch.equal(seen[3][k], seen[2][k]) for k in two)


@pytest.mark.slow
def test_adam_state_is_the_rerun_optimizer_state_gradindex_reads(tmp_path):
    """``adam_state`` re-runs a fine-tune keeping AdamW's ``exp_avg_sq``: a file gradindex's loader reads for the
    PEFT model, one update per batch and epoch; a re-run of the same records and seed is the cached adapter."""
    from transformers import AutoModelForCausalLM

    from fixtures.tiny import chat_tokenizer, save_model_dir, tiny_llama
    from gradindex.adapter import attach_adapter
    from gradindex.capture.adam import load_second_moments

    cs = smollm2.chat_set(40, facts=3, held_out=1, seed=1)
    tok = chat_tokenizer([m["content"] for r in cs.records for m in r["messages"]], vocab_size=300)
    base = save_model_dir(tiny_llama(vocab_size=len(tok), n_layer=1, hidden=16, n_head=2, intermediate=24), tok,
                          tmp_path / "base")
    recipe = smollm2.Recipe(rank=2, alpha=4, lr=1e-2, epochs=2, batch_size=8, max_length=96)
    model, _ = smollm2.train_lora(base, cs.records, recipe, 5)
    model.save_pretrained(tmp_path / "adapter")
    ft = {"base": str(base), "adapter": str(tmp_path / "adapter"),
          "data": str(smollm2.write_jsonl(cs.records, tmp_path / "train.jsonl")), "seed": 5,
          "recipe": smollm2.asdict(recipe)}
    info = smollm2.adam_state(ft, tmp_path)
    assert info["step"] == 2 * 5 and info["vs_cached_adapter"]["bit_identical"]
    assert info["adapter_rerun"] is None and not (tmp_path / "adapter-rerun").exists()
    model = attach_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter")
    moments = load_second_moments(tmp_path / "adam-state.safetensors", model)  # as `gradindex build --adapter` does
    assert len(moments.v) == sum("lora_" in n for n, _ in model.named_parameters()) == info["tensors"]
    assert set(moments.eps.values()) == {1e-8} and all((v > 0).any() for v in moments.v.values())
