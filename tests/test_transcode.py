"""The default build: rows transcoded in place into the EK-FAC whitened eigenbasis (int4), resumable."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.capture import ProjectionSpec
from gradindex.checksum import read_checksums
from gradindex.cli import main
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, default_factory
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.precondition import compact
from gradindex.precondition.compact import JOURNAL, STAGING, compact_eigenbasis, transcode_in_place
from gradindex.query import QueryEngine
from gradindex.query.scores import score_matrix
from gradindex.spec.manifest import IndexMismatchError, read_manifest, row_basis
from gradindex.store import Store

RAW = BuildConfig(projection=ProjectionSpec(), budget="auto", storage="int4", precondition="ekfac",
                  shard_size=16, max_length=48, transcode="ekfac")


def _data(gpt2_dir, text_jsonl):
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    return model, tok, tokenize_records(load_records(text_jsonl), tok, 48)


def _rows(index_dir) -> dict[str, np.ndarray]:
    with Store(index_dir) as st:
        return {n: st.read_rows(np.arange(len(st)), [n])[n] for n in st.layers}


def _same_codes(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    """The default build's int4 rows against the two-step compact's: it codes the fit pass's float16 copy of
    the rotated rows (precondition/rotated.py), so a number on a rounding boundary of its code may land one
    step off, nothing more, and almost all are equal."""
    for n in ref:
        step = np.abs(ref[n]).max(1, keepdims=True) / 7
        assert (np.abs(got[n] - ref[n]) <= 1.01 * step + 1e-7).all(), n
        assert np.isclose(got[n], ref[n], rtol=1e-3, atol=1e-7).mean() > 0.99, n


@pytest.fixture(scope="module")
def built(gpt2_dir, text_jsonl, tmp_path_factory):
    """The default index, and the two-step reference: a raw float16 build compacted into int4."""
    model, tok, data = _data(gpt2_dir, text_jsonl)
    d = tmp_path_factory.mktemp("transcode")
    res, _ = build_index(model, tok, data, d / "idx", RAW, index=IndexConfig(), progress=False)
    raw = dataclasses.replace(RAW, storage="fp16", transcode="none", budget=0, projection=ProjectionSpec.parse("none"))
    build_index(model, tok, data, d / "raw", raw, index=IndexConfig(), progress=False)
    compact_eigenbasis(d / "raw", d / "ref", damping=RAW.damping, storage="int4")
    return model, tok, data, d, res


def test_default_build_equals_the_two_step_compact(built):
    model, tok, data, d, res = built
    m = read_manifest(d / "idx")
    assert row_basis(m) == "ekfac" and m["build"]["storage"] == "int4" and m["status"] == "complete"
    assert m["transcode"]["source_build"]["storage"] == "fp16"
    assert res.manifest["build"] == m["build"]
    assert not (d / "idx" / STAGING).exists() and not (d / "idx" / JOURNAL).exists()
    assert not (d / "idx" / "raw.old").exists() and not (d / "idx" / "precond" / "graddot.h5").exists()
    assert sorted(m["preconditioners"]) == ["ekfac", "kfac"]  # kept for explanations
    # every layer stored whole: the auto budget (1/8 of float32) buys all numbers at int4
    assert all(v["rows"] == v["n_out"] and v["cols"] == v["n_in"] + v["bias"] for v in m["build"]["layers"].values())
    _same_codes(_rows(d / "idx"), _rows(d / "ref"))
    files = read_checksums(d / "idx")
    assert all(n.startswith(("store/", "basis.h5", "precond/", "faiss/")) for n in files)
    assert not any(n == "precond/graddot.h5" for n in files)
    res = CliRunner().invoke(main, ["verify", str(d / "idx")])
    assert res.exit_code == 0, res.output


def test_default_index_keeps_full_space_ekfac_ranking(built):
    """The CI-sized regression check of the default's quality: against exhaustive EK-FAC on the whole
    (float16) gradient, the default index's scores rank the training set alike and share the top."""
    model, tok, data, d, _ = built
    qs = [data.input_ids[i] for i in range(0, 40, 5)]
    with QueryEngine(d / "idx", model=model, tokenizer=tok) as e:
        q, _, _ = e.gradients(e.tokenize(qs))
        got = score_matrix(d / "idx", q, "ekfac", device="cpu")
        hits = e.search(q, k=5, method="ekfac", texts=False)
        assert [h.id for h in hits[0].hits] == list(np.argsort(-got[0], kind="stable")[:5])
    with QueryEngine(d / "raw", model=model, tokenizer=tok) as e:
        qr, _, _ = e.gradients(e.tokenize(qs))
    ref = score_matrix(d / "raw", qr, "ekfac", damping=RAW.damping, device="cpu")
    rho = [np.corrcoef(_ranks(got[i]), _ranks(ref[i]))[0, 1] for i in range(len(qs))]
    top = [len(set(np.argsort(-got[i])[:5]) & set(np.argsort(-ref[i])[:5])) / 5 for i in range(len(qs))]
    print(f"default vs full-space EK-FAC: Spearman {np.mean(rho):.3f} (min {min(rho):.3f}), top-5 {np.mean(top):.2f}")
    assert np.mean(rho) >= 0.97 and min(rho) >= 0.9 and np.mean(top) >= 0.8


def _ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def test_rerun_is_done_and_another_build_is_refused(built):
    model, tok, data, d, _ = built
    res, _ = build_index(model, tok, data, d / "idx", RAW, progress=False)
    assert res.examples_computed == 0 and row_basis(res.manifest) == "ekfac"
    for other, words in ((dataclasses.replace(RAW, transcode="none", storage="fp16"), "raw rows"),
                         (dataclasses.replace(RAW, storage="int8"), "row transcode")):
        with pytest.raises(IndexMismatchError, match=words):
            build_index(model, tok, data, d / "idx", other, progress=False)


@pytest.mark.parametrize("crash_at", [1, 2, 4, 7, 8, 9, 10, 11, 12])
def test_a_kill_during_the_swap_resumes_to_the_same_rows(built, tmp_path, monkeypatch, crash_at):
    model, tok, data, d, _ = built
    whole = dataclasses.replace(RAW, budget=0, projection=ProjectionSpec.parse("none"))  # as d / "raw" was built
    work = tmp_path / "idx"
    shutil.copytree(d / "raw", work)
    m = read_manifest(work)  # the raw build, as the default build leaves it before the transcode
    m["build"]["transcode"] = {"basis": "ekfac", "storage": "int4", "damping": RAW.damping}
    (work / "manifest.json").write_text(json.dumps(m))
    calls = {"n": 0}
    real = compact.os.replace

    def dying(a, b):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise KeyboardInterrupt("killed")
        return real(a, b)

    monkeypatch.setattr(compact.os, "replace", dying)
    with pytest.raises(KeyboardInterrupt):
        transcode_in_place(work, RAW.damping, "int4")
    monkeypatch.setattr(compact.os, "replace", real)
    assert (work / "manifest.json").exists()
    build_index(model, tok, data, work, whole, progress=False)  # the re-run finishes the swap
    assert row_basis(read_manifest(work)) == "ekfac"
    _same_codes(_rows(work), _rows(d / "ref"))  # (a kill before the swap: the re-run is the fused build's)
    assert not (work / JOURNAL).exists() and not (work / STAGING).exists()


def test_default_cli_build_then_every_command_on_it(gpt2_dir, text_jsonl, tmp_path):
    out = str(tmp_path / "idx")
    r = CliRunner()
    res = r.invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", out, "--max-length", "48", "--quiet",
                          "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "ekfac eigenbasis, int4" in res.output
    m = read_manifest(out)
    assert row_basis(m) == "ekfac" and m["build"]["storage"] == "int4"
    assert {e["factory"] for e in json.loads((tmp_path / "idx" / "faiss" / "index.json").read_text())["layers"]
            .values()} == {"store"}
    res = r.invoke(main, ["query", out, "--text", "the cat sat on a mat", "-k", "3", "--json", "--device", "cpu",
                          "--method", "ekfac"])  # (explain's method below: its scores' scale)
    assert res.exit_code == 0, res.output
    first = json.loads(res.output.splitlines()[0])
    assert len(first) == 3 and [h["rank"] for h in first] == [1, 2, 3]
    res = r.invoke(main, ["query", out, "--text", "the cat sat on a mat", "--device", "cpu"])  # (ekfac-selfnorm)
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["outliers", out, "--top", "3", "--json"])
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["dedup", out, "--out", str(tmp_path / "g.jsonl"), "--quiet"])
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["dedup", out, "--out", str(tmp_path / "g.jsonl"), "--quiet", "--method", "graddot"])
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["explain", out, "--query", "the cat sat on a mat", "--id", "2", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    ex = json.loads(res.output.splitlines()[0])
    assert ex["method"] == "ekfac"
    # the per-token terms add up to the score of the example's recomputed (unquantized) row: close to the
    # int4-coded score, within a few percent of the query's top score (int4 noise is absolute, not relative)
    assert sum(ex["train"]["scores"]) == pytest.approx(ex["score"], abs=0.05 * abs(first[0]["score"]))
    res = r.invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", out, "--max-length", "48", "--quiet",
                          "--device", "cpu", "--transcode", "none"])
    assert res.exit_code == 2 and "raw rows" in res.output, res.output


def test_explanations_on_eigenbasis_rows_sum_to_the_score(built, tmp_path):
    """Stored exactly (float32 in the eigenbasis), per-token terms add up to the example's score."""
    from gradindex.apps.explain import Explainer

    model, tok, data, d, _ = built
    cfg = dataclasses.replace(RAW, storage="fp32")  # the rows bake in RAW.damping; queries ask for 0.05
    build_index(model, tok, data, tmp_path / "f32", cfg, index=IndexConfig(), progress=False)
    with QueryEngine(tmp_path / "f32", model=model, tokenizer=tok, data=None) as e:
        e.texts.tokens = lambda ids: ([data.input_ids[i] for i in ids], [data.labels[i] for i in ids],
                                      np.ones(len(ids), bool))
        out = Explainer(e).explain("the cat sat on a mat", [0, 5], "ekfac", damping=0.05)
        q, _, _ = e.gradients(e.tokenize(["the cat sat on a mat"]))
        scores = score_matrix(tmp_path / "f32", q, "ekfac", device="cpu")[0]
        found = e.query("the cat sat on a mat", k=2, method="ekfac", damping=0.05, texts=False)
    assert found.damping == RAW.damping != 0.05  # what the scores used, on both paths
    assert any("bake in damping" in n and "no effect" in n for n in found.notes)  # and the user is told
    assert [x.damping for x in out] == [RAW.damping] * 2
    for x in out:
        assert x.score == pytest.approx(scores[x.id], rel=1e-4)
        # the token terms come from the exact gradient, the stored rows from the float16 capture stage, whose
        # rounding the small default damping amplifies along the least-curved directions
        assert sum(x.train.scores) == pytest.approx(x.score, rel=3e-3)
        assert sum(x.query.scores) == pytest.approx(x.score, rel=3e-3)


def test_exhaustive_factory_follows_the_row_codes():
    assert default_factory(40, 16) == "Flat"
    assert [default_factory(40, 16, s) for s in ("fp16", "int8", "int4")] == ["SQfp16", "SQ8", "SQ4"]
    assert default_factory(1_000_000, 256, "int4") == "IVF1024,PQ128x4fs"


def test_damping_used_is_the_querys_or_the_one_the_rows_bake_in():
    """What a result reports: the query's damping where curvature is applied to the rows, the rows' own
    where they are whitened and the method is their plain inner product, none where no curvature enters."""
    from gradindex.store.basis import RowBasis

    raw, kfac, eig = RowBasis(), RowBasis("kfac", 1.0), RowBasis("ekfac", 0.3)
    assert [raw.damping_used(m, 0.05) for m in ("graddot", "cosine", "adam", "kfac", "ekfac")] == \
        [None, None, None, 0.05, 0.05]
    assert [kfac.damping_used(m, 0.05) for m in ("kfac", "ekfac")] == [1.0, 0.05]
    assert eig.damping_used("ekfac", 0.05) == 0.3
    with pytest.raises(ValueError, match="does not apply to this index"):
        eig.damping_used("graddot", 0.05)



def _unit(index_dir, method: str) -> tuple[np.ndarray, str]:
    """Every row's unit vector as dedup compares them under ``method``, and the operation on the rows."""
    from gradindex.apps.dedup import DedupConfig, _space, _unit_rows
    from gradindex.store.opened import OpenStore

    with OpenStore(index_dir) as ix:  # (dedup's _space takes an open store since 3679b3c)
        layers, base, pre = _space(ix, DedupConfig(method=method), None)
    return _unit_rows(_rows(index_dir), layers, pre, base, 0.0).astype(np.float64), base


def test_graddot_dedup_on_eigenbasis_rows_is_the_raw_gradient_cosine(built, tmp_path):
    """Un-whitened by the basis's column scale ``√(Λ* + δ)``, eigenbasis rows are an orthogonal rotation of the
    raw gradients: the same cosines, checked by brute force over the raw build's rows (exactly on float32
    eigenbasis rows; on the default int4 rows up to their noise, which un-whitening amplifies)."""
    from gradindex.apps.dedup import DedupConfig, find_duplicates

    _, _, _, d, _ = built
    raw = _rows(d / "raw")
    v = np.concatenate([raw[n].astype(np.float64) for n in sorted(raw)], 1)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    want = v @ v.T
    iu = np.triu_indices(len(v), 1)
    compact_eigenbasis(d / "raw", tmp_path / "fp32", damping=RAW.damping, storage="fp32")
    u, base = _unit(tmp_path / "fp32", "graddot")
    assert base == "unwhiten"
    assert np.abs((u @ u.T)[iu] - want[iu]).max() < 1e-4
    w, _ = _unit(tmp_path / "fp32", "ekfac")  # the whitened cosines are another geometry
    assert np.abs((w @ w.T)[iu] - want[iu]).max() > 0.1
    u4, _ = _unit(d / "idx", "graddot")
    err = np.abs((u4 @ u4.T)[iu] - want[iu])
    assert err.mean() < 0.03 and err.max() < 0.15, (err.mean(), err.max())
    # groups: the raw cosines' components, at a threshold in the widest gap among the top pair cosines
    c = np.sort(want[iu])[::-1][:12]
    k = int(np.argmax(c[:-1] - c[1:]))
    thr = float(c[k] + c[k + 1]) / 2
    assert c[k] - c[k + 1] > 1e-3  # float32 rows: cosines within 1e-4
    comps: dict[int, set[int]] = {}
    for i, j in zip(*np.nonzero(np.triu(want >= thr, 1)), strict=True):
        s = comps.get(int(i), {int(i)}) | comps.get(int(j), {int(j)})
        for m in s:
            comps[m] = s
    res = find_duplicates(tmp_path / "fp32", DedupConfig(method="graddot", threshold=thr, neighbors=len(v), sketch=0))
    assert comps and [g.ids for g in res.groups] == sorted(list(t) for t in {tuple(sorted(s)) for s in comps.values()})
    assert all(g.kind == "near" for g in res.groups)


def test_a_kill_during_the_transcode_names_the_build_command_and_index_refuses(gpt2_dir, text_jsonl, tmp_path,
                                                                              monkeypatch):
    """Issue 21, item 7: the query said "build them with `gradindex index`", which indexes the raw rows."""
    from gradindex.precondition import fused

    out = tmp_path / "idx"
    r = CliRunner()
    args = ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--max-length", "48", "--quiet",
            "--device", "cpu", "--shard-size", "16", "--projection", "4"]

    def killed(*a, **kw):
        raise KeyboardInterrupt("killed during the transcode")

    monkeypatch.setattr(fused, "compact_rows", killed)  # (the default build fuses the fit with the transcode)
    assert r.invoke(main, args).exit_code == 130
    monkeypatch.undo()
    m = read_manifest(out)
    assert m["status"] == "complete" and row_basis(m) == "raw"  # the capture and the fit's store pass are done
    res = r.invoke(main, ["query", str(out), "--text", "the cat sat on a mat", "--device", "cpu"])
    assert res.exit_code == 2 and "stopped before its transcode" in res.output, res.output
    named = res.output.split("build command `", 1)[1].split("`", 1)[0]
    assert named.startswith(f"gradindex build {gpt2_dir.resolve()} ") and "--no-index" not in named
    assert "gradindex index" not in res.output.split("then", 1)[0]
    res = r.invoke(main, ["index", str(out), "--quiet"])
    assert res.exit_code == 2 and "stopped before its transcode" in res.output, res.output
    assert not (out / "faiss").exists()
    assert "transcode unfinished" in r.invoke(main, ["info", str(out)]).output
    res = r.invoke(main, shlex.split(named)[1:] + ["--quiet"])  # the command the error names finishes the build
    assert res.exit_code == 0, res.output
    m = read_manifest(out)
    assert row_basis(m) == "ekfac" and m["build"]["storage"] == "int4"
    res = r.invoke(main, ["query", str(out), "--text", "the cat sat on a mat", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output


def test_to_rows_matches_float64_rotation_and_follows_a_replaced_map():
    """The query's rows in an ``ekfac`` basis: ``(Q_Sᵀ X Q_A) ⊙ scale`` to float32 rounding, with the float32
    maps cached per layer (``RowBasis.rotation``) yet never stale when a layer's map is replaced."""
    from gradindex.store.basis import RowBasis, to_rows

    rng = np.random.default_rng(0)
    k_g, k_a = 3, 4
    Q_S, _ = np.linalg.qr(rng.standard_normal((k_g, k_g)))
    Q_A, _ = np.linalg.qr(rng.standard_normal((k_a, k_a)))
    scale = rng.uniform(0.5, 2.0, (k_g, k_a))
    b = RowBasis(kind="ekfac", Q_S={"l": Q_S}, Q_A={"l": Q_A}, scale={"l": scale})
    x = rng.standard_normal((5, k_g * k_a))

    def reference() -> np.ndarray:
        X = x.reshape(-1, k_g, k_a)
        return ((b.Q_S["l"].T @ X @ b.Q_A["l"]) * b.scale["l"]).reshape(len(x), -1)

    np.testing.assert_allclose(to_rows(b, "l", x, (k_g, k_a)), reference(), rtol=1e-5, atol=1e-6)
    assert to_rows(b, "l", x, (k_g, k_a)) is not None and b.rotation("l")[0] is b.rotation("l")[0]  # cached
    b.scale["l"] = 2 * scale  # a replaced map is converted again
    np.testing.assert_allclose(to_rows(b, "l", x, (k_g, k_a)), reference(), rtol=1e-5, atol=1e-6)
