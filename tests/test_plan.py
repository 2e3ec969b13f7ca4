"""``gradindex plan``: before any capture, what the build will store, and its disk, memory, time and lookup."""

from __future__ import annotations

import json

from click.testing import CliRunner

from gradindex.cli import main
from gradindex.spec.manifest import read_manifest

OPTS = ["--max-length", "48", "--device", "cpu", "--shard-size", "16"]


def _bytes(d) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_plan_sizes_what_the_build_then_stores(gpt2_dir, text_jsonl, tmp_path):
    r = CliRunner()
    res = r.invoke(main, ["plan", str(gpt2_dir), str(text_jsonl), "--json", *OPTS])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output.strip().splitlines()[-1])
    assert not any(tmp_path.iterdir())  # nothing written
    assert set(plan["seconds"]) == {"capture", "fit", "transcode"} and all(v > 0 for v in plan["seconds"].values())
    text = r.invoke(main, ["plan", str(gpt2_dir), str(text_jsonl), "--batches", "0", *OPTS])
    assert text.exit_code == 0, text.output
    summary = text.output.strip().splitlines()[-1]
    assert summary.startswith("plan: 40 examples x 8 layers") and "at peak" in summary and "lookup" in summary
    out = tmp_path / "idx"
    built = r.invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--quiet", *OPTS])
    assert built.exit_code == 0, built.output
    assert summary in built.output  # build prints the same line before it starts
    m = read_manifest(out)
    layers = {x["name"]: (x["k_g"], x["k_a"]) for x in plan["layers"]}
    assert layers == {n: (v["rows"], v["cols"]) for n, v in m["build"]["layers"].items()}
    b = plan["bytes"]
    store = _bytes(out / "store")
    assert 0.9 * store <= b["store"] <= 1.1 * store, (b["store"], store)
    fits = _bytes(out / "precond") + (out / "basis.h5").stat().st_size
    assert 0.8 * fits <= b["precond"] + b["basis"] <= 1.2 * fits, (b, fits)
    final = _bytes(out)
    assert 0.85 * final <= b["final"] <= 1.15 * final, (b["final"], final)
    kind = {e["factory"] for e in json.loads((out / "faiss" / "index.json").read_text())["layers"].values()}
    look = plan["lookup"]  # the lookup cost of the kind the build then chose (gradindex.index.cost)
    assert kind == {look["kind"]} == {"store"} and 0 < look["scanned_bytes"] <= b["store"] and look["seconds"] > 0
    assert b["index"] == look["index_bytes"] <= _bytes(out / "faiss")  # norms only: no copy of the rows
    assert b["peak"] >= b["capture"] + b["store"]  # the captured float16 rows beside their int4 copy
    assert b["peak"] >= b["capture"] + b["rotated"] > b["capture"]  # ... and beside their rotated float16 copy


def test_plan_of_a_budget_bound_build_counts_its_full_space_fit(gpt2_dir, text_jsonl, tmp_path):
    """Rows of 1/64 of the gradient with --rerank-fit: the build also fits full-space EK-FAC for the exact stage
    (its files, sums and correction pass over --rerank-correction examples, in the plan); by default it does not
    (issue 30: the default query is the first stage)."""
    r = CliRunner()
    opts = [*OPTS, "--budget", "1/64", "--rerank-correction", "16"]
    res = r.invoke(main, ["plan", str(gpt2_dir), str(text_jsonl), "--json", *opts])
    assert res.exit_code == 0, res.output
    default = json.loads(res.output.strip().splitlines()[-1])
    assert "full-space fit" not in default["seconds"]
    opts.append("--rerank-fit")
    res = r.invoke(main, ["plan", str(gpt2_dir), str(text_jsonl), "--json", *opts])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output.strip().splitlines()[-1])
    assert "full-space fit" in plan["seconds"] and plan["seconds"]["full-space fit"] > 0
    assert plan["bytes"]["precond"] > default["bytes"]["precond"] and plan["ram_bytes"] > default["ram_bytes"]
    out = tmp_path / "idx"
    built = r.invoke(main, ["build", str(gpt2_dir), str(text_jsonl), "--out", str(out), "--quiet", *opts])
    assert built.exit_code == 0, built.output
    assert read_manifest(out)["full_space"]["ekfac"]["fit"]["correction_examples"] == 16
    shown = r.invoke(main, ["info", str(out)])
    assert "full space ekfac: factors over 40 examples, its correction over 16" in shown.output, shown.output
    b = plan["bytes"]
    fits = _bytes(out / "precond") + (out / "basis.h5").stat().st_size
    assert 0.8 * fits <= b["precond"] + b["basis"] <= 1.2 * fits, (b, fits)
