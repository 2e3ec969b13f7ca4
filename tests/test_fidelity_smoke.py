"""Smoke test of benchmarks/fidelity.py: its ``--quick`` mode runs end to end and reports every cell."""

from __future__ import annotations

import json
import math

import numpy as np

from benchmarks import _study, common
from benchmarks import fidelity as fid


def test_spearman_matches_hand_computed_values_with_ties():
    x = np.array([[1.0, 2.0, 2.0, 3.0], [4.0, 3.0, 2.0, 1.0]])
    y = np.array([[1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    got = common.spearman_rows(x, y)
    # row 0: ranks x = [1, 2.5, 2.5, 4], y = [1, 3, 2, 4] → 4.5 / sqrt(4.5 · 5)
    assert np.allclose(got, [4.5 / math.sqrt(22.5), -1.0])


def test_quick_run_reports_every_method_projection_and_codec_and_reuses_the_cache(tmp_path):
    out = tmp_path / "fidelity.json"
    assert fid.main(["--quick", "--work-dir", str(tmp_path / "work"), "--out", str(out),
                     "--dampings", "0.01,0.1", "--study-dampings", "0.01,0.1"]) == 0
    res = json.loads(out.read_text())
    cfg = res["config"]
    k = cfg["top_k"]
    assert set(res["corpora"]) == set(cfg["corpora"])
    cor = res["corpora"]["stdlib"]
    extra = {"bm25", "repsim", "trackstar", "ekfac-refined"}  # scored once, in the unprojected column
    assert set(cor["lds"]) == set(cfg["methods"]) | extra
    for method, row in cor["lds"].items():
        assert set(row) == ({"none"} if method in extra else set(cfg["projections"])), method
        for cell in row.values():
            assert -1.0 <= cell["lds"] <= 1.0 and cell["seed_spread"] >= 0.0
            assert math.isfinite(cell["diff_vs_graddot"]) and cell["query_se"] >= 0.0
            assert 0.0 <= cell[f"top{k}_overlap"] <= 1.0 and 0.0 <= cell["fact_recall"] <= 1.0
            assert cell["bytes_per_example"] > 0
    # each cell's paired difference to GradDot is its LDS minus GradDot's at that projection, and its
    # share is its LDS over the reference's (fails when either compares with the wrong cell)
    ref = cor["lds"]["ekfac"]["none"]
    for method, row in cor["lds"].items():
        for p, cell in row.items():
            assert math.isclose(cell["diff_vs_graddot"], cell["lds"] - cor["lds"]["graddot"][p]["lds"],
                                abs_tol=1e-9), (method, p)
            assert math.isclose(cell["lds_share"], cell["lds"] / ref["lds"], rel_tol=1e-9), (method, p)
    assert cor["noise_ceiling"] is not None and cor["diagnostics_full_space"]
    assert len(cor["corpus"]["facts"]) == cfg["n_facts"]

    # the top-k overlap is with the reference's top-k: graddot's full-space ranking is another one
    assert ref[f"top{k}_overlap"] == 1.0 > cor["lds"]["graddot"]["none"][f"top{k}_overlap"]
    # the study's own full-space capture reproduces the library's full-space EK-FAC
    study = cor["study"]
    assert abs(study["reference"]["lds"] - ref["lds"]) < 0.02
    rows = {r["name"]: r for r in study["rows"]}
    assert rows["raw fp32"]["lds_share"] > 0.999 and rows["raw fp32"][f"top{k}_overlap"] == 1.0
    # int8 rows of the whole gradient keep the reference's quality; int4 in the whitened eigenbasis
    # is at 1/8 of the float32 bytes (plus one scale per row and layer)
    assert rows["raw int8"]["lds_share"] >= 0.9 and rows["raw int8"][f"top{k}_overlap"] >= 0.8
    assert 0.125 <= rows["eigen int4"]["bytes_fraction"] <= 0.126
    assert rows["eigen int4"]["lds_share"] >= 0.85
    for r in study["rows"]:
        assert r["bytes_per_example"] > 0 and -1.0 <= r["lds"] <= 1.0 and 0.0 <= r[f"top{k}_overlap"] <= 1.0

    # the study at another damping: its reference is the library's full-space EK-FAC at that damping, the
    # exact codec is the reference, and the default damping's entry is the top-level one
    by = study["by_damping"]
    assert set(by) == {"0.01", "0.1"} and by["0.1"]["rows"] == study["rows"]
    assert abs(by["0.01"]["reference"]["lds"] - cor["damping_sweep"]["ekfac"]["none"]["0.01"]) < 0.02
    assert by["0.1"]["reference"][f"top{k}_overlap_vs_default"] == 1.0
    low = {r["name"]: r for r in by["0.01"]["rows"]}
    assert low["raw fp32"]["lds_share"] > 0.999 and low["raw fp32"][f"top{k}_overlap"] == 1.0
    assert low["raw fp32"][f"top{k}_overlap_vs_default"] == by["0.01"]["reference"][f"top{k}_overlap_vs_default"]
    assert "| stdlib | 0.01 |" in _study.damping_markdown(res)

    # A second look at the retrained losses comes from the cache: nothing is retrained.
    q = fid.QUICK
    setup = fid.make_setup(q)
    logged: list[str] = []
    _, losses, _ = fid.retrained_losses(q, setup, {}, tmp_path / "work", 1, 1, log=logged.append)
    assert not logged and losses.shape == (q.n_subsets, q.retrain_seeds, q.n_query)
    assert np.isfinite(losses).all()


def test_troff_paragraphs_keep_running_text_and_drop_tags_code_and_skipped_sections():
    from fixtures.corpus import _troff_paragraphs

    src = "\n".join([
        '.\\" a comment', ".TH pipe 7", ".SH NAME", "pipe \\- overview of pipes", ".SH DESCRIPTION",
        "A pipe has a", ".I read end", "and a", '.IR "write end" .', "Data flows\\(emone way\\fB only\\fR.",
        ".PP", "See", ".BR pipe (2)", "for details.", ".TP", ".B O_NONBLOCK", "Never blocks.", ".EX",
        "int fd[2];", ".EE", "After the code.", ".SH SEE ALSO", ".BR fifo (7)"])
    assert _troff_paragraphs(src) == ["A pipe has a read end and a write end. Data flows—one way only.",
                                      "See pipe(2) for details.", "Never blocks.", "After the code."]
