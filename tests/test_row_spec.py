"""Row specs (gradindex.spec.rows): parse, canonical string, refusals, bytes, and the build's spec.

Each test can fail: a grammar change breaks the round trips, a refusal that moves out of the parser
or changes its words fails its ``match``, a default that drifts from the documented spec fails the
last tests, and the byte counts are compared with the store's own code widths.
"""

from __future__ import annotations

import json

import pytest

from gradindex.spec.rows import CODE_BITS, DEFAULT_SPEC, SCALED, RowSpec

CANONICAL = ["auto,EKFAC@0.001,int4", "P16,fp32", "P16x8,fp32", "none,int8", "auto:1/64,EIGEN@0.001,int4",
             "auto:65536:equal,KFAC@0.3,fp16", "P8x6,ADAM:factored,fp32", "P8,ADAM,int8",
             "auto:1/8:spectrum,KFAC@1,int8", "none,EKFAC@0.1,fp16"]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_specs_round_trip(text):
    spec = RowSpec.parse(text)
    assert str(spec) == text and RowSpec.parse(str(spec)) == spec
    assert spec.describe().endswith(f"stored as {spec.storage}" + (" with a float32 scale per row and layer"
                                                                    if spec.storage in SCALED else ""))


def test_other_spellings_parse_to_the_canonical_form():
    assert str(RowSpec.parse("P16x16,fp32")) == "P16,fp32"
    assert str(RowSpec.parse(" auto , EKFAC , int4 ")) == "auto,EKFAC@0.001,int4"  # damping left out: default
    assert str(RowSpec.parse("auto,EKFAC", damping=0.01)) == "auto,EKFAC@0.01,int4"  # code left out: int4
    assert str(RowSpec.parse("P16")) == "P16,int8" and str(RowSpec.parse("auto,EKFAC@1e-3,int4")) == DEFAULT_SPEC
    assert str(RowSpec.parse("auto:auto:cost,int8")) == "auto,int8"  # (cost: the default allocation)
    assert str(RowSpec.parse("auto:auto:ratio,int8")) == "auto:auto:ratio,int8"
    p = RowSpec.parse("P32x4,fp16")
    assert (p.projection, p.k_a, p.k_g, p.storage, p.transcode) == ("fixed", 32, 4, "fp16", False)


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("int4,P16", "is not a projection"),
    ("P16,int3", "'int3' is not understood"),
    ("P16,fp32,EKFAC@0.001", "comes too late or twice"),
    ("P16,fp32,int8", "comes too late or twice"),
    ("P16,EKFAC@-1,int4", "damping must be a positive number"),
    ("P16,EKFAC@x,int4", "damping must be a positive number"),
    ("auto:banana,int4", "budget 'banana' is not understood"),
    ("P16,EIGEN@0.001,int4", "chooses what to store from --budget"),
    ("auto,EIGEN@0.001,EKFAC@0.001,int4", "answer --method ekfac as they are"),
    ("auto:1/8:spectrum,int8", "allocation by spectrum needs the full-space factors"),
    ("P16,KFAC@1,EKFAC@0.001,int4", "--transcode ekfac rotates raw rows"),
    ("auto,KFAC@1,ADAM,fp32", "the kfac basis whitens plain gradients"),
    ("P16,ADAM,EKFAC@0.001,int4", "K-FAC/EK-FAC are fitted on plain gradients"),
    ("P0x4,fp32", "projection sizes must be positive"),
])
def test_the_parser_refuses_what_cannot_be_built(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        RowSpec.parse(text)


def test_fit_and_index_refusals_live_with_the_spec():
    with pytest.raises(ValueError, match="after an EK-FAC fit"):
        RowSpec.parse(DEFAULT_SPEC).check_fit("kfac")
    with pytest.raises(ValueError, match="answer --method ekfac as they are"):
        RowSpec.parse("auto,EIGEN@0.001,int4").check_fit("none", full_factors=True)
    with pytest.raises(ValueError, match="fitted on plain gradients"):
        RowSpec.parse("P8,ADAM,fp32").check_fit("ekfac")
    with pytest.raises(ValueError, match="already whitened"):
        RowSpec.parse(DEFAULT_SPEC).check_whiten("ekfac", "ekfac")
    with pytest.raises(ValueError, match="needs that preconditioner"):
        RowSpec.parse("P16,fp32").check_whiten("kfac", "none")
    RowSpec.parse("P16,fp32").check_whiten("kfac", "ekfac")  # (ekfac writes kfac too)


def test_bytes_per_example_are_the_store_codes():
    from gradindex.store.codes import STORAGES, code_dtype, row_bytes

    assert tuple(CODE_BITS) == STORAGES
    assert {s: code_dtype(s).itemsize * 8 // (2 if s == "int4" else 1) for s in STORAGES} == CODE_BITS
    shapes = {"a": (65, 32), "b": (32, 96), "c": (7, 3)}
    for code in STORAGES:
        fixed = RowSpec.parse(f"P5x3,{code}")
        assert fixed.bytes_per_example(shapes) == sum(row_bytes(code, 15) for _ in shapes)
        exact = RowSpec.parse(f"none,{code}")
        assert exact.bytes_per_example(shapes) == sum(row_bytes(code, i * o) for i, o in shapes.values())
        assert exact.numbers(shapes) == 65 * 32 + 32 * 96 + 21 and fixed.numbers(shapes) == 45
    full = 4 * (65 * 32 + 32 * 96 + 21)
    assert RowSpec.parse("auto:1/8,int8").bytes_per_example(shapes) == full // 8
    assert RowSpec.parse("auto:1000,int8").bytes_per_example(shapes) == 1000


def test_every_build_config_has_a_spec_that_rebuilds_it():
    from gradindex.capture import ProjectionSpec
    from gradindex.store.builder import BuildConfig

    configs = [BuildConfig(), BuildConfig.raw(),
               BuildConfig.raw(projection=ProjectionSpec.parse("none"), storage="int8"),
               BuildConfig.raw(budget="1/8", basis="kfac", allocation="spectrum", basis_damping=0.3, storage="fp16"),
               BuildConfig(basis="eigen", budget="1/64", damping=0.01),
               BuildConfig.raw(projection=ProjectionSpec(k_a=8, k_g=6), optimizer_state="s.pt", adam_mode="factored"),
               BuildConfig(projection=ProjectionSpec(k_a=8, k_g=8), storage="int8", damping=0.1)]
    for cfg in configs:
        text = str(cfg.rows)
        again = BuildConfig(text, **{k: getattr(cfg, k) for k in ("layers", "optimizer_state", "precondition",
                                                                   "projection_kind", "seed")})
        assert again.rows == cfg.rows and str(again.rows) == text, text
    assert str(BuildConfig().rows) == DEFAULT_SPEC
    assert str(BuildConfig(projection=ProjectionSpec(k_a=8, k_g=8), storage="int8", damping=0.1).rows) == \
        "P8,EKFAC@0.1,int8"
    with pytest.raises(ValueError, match="ADAM rows are made from --optimizer-state"):
        BuildConfig("P8,ADAM,fp32")


def test_the_default_build_records_the_documented_spec(default_index):
    """A default build's manifest records ``auto,EKFAC@0.001,int4`` once, ``info`` prints it, the docs name
    it, and the spec read back from an index that predates specs (no ``rows`` key) is the same."""
    from pathlib import Path

    from click.testing import CliRunner

    from gradindex.cli import main
    from gradindex.spec.manifest import read_manifest, rows_of

    m = read_manifest(default_index)
    old = {**{k: v for k, v in m.items() if k != "rows"},  # (as builds before specs recorded it)
           "config": {**m["config"], "budget": "auto", "allocation": "cost", "storage": "int4", "transcode": "ekfac"}}
    assert m["rows"] == DEFAULT_SPEC == str(rows_of(old))
    assert json.dumps(m).count(DEFAULT_SPEC) == 1
    out = CliRunner().invoke(main, ["info", str(default_index)])
    assert out.exit_code == 0 and f"rows       {DEFAULT_SPEC}: per-layer projections" in out.output, out.output
    root = Path(__file__).resolve().parents[1]
    assert f"`{DEFAULT_SPEC}`" in (root / "docs" / "formats.md").read_text()
    assert f"`{DEFAULT_SPEC}`" in (root / "README.md").read_text()


def test_build_rows_option_is_the_options_it_replaces(tmp_path, gpt2_dir, text_jsonl):
    """``--rows P8x6,fp32`` builds the bytes ``--projection 8x6 --storage fp32 --transcode none`` does;
    ``--rows`` with one of those options is refused before any work."""
    from click.testing import CliRunner

    from gradindex.cli import main
    from gradindex.spec.manifest import read_manifest

    base = ["build", str(gpt2_dir), str(text_jsonl), "--quiet", "--device", "cpu", "--no-index",
            "--precondition", "none", "--max-length", "32"]
    a = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "a"), "--rows", "P8x6,fp32"])
    b = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "b"), "--projection", "8x6", "--storage", "fp32",
                                  "--transcode", "none"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output

    def files(d):
        return {n: e["blake2b"] for n, e in json.loads((d / "checksums.json").read_text())["files"].items()}

    assert files(tmp_path / "a") == files(tmp_path / "b") and read_manifest(tmp_path / "a")["rows"] == "P8x6,fp32"
    bad = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "c"), "--rows", "P8,fp32", "--storage", "int8"])
    assert bad.exit_code != 0 and "--rows P8,fp32 says what a row holds, and so do --storage" in bad.output
    assert not (tmp_path / "c").exists()
