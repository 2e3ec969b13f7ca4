"""The damping baked into whitened rows is named apart from a query's (issue 31 item 2, issue 32).

On a transcoded index the rows are ``(Q_Sᵀ G Q_A) ⊙ (Λ* + δ)^{-1/2}`` at the build's damping; a query's damping
cannot change them. ``info`` says so, and a query or ``scores()`` call asking for another damping is told, once.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.spec.manifest import baked_damping, read_manifest

LINE = "rows whitened at damping 0.001 (fixed at build; query --damping does not change them)"
TEXT = "the cat sat on a mat"


def test_info_names_the_damping_baked_into_the_rows(default_index, audit_index):
    out = CliRunner().invoke(main, ["info", str(default_index)])
    assert out.exit_code == 0 and LINE in out.output, out.output
    s = json.loads(CliRunner().invoke(main, ["info", str(default_index), "--json"]).output)
    assert s["baked_damping"] == 0.001
    raw = CliRunner().invoke(main, ["info", str(audit_index)])
    assert raw.exit_code == 0 and "rows whitened at damping" not in raw.output
    assert json.loads(CliRunner().invoke(main, ["info", str(audit_index), "--json"]).output)["baked_damping"] is None


@pytest.fixture(scope="module")
def engine(default_index, gpt2_dir):
    from gradindex.model import load_causal_lm
    from gradindex.query import QueryEngine

    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    with QueryEngine(default_index, model=model, tokenizer=tok) as e:
        yield e


def _baked(records) -> list[str]:
    return [r.getMessage() for r in records if "bake in damping" in r.getMessage()]


def test_scores_with_another_damping_logs_one_line(engine, caplog):
    with caplog.at_level(logging.INFO, logger="gradindex"):
        same = engine.scores([TEXT], method="ekfac", damping=0.001)
    assert _baked(caplog.records) == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gradindex"):
        other = engine.scores([TEXT], method="ekfac", damping=0.05)
    lines = _baked(caplog.records)
    assert len(lines) == 1 and "damping 0.001" in lines[0] and "0.05 has no effect" in lines[0], lines
    assert [r.levelno for r in caplog.records if "bake in damping" in r.getMessage()] == [logging.WARNING]
    np.testing.assert_array_equal(same, other)  # the rows' damping, whatever was asked


def test_a_query_with_another_damping_gets_one_note(engine):
    other = engine.query(TEXT, k=3, method="ekfac", damping=0.05, texts=False)
    assert len([n for n in other.notes if "bake in damping 0.001" in n]) == 1, other.notes
    assert other.damping == 0.001
    same = engine.query(TEXT, k=3, method="ekfac", damping=0.001, texts=False)
    assert not any("bake in damping" in n for n in same.notes)


def test_the_manifest_field_is_read_through_one_function(default_index, audit_index):
    from gradindex.spec.manifest import Manifest

    assert baked_damping(read_manifest(default_index)) == 0.001
    assert baked_damping(read_manifest(audit_index)) is None
    assert baked_damping({"build": {"basis": {"kind": "kfac"}}}) == 1.0
    assert Manifest(read_manifest(default_index)).baked_damping == 0.001
