"""Index tiers are one registry: a tier defined and registered in this test file alone (no library file touched) is
chosen by its factory string, built, opened, queried end to end through ``QueryEngine`` and ``gradindex query``, and
costed by the plan; its answers equal the store tier's."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.cli import main
from gradindex.index import IndexConfig, build_indices
from gradindex.index.cost import LookupCost
from gradindex.index.space import index_vectors
from gradindex.index.tiers import (
    TIERS,
    BuildJob,
    CandidateRequest,
    Candidates,
    RowShape,
    Tier,
    TierSource,
    make_tier,
    register_tier,
    tier_class,
    unregister_tier,
)
from gradindex.index.tiers.base import top_and_bottom, with_factors
from gradindex.query import QueryEngine
from gradindex.spec.manifest import index_args, read_manifest

ROWS = "brute.rows.npy"


class BruteTier(Tier):
    """``Brute{C}``: every example's index-space vectors, decoded from the store into one float32 file at build;
    a query scores them all and hands its top ``C`` (default 32) to the exact re-rank."""

    name = "brute"

    @classmethod
    def matches(cls, factory: str) -> bool:
        return re.fullmatch(r"brute(\d*)", factory.strip().lower()) is not None

    @property
    def c(self) -> int:
        digits = re.fullmatch(r"brute(\d*)", self.factory.strip().lower()).group(1)
        return int(digits or 32)

    def cost(self, rows: RowShape, candidates: int | None = None) -> LookupCost:
        held = 4 * rows.n * rows.numbers
        return LookupCost(self.name, rows.n * rows.numbers * 1e-9, held, held, held + self.c * rows.row_bytes)

    def build(self, job: BuildJob) -> int:
        super().build(job)  # each layer's entry: no file of its own
        parts = [index_vectors(job.cfg.space, job.pre, n, x, job.inv) for n, x in
                 job.store.read_rows(np.arange(job.n)).items()]
        np.save(job.out / ROWS, np.concatenate(parts, axis=1).astype(np.float32))
        job.meta["brute"] = {"file": ROWS, "bytes": (job.out / ROWS).stat().st_size}
        return job.n

    @classmethod
    def files(cls, meta: dict, layers: Sequence[str] | None = None) -> list[str]:
        return [meta["brute"]["file"]]

    @classmethod
    def written_bytes(cls, meta: dict) -> int:
        return int(meta["brute"]["bytes"])

    @classmethod
    def describe(cls, meta: dict) -> str:
        return "brute force over every decoded row"

    def open(self, source: TierSource) -> None:
        self.rows = np.load(source.folder / ROWS)
        dims = [source.meta["layers"][n]["dim"] for n in source.all_layers]
        starts = np.concatenate([[0], np.cumsum(dims)])
        self.cols = {n: slice(int(starts[i]), int(starts[i + 1])) for i, n in enumerate(source.all_layers)}

    def candidates(self, req: CandidateRequest) -> Candidates:
        s = sum(req.u[n].astype(np.float64) @ self.rows[:, self.cols[n]].T for n in req.layers)  # [Q, N]
        s = with_factors(self.source, s, req.layers, req.cosine, req.scale)
        c = max(self.c, req.k, req.lowest)
        return Candidates.of(top_and_bottom(s, c, c if req.lowest else 0, margin=0))


@pytest.fixture
def brute():
    cls = register_tier(BruteTier)
    yield cls
    unregister_tier(cls.name)
    assert "brute" not in TIERS


QUERIES = ["the cat sat on a mat", "dog ran far away from home", "blue sky with red sun over green hills"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "faiss", ignore_errors=True)
    return dst


def _answers(d, grads, **kw):
    with QueryEngine(d, device="cpu") as e:
        res = e.search(grads, texts=False, **kw)
        kind = e.indices.kind
    return kind, [([h.id for h in r.hits], [h.score for h in r.hits], [h.id for h in r.lowest]) for r in res]


def test_a_registered_tier_is_chosen_built_queried_and_refused_when_gone(brute, default_index, tmp_path):
    assert tier_class("Brute8") is brute and tier_class("store").name == "store" and tier_class("IVF4,Flat").name == \
        "faiss"
    rows = RowShape(10**6, 10**5, "int4")
    assert make_tier(IndexConfig(), rows, ram_bytes=16 << 30).name == "sketch"  # no auto_order: auto never picks it
    d, ref = _copy(default_index, tmp_path / "brute"), _copy(default_index, tmp_path / "store")
    res = build_indices(d, IndexConfig(factory="Brute8"), progress=False)
    assert res.meta["kind"] == "brute" and {e["factory"] for e in res.meta["layers"].values()} == {"brute8"}
    assert sorted(p.name for p in (d / "faiss").iterdir()) == ["brute.rows.npy", "index.json", "norms.npy"]
    assert build_indices(d, IndexConfig(factory="Brute8"), progress=False).up_to_date
    build_indices(ref, IndexConfig(factory="store"), progress=False)
    with QueryEngine(d, device="cpu") as e:
        grads, _, _ = e.gradients(e.tokenize(QUERIES))
        assert e.indices.nbytes() == (d / "faiss" / ROWS).stat().st_size
        found = e.indices.candidates(CandidateRequest(list(e.layers), {n: v.numpy() for n, v in grads.items()},
                                                      {}, k=5))
        assert [len(c) for c in found.ids] == [8] * len(QUERIES)  # the tier's fixed candidate count
    for kw in ({"k": 5}, {"k": 5, "lowest": 3}, {"k": 3, "method": "ekfac"}, {"k": 4, "layers": [e.layers[0]]}):
        (mine, got), (theirs, want) = _answers(d, grads, **kw), _answers(ref, grads, **kw)
        assert (mine, theirs) == ("brute", "store") and got == want, kw
    unregister_tier("brute")
    with pytest.raises(ValueError, match=r"'brute' index tier, which is not registered.*gradindex index"):
        with QueryEngine(d, device="cpu") as e:
            e.search(grads, k=3)


def test_the_cli_builds_and_queries_it_and_the_plan_costs_it(brute, default_index, gpt2_dir, tmp_path):
    from gradindex.model import load_causal_lm
    from gradindex.pipeline import BuildConfig
    from gradindex.plan import plan_build

    d = _copy(default_index, tmp_path / "brute")
    r = CliRunner()
    res = r.invoke(main, ["index", str(d), "--index-type", "brute16", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "brute force over every decoded row" in res.output
    assert index_args(read_manifest(d))[:2] == ["--index-type", "brute16"]  # the build command a repair prints
    res = r.invoke(main, ["query", str(d), "--text", QUERIES[0], "-k", "3", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output.splitlines()[0])) == 3
    model, _ = load_causal_lm(gpt2_dir, device="cpu")
    plan = plan_build(model, BuildConfig(shard_size=16, max_length=48), 40, factory="brute16")
    numbers = sum(lp.numbers for lp in plan.layers)
    assert plan.lookup.kind == "brute" and plan.index_bytes == 4 * 40 * numbers
    assert f"a lookup (brute index) about {40 * numbers * 1e-9:.2g} s" in plan.summary()
