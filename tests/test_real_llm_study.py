"""The halves study of the real-LLM benchmark (benchmarks/real_llm.py ``report``, TrackStar, paired noise): the report
reads the retrainings that exist and trains none, writes only its own keys, never shortens the masks a longer run
trains from; TrackStar's second-moment stand-ins and scores through a LoRA adapter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import real_llm
from benchmarks.real_llm import _save_masks, halves, paired, retrained, second_moments


def _work(tmp_path: Path, n: int = 20, q: int = 4, subsets: int = 3, noise: int = 1) -> Path:
    work = tmp_path / "ft"
    (work / "retrain").mkdir(parents=True)
    masks = halves(n, subsets)
    rng = np.random.default_rng(0)
    for i in range(subsets):
        for r in (0, 1) if i < noise else (0,):
            (work / "retrain" / f"s{i:03d}-r{r}.json").write_text(json.dumps(
                {"losses": rng.normal(size=q).tolist(), "rows": np.flatnonzero(masks[i]).tolist()}))
    return work


def test_retrained_reads_what_exists_and_trains_nothing(tmp_path):
    work = _work(tmp_path)
    first, pairs = retrained(halves(20, 3), 1, work)
    assert first.shape == (3, 1, 4) and pairs.shape == (1, 2, 4)
    with pytest.raises(SystemExit, match="3 subsets under seed 0 and 1 under seed 1 exist"):
        retrained(halves(20, 4), 1, work)
    assert not (work / "retrain" / "s003-r0.json").exists() and not (work / "masks.npy").exists()
    bad = halves(20, 3)
    bad[1] = ~bad[1]
    with pytest.raises(SystemExit, match="other rows than subset 1"):
        retrained(bad, 1, work)


def test_a_shorter_run_keeps_the_longer_runs_masks(tmp_path):
    _save_masks(tmp_path, halves(30, 6))
    _save_masks(tmp_path, halves(30, 4))  # (the first 4 of the 6: halves are drawn in order)
    assert np.array_equal(np.load(tmp_path / "masks.npy"), halves(30, 6))
    _save_masks(tmp_path, halves(30, 8))
    assert np.load(tmp_path / "masks.npy").shape == (8, 30)
    _save_masks(tmp_path, halves(30, 2, seed=7))  # other masks: replaced
    assert np.array_equal(np.load(tmp_path / "masks.npy"), halves(30, 2, seed=7))


def test_report_writes_only_its_keys_over_existing_retrainings(tmp_path, monkeypatch):
    work = _work(tmp_path)
    results = tmp_path / "real-llm.json"
    results.write_text(json.dumps({"query-tokens": {"kept": 1}, "facts-512": [2], "methods": "old"}))
    monkeypatch.setattr(real_llm, "RESULTS", results)
    ft = {"n": 20, "seed": 0, "recipe": {}, "train_seconds": 1.0, "learned": 0, "fact_queries": 2, "doc_queries": 2,
          "facts": [{"rows": [0]}, {"rows": [1, 2]}]}
    rng = np.random.default_rng(1)
    scores = {real_llm.DEFAULT: rng.normal(size=(4, 20)), "first stage ekfac (full)": rng.normal(size=(4, 20))}
    scores["first stage ekfac-selfnorm refined (full)"] = scores[real_llm.DEFAULT] + 0.1 * rng.normal(size=(4, 20))
    other = real_llm.report(ft, work, {}, scores, 3, 1)  # another fine-tune than the first study's: its own key
    out = json.loads(results.read_text())
    assert out["methods"] == "old" and out[f"halves-{work.name}"]["methods"] == other["methods"]
    monkeypatch.setattr(real_llm, "FIRST_STUDY", work.name)
    res = real_llm.report(ft, work, {}, scores, 3, 1)
    out = json.loads(results.read_text())
    assert out["query-tokens"] == {"kept": 1} and out["facts-512"] == [2]
    assert set(out["methods"]) == set(scores) and out["subsets"] == 3 and out["noise_subsets"] == 1
    assert out["refinement"]["first stage ekfac-selfnorm refined (full)"]["over"] == real_llm.DEFAULT
    assert "first stage ekfac refined (full)" not in out["refinement"]
    row = res["methods"]["first stage ekfac (full)"]
    assert row["vs_default"] == paired(row["lds_per_query"], res["methods"][real_llm.DEFAULT]["lds_per_query"])
    assert sorted(p.name for p in (work / "retrain").iterdir()) == ["s000-r0.json", "s000-r1.json", "s001-r0.json",
                                                                    "s002-r0.json"]
    refined = scores.pop("first stage ekfac-selfnorm refined (full)")
    seconds = np.array([5.0, np.nan, 7.0, np.nan])  # a partial refine run: queries 0 (a fact) and 2 (a document)
    np.savez(work / "refine-partial.npz", seconds=seconds, **{"ekfac-selfnorm": refined, "ekfac": refined})
    part = real_llm.report(ft, work, {}, scores, 3, 1)["refinement"]["first stage ekfac-selfnorm refined (full)"]
    full = res["methods"]["first stage ekfac-selfnorm refined (full)"]["lds_per_query"]
    assert part["queries"] == [0, 2] and part["of"] == 2 and part["seconds_per_query"] == 6.0
    assert part["lds"] == pytest.approx(np.mean([full[0], full[2]]), abs=1e-4)
    assert len(part["fact_ranks"]) == len(part["fact_ranks_plain"]) == 1


def test_paired_difference_and_its_standard_error():
    a, b = np.array([0.5, 0.4, 0.3, 0.6]), np.array([0.4, 0.4, 0.1, 0.5])
    d = a - b
    p = paired(a, b)
    assert p["diff"] == pytest.approx(d.mean(), abs=1e-4) and p["higher"] == 3 and p["of"] == 4
    assert p["se"] == pytest.approx(d.std(ddof=1) / 2, abs=1e-4)


def test_second_moments_follow_the_fine_tunes_batches():
    rng = np.random.default_rng(0)
    G, nt = rng.normal(size=(10, 7)).astype(np.float32), rng.integers(1, 9, size=10).astype(float)
    ft = {"seed": 3, "recipe": {"batch_size": 4, "epochs": 2}}
    v = second_moments(ft, G, nt)
    order, want = np.random.default_rng(3), []
    for _ in range(2):
        perm = order.permutation(10)
        want += [(G[perm[s:s + 4]].sum(0, dtype=np.float64) / nt[perm[s:s + 4]].sum()) ** 2 for s in (0, 4, 8)]
    assert np.allclose(v["batches"], np.mean(want, 0))
    assert np.allclose(v["examples"], np.mean((G.astype(np.float64) / nt[:, None]) ** 2, 0))


@pytest.mark.slow
def test_trackstar_through_a_lora_adapter(tmp_path):
    """A training example asked as a query is its own best match under every normalized score."""
    from peft import LoraConfig, get_peft_model

    from benchmarks import smollm2
    from fixtures.tiny import chat_tokenizer, save_model_dir, tiny_llama

    cs = smollm2.chat_set(24, facts=2, held_out=1, seed=2)
    tok = chat_tokenizer([m["content"] for r in cs.records for m in r["messages"]], vocab_size=300)
    torch.manual_seed(0)
    base = save_model_dir(tiny_llama(vocab_size=len(tok), n_layer=1, hidden=16, n_head=2, intermediate=24), tok,
                          tmp_path / "base")
    from transformers import AutoModelForCausalLM

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # (B starts at zero: A's gradient would be zero)
    lora.save_pretrained(tmp_path / "adapter")
    data = smollm2.write_jsonl(cs.records, tmp_path / "train.jsonl")
    ft = {"base": str(base), "adapter": str(tmp_path / "adapter"), "data": str(data), "seed": 0,
          "recipe": {"max_length": 96, "batch_size": 8, "epochs": 2}}
    out = real_llm.trackstar(ft, cs.records[:3], save=tmp_path)
    assert set(out) == {"graddot (adapter, unprojected)", "cosine (adapter, unprojected)",
                        *(f"trackstar{p} (adapter, v: {w})" for p in ("", " unprojected")
                          for w in ("batches", "examples"))}
    for name, s in out.items():
        assert s.shape == (3, 24) and np.isfinite(s).all()
        if name != "graddot (adapter, unprojected)":
            assert np.allclose(np.diag(s[:, :3]), 1.0, atol=1e-5) and (s <= 1 + 1e-6).all(), name
            assert (s.argmax(1) == np.arange(3)).all(), name
    from peft import PeftModel

    from gradindex.capture.adam import load_second_moments

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     tmp_path / "adapter")
    for which in ("batches", "examples"):  # the stand-ins are optimizer states gradindex reads for this model
        moments = load_second_moments(tmp_path / f"v-{which}.safetensors", peft)
        assert len(moments.v) == sum("lora_" in n for n, _ in peft.named_parameters()) == 4
    adam = real_llm.trackstar(ft, cs.records[:3], states={"adam": tmp_path / "v-batches.safetensors"},
                              stand_ins=False)  # another v source, read from a state file: only its scores
    assert set(adam) == {"trackstar (adapter, v: adam)", "trackstar unprojected (adapter, v: adam)"}
    assert np.allclose(adam["trackstar unprojected (adapter, v: adam)"],
                       out["trackstar unprojected (adapter, v: batches)"])


def test_drop_retrainings_are_kept_in_the_repository_and_restored(tmp_path, monkeypatch):
    """A 1%-drop retraining's file is copied into ``KEPT`` (the repository) and, on a machine whose cache lacks it,
    read back from there; a file trained on other rows than its drop's mask is still refused."""
    monkeypatch.setattr(real_llm, "KEPT", tmp_path / "kept")
    masks = real_llm.drops(20, 2)
    assert (~masks).sum(axis=1).tolist() == [1, 1]
    work = tmp_path / "ft-a"
    for i in range(2):
        out = work / "drop" / "retrain" / f"s{i:03d}-r0.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"losses": [float(i), 1.0], "rows": np.flatnonzero(masks[i]).tolist()}))
        real_llm._keep(out, work, "drop")
    assert sorted(p.name for p in (tmp_path / "kept" / "ft-a" / "drop").iterdir()) == ["s000-r0.json", "s001-r0.json"]
    fresh = tmp_path / "fresh" / "ft-a"  # another machine: the same fine-tune's folder name, an empty cache
    first, _ = retrained(masks, 0, fresh, protocol="drop")
    assert first[:, 0, 0].tolist() == [0.0, 1.0] and (fresh / "drop" / "retrain" / "s001-r0.json").exists()
    other = real_llm.drops(20, 2, seed=1)
    with pytest.raises(SystemExit, match="other rows than subset"):
        retrained(other, 0, tmp_path / "third" / "ft-a", protocol="drop")
    half = real_llm.halves(20, 1)
    out = work / "retrain" / "s000-r0.json"  # the halves' files are kept too, in their own folder
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"losses": [2.0, 1.0], "rows": np.flatnonzero(half[0]).tolist()}))
    real_llm._keep(out, work, "halves")
    first, _ = retrained(half, 0, tmp_path / "fourth" / "ft-a")
    assert first[:, 0, 0].tolist() == [2.0] and (tmp_path / "kept" / "ft-a" / "halves" / "s000-r0.json").exists()


def test_drop_report_keeps_its_key_and_reads_the_noise(tmp_path, monkeypatch):
    """``report-drop`` writes only ``drop``; its noise ceiling is the two batch orders' agreement (here equal
    orders: 1.0), its batch-order change the median relative gap between them, its facts' shared variance the part
    of the fact queries' loss moves common to all (here all of it)."""
    monkeypatch.setattr(real_llm, "KEPT", tmp_path / "kept")
    results = tmp_path / "real-llm.json"
    results.write_text(json.dumps({"methods": {real_llm.DEFAULT: {"lds": 0.4}}}))
    monkeypatch.setattr(real_llm, "RESULTS", results)
    n, m, noise = 20, 5, 3
    masks = real_llm.drops(n, m)
    work = tmp_path / "ft-b"
    step = np.arange(m, dtype=np.float64)  # drop i moves every fact query's loss by the same 1 + 0.01 i
    for i in range(m):
        losses = [1.0 + 0.01 * step[i]] * 2 + [2.0 + 0.02 * ((3 * i) % m)] * 2
        for r in (0, 1) if i < noise else (0,):
            out = work / "drop" / "retrain" / f"s{i:03d}-r{r}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"losses": [x * (1.1 if r else 1.0) for x in losses],
                                       "rows": np.flatnonzero(masks[i]).tolist()}))
    ft = {"n": n, "fact_queries": 2, "doc_queries": 2, "facts": [{"rows": [0]}, {"rows": [1]}]}
    rng = np.random.default_rng(2)
    scores = {real_llm.DEFAULT: rng.normal(size=(4, n)), "bm25": rng.normal(size=(4, n))}
    d = real_llm.report_drop(ft, work, scores, m, noise)["drop"]
    out = json.loads(results.read_text())
    assert out["methods"] == {real_llm.DEFAULT: {"lds": 0.4}} and out["drop"]["subsets"] == m
    assert d["noise_ceiling"] == pytest.approx(1.0) and d["noise_ceiling_facts_docs"] == [1.0, 1.0]
    assert d["batch_order_change_median"] == pytest.approx(1 - 1 / 1.1, abs=1e-4)
    assert d["facts_shared_variance"] == pytest.approx(1.0)
    assert "| first stage ekfac-selfnorm (full) |" in real_llm.drop_markdown(out) and "| 0.400 |" in \
        real_llm.drop_markdown(out)
