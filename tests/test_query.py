"""The query engine against independent computations: numpy brute force, score_matrix, torch.func."""

from __future__ import annotations

import json
import shutil

import faiss
import numpy as np
import pytest
import torch
from torch.func import functional_call, grad

from gradindex.capture import ProjectionSpec, select_layers
from gradindex.capture.layers import layer_info
from gradindex.data import load_records, per_example_loss, tokenize_records
from gradindex.index import IndexConfig, IndexSpace, build_indices
from gradindex.methods import DEFAULT_DAMPING
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import IndexMismatchError
from gradindex.store import Store

QUERIES = ["the cat sat on a mat", "dog ran far away from home", ("some bread at noon", " under blue sky")]
METHODS = ["graddot", "cosine", "kfac", "ekfac", "graddot-selfnorm", "ekfac-selfnorm"]




def _build(out, model_dir, data_path, projection, precondition="ekfac", max_length=512):
    model, tok = load_causal_lm(model_dir, device="cpu")
    data = tokenize_records(load_records(data_path), tok, max_length)
    cfg = BuildConfig.raw(projection=projection, shard_size=16, precondition=precondition, max_length=max_length)
    build_index(model, tok, data, out, cfg, model_id=str(model_dir), data_id=str(data_path), progress=False)
    return out


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, gpt2_dir, text_jsonl):
    spec = ProjectionSpec(k_a=4, k_g=4, seed=1)
    return _build(tmp_path_factory.mktemp("q") / "index", gpt2_dir, text_jsonl, spec)


def _indexed(store_dir, tmp_path, cfg=IndexConfig()):
    d = tmp_path / "index"
    shutil.copytree(store_dir, d)
    shutil.rmtree(d / "faiss", ignore_errors=True)
    build_indices(d, cfg, progress=False)
    return d


@pytest.fixture(scope="module")
def engine(store_dir, tmp_path_factory):
    with QueryEngine(_indexed(store_dir, tmp_path_factory.mktemp("flat")), device="cpu") as e:
        yield e


def _brute(d, q: dict[str, torch.Tensor], method: str) -> np.ndarray:
    """Independent numpy scores for graddot/cosine: all stored rows, float64."""
    with Store(d) as s:
        t = s.read_rows(np.arange(len(s)))
    dots = sum(q[n].double().numpy() @ t[n].astype(np.float64).T for n in t)  # [Q, N]
    if method == "cosine":
        qn = np.sqrt(sum((q[n].double().numpy() ** 2).sum(1) for n in t))
        tn = np.sqrt(sum((t[n].astype(np.float64) ** 2).sum(1) for n in t))
        dots = dots / qn[:, None] / tn[None, :]
    return dots


def _check_exact(results, ref: np.ndarray, k: int, lowest: int = 0) -> None:
    for r, row in zip(results, ref, strict=True):
        order = np.lexsort((np.arange(len(row)), -row))[:k]
        assert [h.id for h in r.hits] == order.tolist()
        tiny = 1e-12 * np.abs(row).max()
        np.testing.assert_allclose([h.score for h in r.hits], row[order], rtol=1e-9, atol=tiny)
        for h in r.hits:
            assert sum(h.layer_scores.values()) == pytest.approx(h.score, rel=1e-9, abs=tiny)
        if lowest:
            low = np.lexsort((np.arange(len(row)), row))[:lowest]
            assert [h.id for h in r.lowest] == low.tolist()


@pytest.mark.parametrize("method", METHODS)
def test_flat_top_k_and_lowest_equal_brute_force(engine, method):
    toks = engine.tokenize(QUERIES)
    q, _, _ = engine.gradients(toks)
    ref = score_matrix(engine.dir, q, method=method, damping=DEFAULT_DAMPING)
    if method in ("graddot", "cosine"):
        np.testing.assert_allclose(ref, _brute(engine.dir, q, method), rtol=1e-9, atol=1e-9)
    res = engine.query_batch(QUERIES, k=7, method=method, lowest=3)
    _check_exact(res, ref, 7, 3)


SPACES = [IndexSpace("kfac", 0.3), IndexSpace("ekfac", 0.1), IndexSpace(normalize=True)]


@pytest.mark.parametrize("space", SPACES, ids=["whiten-kfac", "whiten-ekfac", "normalized"])
def test_any_method_and_damping_on_any_flat_index_is_exact(store_dir, tmp_path, engine, space):
    d = _indexed(store_dir, tmp_path, IndexConfig(space=space))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer) as e:
        for method, damping in [("graddot", 0.1), ("cosine", 0.1), ("kfac", 0.3), ("ekfac", 0.05)]:
            ref = score_matrix(d, q, method=method, damping=damping)
            _check_exact(e.search(q, k=5, method=method, damping=damping, lowest=2), ref, 5, 2)


def test_layer_subset_sums_only_those_layers(engine):
    q, _, _ = engine.gradients(engine.tokenize(QUERIES[:1]))
    layers = [n for n in engine.layer_names if ".mlp." in n]
    ref = score_matrix(engine.dir, q, method="cosine", layers=layers)
    res = engine.search(q, k=5, method="cosine", layers="*.mlp.*")
    _check_exact(res, ref, 5)
    assert res[0].layers == layers and set(res[0].hits[0].layer_scores) == set(layers)
    with pytest.raises(ValueError, match=r"match no indexed layer.*gradindex info"):
        engine.search(q, layers="mlp.*")
    with pytest.raises(ValueError, match=r"layer pattern 'mlp\.\*' matches no indexed layer"):
        engine.search(q, layers=["*.mlp.*", "mlp.*"])  # (one pattern of two a typo: it ran on the other's layers)


def test_ann_index_with_every_candidate_is_exact(store_dir, tmp_path, engine):
    d = _indexed(store_dir, tmp_path, IndexConfig(factory="IVF4,Flat", train_size=40))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer) as e:
        ref = score_matrix(d, q, method="kfac")
        _check_exact(e.search(q, k=5, method="kfac", candidates=40, nprobe=4, lowest=2), ref, 5, 2)
        few = e.search(q, k=5, method="kfac", candidates=5, nprobe=1)  # approximate, still exact scores
        for r, row in zip(few, ref, strict=True):
            np.testing.assert_allclose([h.score for h in r.hits], row[[h.id for h in r.hits]], rtol=1e-9)


@pytest.mark.parametrize("method", ["ekfac", "cosine"])
def test_shortlist_is_the_exact_per_layer_top(store_dir, tmp_path, engine, method):
    """With every row a candidate, each layer keeps its exact top `shortlist` contributions; the
    result is the best of their union, computed here independently with numpy."""
    from gradindex.precondition import load_preconditioner

    d = _indexed(store_dir, tmp_path, IndexConfig(factory="IVF4,Flat", train_size=40))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    with Store(d) as s:
        t = s.read_rows(np.arange(len(s)))
    P = load_preconditioner(d, method)
    contrib = {n: t[n].astype(np.float64) @ P.apply(n, q[n].double(), -1.0, DEFAULT_DAMPING).numpy().T
               for n in t}  # [N, Q]
    if method == "cosine":
        tn = np.sqrt(sum((t[n].astype(np.float64) ** 2).sum(1) for n in t))
        qn = np.sqrt(sum((q[n].double().numpy() ** 2).sum(1) for n in t))
        contrib = {n: c / tn[:, None] / qn[None, :] for n, c in contrib.items()}
    total = sum(contrib.values())
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer) as e:
        res = e.search(q, k=3, method=method, candidates=40, shortlist=2, nprobe=4)
    for j, r in enumerate(res):
        union = np.unique(np.concatenate([np.argsort(-c[:, j], kind="stable")[:3] for c in contrib.values()]))
        best = union[np.argsort(-total[union, j], kind="stable")[:3]]
        assert [h.id for h in r.hits] == best.tolist()


def test_query_forms_agree_and_batches_equal_single_queries(engine):
    tok = engine.tokenizer
    ids = tok("the cat sat on a mat", add_special_tokens=False)["input_ids"]
    a = engine.query("the cat sat on a mat", k=5)
    b = engine.query(ids, k=5)
    c = engine.query({"text": "the cat sat on a mat"}, k=5)
    batch = engine.query_batch(QUERIES, k=5)
    ids_of = [[h.id for h in r.hits] for r in (a, b, c, batch[0])]
    assert all(x == ids_of[0] for x in ids_of)
    np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in batch[0].hits], rtol=1e-5)
    pair = engine.query(("some bread at noon", " under blue sky"), k=5)
    p_ids = tok("some bread at noon", add_special_tokens=False)["input_ids"]
    c_ids = tok(" under blue sky", add_special_tokens=False)["input_ids"]
    rec = engine.query({"input_ids": p_ids + c_ids, "labels": [-100] * len(p_ids) + c_ids}, k=5)
    assert [h.id for h in pair.hits] == [h.id for h in rec.hits] == [h.id for h in batch[2].hits]
    assert pair.num_tokens == len(c_ids)


def test_results_carry_the_training_text(engine, text_jsonl):
    texts = [json.loads(line)["text"] for line in open(text_jsonl)]
    r = engine.query("the cat sat on a mat", k=4, lowest=2)
    assert all(h.text == texts[h.id] for h in r.hits + r.lowest)


def test_edited_or_missing_training_data_gives_no_text(store_dir, tmp_path, engine, text_jsonl):
    d = _indexed(store_dir, tmp_path)
    lines = open(text_jsonl).read().splitlines()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([json.dumps({"text": "something else entirely"})] + lines[1:]) + "\n")
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer, data=edited) as e:
        r = e.query("the cat sat on a mat", k=40)
        assert [h.text is None for h in r.hits] == [h.id == 0 for h in r.hits]
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer, data=tmp_path / "gone.jsonl") as e:
        r = e.query("the cat sat on a mat", k=3)
        assert all(h.text is None for h in r.hits) and "not there" in r.notes[-1]


def test_k_larger_than_the_index_returns_everything_with_a_note(engine):
    r = engine.query("the cat sat on a mat", k=100)
    assert len(r.hits) == 40 and "larger than the index (40 examples)" in r.notes[0]


def test_long_query_is_truncated_and_says_so(store_dir, tmp_path, gpt2_dir, text_jsonl):
    d = _build(tmp_path / "short", gpt2_dir, text_jsonl, ProjectionSpec(k_a=4, k_g=4), "none", max_length=8)
    build_indices(d, IndexConfig(), progress=False)
    with QueryEngine(d, device="cpu") as e:
        long = e.query("the cat sat on a mat while some dog ran far away from home", k=3)
        short = e.query("red sun", k=3)
    assert long.truncated and "truncated" in long.notes[0] and long.num_tokens == 7
    assert not short.truncated


def test_bad_queries_and_methods_are_clear_errors(engine, store_dir, tmp_path, gpt2_dir, text_jsonl):
    with pytest.raises(ValueError, match="no target token"):
        engine.query("")
    with pytest.raises(ValueError, match="no target token"):
        engine.query(("the cat sat", ""))
    with pytest.raises(TypeError, match="cannot read a query"):
        engine.query(3.5)
    with pytest.raises(ValueError, match="method 'tracin' sums scores over a training run's checkpoints"):
        engine.query("the cat sat", method="tracin")
    d = _build(tmp_path / "nofit", gpt2_dir, text_jsonl, ProjectionSpec(k_a=4, k_g=4), "none")
    build_indices(d, IndexConfig(), progress=False)
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer) as e:
        msg = r"'kfac' is not fitted.*gradindex precondition .* --method kfac"
        with pytest.raises(ValueError, match=msg):
            e.query("the cat sat on a mat", method="kfac")


def test_a_model_that_differs_is_refused(engine, tokenizer):
    from fixtures.tiny import tiny_gpt2

    other = tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=4, seed=5)
    with pytest.raises(IndexMismatchError, match="does not fit the index.*model differs"):
        QueryEngine(engine.dir, model=other, tokenizer=tokenizer)


# -- independent ground truth with torch.func -----------------------------------------------------

def _full_grads(model, examples) -> list[torch.Tensor]:
    """Per-example flattened weight gradients ``G`` of the hooked layers, by torch.func, one at a time."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    layers = select_layers(model)

    def loss_fn(p, x, y):
        logits = functional_call(model, p, (x.unsqueeze(0),)).logits
        return per_example_loss(logits, y.unsqueeze(0))[0].sum()

    out = []
    for x, y in examples:
        g = grad(loss_fn)(params, torch.tensor(x), torch.tensor(y))
        out.append(torch.cat([layer_info(m).weight_grad_to_G(g[n + ".weight"], g.get(n + ".bias")).reshape(-1)
                              for n, m in layers.items()]).double())
    return out


@pytest.fixture(scope="module")
def func_truth(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 512)
    q = tok("the cat sat on a mat", add_special_tokens=False)["input_ids"]
    grads = _full_grads(model, [(q, q)] + list(zip(data.input_ids, data.labels, strict=True)))
    return torch.stack(grads[1:]) @ grads[0]  # [N] exact full-gradient dot products


def test_unprojected_graddot_equals_torch_func_dot_products(tmp_path, gpt2_dir, text_jsonl, func_truth):
    d = _build(tmp_path / "full", gpt2_dir, text_jsonl, ProjectionSpec(kind="none", k_a=0, k_g=0), "none")
    build_indices(d, IndexConfig(), progress=False)
    with QueryEngine(d, device="cpu") as e:
        r = e.query("the cat sat on a mat", k=10)
    ref = func_truth.numpy()
    top = np.argsort(-ref)[:10]
    assert [h.id for h in r.hits] == top.tolist()
    np.testing.assert_allclose([h.score for h in r.hits], ref[top], rtol=1e-4)


def test_full_gradient_rerank_equals_torch_func_dot_products(engine, func_truth):
    r = engine.query("the cat sat on a mat", k=8, rerank_full=8, method="graddot")
    ref = func_truth.numpy()
    np.testing.assert_allclose([h.full_score for h in r.hits], ref[[h.id for h in r.hits]], rtol=1e-4)
    assert [h.full_score for h in r.hits] == sorted((h.full_score for h in r.hits), reverse=True)
    with pytest.raises(FileNotFoundError, match="no full-space kfac curvature"):
        engine.query("the cat sat on a mat", method="kfac", rerank_full=3)


@pytest.mark.skipif(faiss.get_num_gpus() == 0, reason="FAISS sees no GPU")
@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_gpu_search_equals_cpu_search(store_dir, tmp_path, engine, factory):
    d = _indexed(store_dir, tmp_path, IndexConfig(factory=factory, train_size=40))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    got = {}
    for gpu in (False, True):
        with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer, use_gpu=gpu) as e:
            got[gpu] = e.search(q, k=5, method="ekfac", lowest=2, candidates=40, nprobe=4)
    for a, b in zip(got[False], got[True], strict=True):
        assert [h.id for h in a.hits + a.lowest] == [h.id for h in b.hits + b.lowest]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-9)


def test_k_equal_to_n_on_an_approximate_index_returns_every_example(store_dir, tmp_path, engine):
    """One IVF list of four visited per layer finds some rows only: k = N must still return all N,
    ranked exactly, and say how."""
    d = _indexed(store_dir, tmp_path, IndexConfig(factory="IVF4,Flat", train_size=40))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer) as e:
        ref = score_matrix(d, q, method="kfac")
        res = e.search(q, k=40, method="kfac", nprobe=1, lowest=3)
        _check_exact(res, ref, 40, 3)
        assert "every example was scored exactly" in res[0].notes[-1]
        one = e.layer_names[0]
        few = e.search(q, k=9, method="kfac", nprobe=1, candidates=9, shortlist=9, layers=one)
        assert [len(r.hits) for r in few] == [9, 9, 9]
        widened = ["fewer than 9 candidates" in " ".join(r.notes) for r in few]
        assert any(widened), "one list of ~10 rows should leave some query short"
        ref = score_matrix(d, q, method="kfac", layers=[one])
        _check_exact([r for r, w in zip(few, widened, strict=True) if w], ref[widened], 9)


def test_failed_forced_rebuild_leaves_the_working_index(store_dir, tmp_path, engine, monkeypatch):
    """`gradindex index --force` that dies mid-way, or between the renames of its swap, leaves a
    complete set of indices answering queries exactly as before; the next build settles the swap."""
    import os

    from gradindex.cli.verify import verify_index
    from gradindex.index.tiers import faiss_layers as index_build

    d = _indexed(store_dir, tmp_path, IndexConfig(factory="Flat"))
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))

    def answers():
        with QueryEngine(d, load_model=False) as e:
            res = e.search(q, k=6, method="ekfac", lowest=2)
            kinds = {li.factory for li in e.indices.layers.values()}
        return [([h.id for h in r.hits + r.lowest], [h.score for h in r.hits]) for r in res], kinds

    before, kinds = answers()
    assert kinds == {"Flat"}
    real, calls = index_build.index_vectors, {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(index_build, "index_vectors", dying)
    with pytest.raises(OSError, match="No space left"):
        build_indices(d, IndexConfig(factory="IVF4,Flat", train_size=40), progress=False, force=True)
    monkeypatch.setattr(index_build, "index_vectors", real)
    assert answers() == (before, {"Flat"})
    assert verify_index(str(d))["damaged"] == []  # the live files still match their recorded hashes

    real_replace = os.replace

    def power_cut(src, dst):  # between `faiss → faiss.old` and `faiss.new → faiss`
        if os.path.basename(src) == "faiss.new":
            raise OSError("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", power_cut)
    with pytest.raises(OSError, match="power cut"):
        build_indices(d, IndexConfig(factory="IVF4,Flat", train_size=40), progress=False, force=True)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (d / "faiss").exists() and (d / "faiss.old").exists()
    after, kinds = answers()  # the complete new set answers: nprobe visits all 4 lists, so exactly
    assert kinds == {"IVF4,Flat"} and [a[0] for a in after] == [b[0] for b in before]
    np.testing.assert_allclose([s for a in after for s in a[1]], [s for b in before for s in b[1]], rtol=1e-9)
    assert verify_index(str(d))["damaged"] == []
    again = build_indices(d, IndexConfig(factory="IVF4,Flat", train_size=40), progress=False)
    assert again.up_to_date and sorted(p.name for p in d.iterdir() if p.name.startswith("faiss")) == ["faiss"]
    report = verify_index(str(d))  # the swap's hashes moved to faiss/: every live file recorded and intact
    assert report["damaged"] == [] and report["unrecorded"] == []


@pytest.mark.parametrize("method", ["graddot", "cosine", "ekfac-selfnorm"])
def test_scores_of_every_example_equal_brute_force_and_the_ranked_hits(engine, method):
    s = engine.scores(QUERIES, method=method)
    assert s.shape == (3, 40) and s.dtype == np.float64
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    if method in ("graddot", "cosine"):
        np.testing.assert_allclose(s, _brute(engine.dir, q, method), rtol=1e-9, atol=1e-12)
    else:  # checked against dense H^-1 products in tests/test_scores.py
        np.testing.assert_allclose(s, score_matrix(engine.dir, q, method=method), rtol=1e-12)
    np.testing.assert_array_equal(engine.scores(q, method=method), s)  # gradients given directly
    _check_exact(engine.query_batch(QUERIES, k=40, method=method), s, 40)
    mlp = [n for n in engine.layer_names if ".mlp." in n]
    np.testing.assert_allclose(engine.scores(QUERIES, method=method, layers="*.mlp.*"),
                               score_matrix(engine.dir, q, method=method, layers=mlp), rtol=1e-12)


def test_exact_scores_need_no_faiss_indices(store_dir, tmp_path, engine):
    """An index whose FAISS indices were never built (or whose first build did not finish) answers exact
    scores; only a search asks for the indices, naming the command that builds them."""
    d = tmp_path / "index"
    shutil.copytree(store_dir, d)
    shutil.rmtree(d / "faiss", ignore_errors=True)
    q, _, _ = engine.gradients(engine.tokenize(QUERIES))
    mlp = [n for n in engine.layer_names if ".mlp." in n]
    with QueryEngine(d, model=engine.model, tokenizer=engine.tokenizer, layers="*.mlp.*") as e:
        assert e.layers == mlp
        np.testing.assert_allclose(e.scores(QUERIES, method="ekfac"), score_matrix(d, q, "ekfac", layers=mlp),
                                   rtol=1e-12)
        with pytest.raises(FileNotFoundError, match=r"no FAISS indices.*searching needs them.*`gradindex index"):
            e.query(QUERIES[0])
    (d / "faiss.new").mkdir()  # a first index build that was killed
    with QueryEngine(d, load_model=False) as e:
        np.testing.assert_allclose(e.scores(q, method="kfac-selfnorm"), score_matrix(d, q, "kfac-selfnorm"),
                                   rtol=1e-12)
        with pytest.raises(ValueError, match="did not finish; resume it with `gradindex index"):
            e.search(q)


def test_token_id_queries_need_no_tokenizer(engine):
    """The pad id comes from the model config (pad, else eos token) when no tokenizer is given."""
    ids = engine.tokenizer("the cat sat on a mat", add_special_tokens=False)["input_ids"]
    short = engine.tokenizer("red sun", add_special_tokens=False)["input_ids"]
    with QueryEngine(engine.dir, model=engine.model) as e:
        assert e.tokenizer is None and e.pad_id == engine.model.config.eos_token_id
        got = e.query_batch([ids, short], k=5, texts=False)
        with pytest.raises(ValueError, match="no tokenizer; pass tokenizer=, or give token ids"):
            e.query("the cat sat on a mat")
    want = engine.query_batch([ids, short], k=5)
    for a, b in zip(got, want, strict=True):
        assert [h.id for h in a.hits] == [h.id for h in b.hits]
        np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-6)


def test_pretokenized_data_builds_without_a_tokenizer(store_dir, tmp_path, gpt2_dir, text_jsonl):
    """The pad id comes from the model config: the store equals the one built with the tokenizer."""
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 512)
    cfg = BuildConfig.raw(projection=ProjectionSpec(k_a=4, k_g=4, seed=1), shard_size=16, precondition="ekfac")
    out = tmp_path / "notok"
    build_index(model, None, data, out, cfg, IndexConfig(), model_id=str(gpt2_dir), data_id=str(text_jsonl),
                progress=False)
    with Store(out) as a, Store(store_dir) as b:
        got, want = a.read_rows(np.arange(40)), b.read_rows(np.arange(40))
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])
