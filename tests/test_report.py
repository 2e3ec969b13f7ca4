"""The audit report on a real tiny GPT-2 index: its numbers against the engine, outliers, dedup and a
brute-force score over every row; the HTML page in headless Chromium (no console errors, shows the
first query's top example; screenshot kept under the test's output)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fixtures.browser import find_chromium, load, visible_text
from gradindex.apps.dedup import DedupConfig, find_duplicates
from gradindex.apps.outliers import rank_outliers
from gradindex.apps.report import ReportConfig, build_report
from gradindex.cli import main
from gradindex.query import QueryEngine

QUERIES = [{"text": "the cat sat on a mat"}, {"prompt": "dog ran far", "completion": " away from home"},
           {"text": "green hills near old town river"}]


@pytest.fixture(scope="module")
def report(audit_index, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    with QueryEngine(audit_index, device="cpu") as engine:
        cfg = ReportConfig(k=4, method="kfac", outliers=5, dedup_threshold=0.9)
        summary = build_report(engine, QUERIES, out, cfg)
        direct = engine.query_batch(QUERIES, k=4, lowest=4, method="kfac")
    lines = [json.loads(s) for s in (out / "queries.jsonl").read_text().splitlines()]
    return out, summary, lines, direct


def test_report_numbers_match_the_engine_and_the_apps(report, audit_index):
    out, summary, lines, direct = report
    assert len(lines) == len(QUERIES)
    for q, r in zip(lines, direct, strict=True):
        assert [h["id"] for h in q["hits"]] == [h.id for h in r.hits]
        assert [h["id"] for h in q["lowest"]] == [h.id for h in r.lowest]
        for h, d in zip(q["hits"] + q["lowest"], r.hits + r.lowest, strict=True):
            assert h["score"] == pytest.approx(d.score, rel=1e-9)
            assert sum(h["token_scores"]) == pytest.approx(d.score, rel=1e-5)
            assert sum(h["query_token_scores"]) == pytest.approx(d.score, rel=1e-5)
            assert h["text"] == d.text and len(h["tokens"]) == len(h["token_scores"])
    # across queries: counts and |score| sums recomputed from the engine's results
    ref: dict[int, list] = {}
    for r in direct:
        for h in r.hits:
            ref.setdefault(h.id, [0, 0, 0.0])[0] += 1
            ref[h.id][2] += abs(h.score)
        for h in r.lowest:
            ref.setdefault(h.id, [0, 0, 0.0])[1] += 1
            ref[h.id][2] += abs(h.score)
    assert len(summary["overall"]) == len(ref)
    for a in summary["overall"]:
        assert [a["in_top"], a["in_lowest"]] == ref[a["id"]][:2]
        assert a["sum_abs_score"] == pytest.approx(ref[a["id"]][2])
    assert [a["sum_abs_score"] for a in summary["overall"]] == sorted(
        (a["sum_abs_score"] for a in summary["overall"]), reverse=True)
    # outliers and duplicate groups are the apps' own
    assert [o["id"] for o in summary["outliers"]] == [o["id"] for o in rank_outliers(audit_index, "kfac").top(5)]
    groups = find_duplicates(audit_index, DedupConfig(threshold=0.9, method="kfac")).groups
    assert [g["ids"] for g in summary["duplicate_groups"]] == [g.ids for g in groups]
    assert summary["score_sample"]["rows"] == 40  # every row: the sampled maxima are the top hits
    assert (out / "summary.json").exists()


def test_score_sample_is_a_brute_force_score_of_every_row(report, audit_index):
    """The distribution plot's scores: the top and bottom equal the engine's k best and worst."""
    from gradindex.apps.report import _score_sample

    _, _, _, direct = report
    with QueryEngine(audit_index, device="cpu") as engine:
        grads, _, _ = engine.gradients(engine.tokenize(QUERIES))
        layers = engine.select_layers(None)
        ids, s = _score_sample(engine, grads, ReportConfig(method="kfac"), layers)
    assert len(ids) == 40
    for j, r in enumerate(direct):
        np.testing.assert_allclose(np.sort(s[j])[::-1][:4], [h.score for h in r.hits], rtol=1e-6)
        np.testing.assert_allclose(np.sort(s[j])[:4], [h.score for h in r.lowest], rtol=1e-6)


def test_report_page_in_headless_chromium(report, tmp_path):
    chromium, why = find_chromium()
    if chromium is None:
        pytest.skip(f"no headless Chromium for the page test: {why}")
    out, _, lines, _ = report
    html = (out / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # nothing fetched from the network
    page = load(chromium, (out / "report.html").as_uri(), tmp_path, "audit-report")
    assert page.console == [], page.console
    text = visible_text(page.dom)
    top = "".join(lines[0]["hits"][0]["tokens"])
    assert top in text, "the first query's top example is not on the page"
    assert "Outliers by self-influence" in text and "Duplicate groups" in text
    assert page.dom.count("data:image/png;base64,") == 2
    assert page.screenshot.stat().st_size > 10_000
    print(f"screenshot: {page.screenshot}")


def test_cli_audit(audit_index, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in QUERIES))
    res = CliRunner().invoke(main, ["audit", str(audit_index), "--queries", str(q), "--out", str(tmp_path / "r"),
                                    "--k", "3", "--no-dedup", "--outliers", "3", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r" / "report.html").exists() and "report:" in res.output
    assert len((tmp_path / "r" / "queries.jsonl").read_text().splitlines()) == 3
    res = CliRunner().invoke(main, ["audit", str(audit_index), "--queries", str(q), "--out", str(tmp_path / "r"),
                                    "--k", "0"])
    assert res.exit_code != 0 and "Error: k and sample must be >= 1" in res.output


def test_score_sample_of_a_default_index_equals_its_true_scores(default_index):
    """Rows stored EK-FAC-whitened (the default build): the sample is the engine's exact scores, not
    the preconditioner applied a second time (issue 21, item 2: ~4,000x too large)."""
    from gradindex.apps.report import _score_sample

    with QueryEngine(default_index, device="cpu") as engine:
        grads, _, _ = engine.gradients(engine.tokenize(QUERIES))
        layers = engine.select_layers(None)
        ids, s = _score_sample(engine, grads, ReportConfig(method="ekfac"), layers)
        true = engine.scores(grads, method="ekfac")[:, ids]
        top = engine.query_batch(QUERIES, k=3, method="ekfac")
    np.testing.assert_allclose(s, true, rtol=1e-6, atol=1e-9 * np.abs(true).max())
    for j, r in enumerate(top):
        np.testing.assert_allclose(np.sort(s[j])[::-1][:3], [h.score for h in r.hits], rtol=1e-5)


def test_the_page_lists_as_harmful_only_the_examples_scored_below_zero(audit_index, tmp_path):
    """With k the index's size, the lowest list held examples scored above zero, shown as most harmful."""
    with QueryEngine(audit_index, device="cpu") as engine:
        n = engine.n
        build_report(engine, QUERIES[:1], tmp_path, ReportConfig(k=n, method="kfac", outliers=2, dedup_threshold=0.9))
    (q,) = [json.loads(s) for s in (tmp_path / "queries.jsonl").read_text().splitlines()]
    above = sum(h["score"] >= 0 for h in q["lowest"])
    below = sum(h["score"] <= 0 for h in q["hits"])
    assert len(q["lowest"]) == n and 0 < above < n and 0 < below < n  # (both lists: every example)
    page = (tmp_path / "report.html").read_text()
    helpful, harmful = page.split("Most helpful")[1].split("Most harmful")
    harmful = harmful.split("<h2>")[0]
    assert f"{above} of these {n} have a score of the other sign or zero (they help, or do nothing)" in harmful
    assert f"{below} of these {n} have a score of the other sign or zero (they do not help)" in helpful
    assert harmful.count("<tr>") - 1 == n - above and helpful.count("<tr>") - 1 == n - below
