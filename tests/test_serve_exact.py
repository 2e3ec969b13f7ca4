"""The server's exact stage (issue 30, item 2): a query asking for it is answered by the first stage at once, its
exact stage runs one forward + backward at a time while no other request waits, and ``GET /exact/{id}`` gives
its progress, then the answer ``QueryEngine.query(rerank_full=C)`` gives (tiny GPT-2 with its full-space fit)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from gradindex.apps.batching import Background, Batcher, Job
from gradindex.apps.serve import create_app
from gradindex.capture import ProjectionSpec
from gradindex.data import load_records, tokenize_records
from gradindex.index import IndexConfig, build_indices
from gradindex.model import load_causal_lm
from gradindex.pipeline import BuildConfig, build_index
from gradindex.query import QueryEngine

C = 24
TEXT = "the cat sat on a mat"


@pytest.fixture(scope="module")
def exact_index(gpt2_dir, text_jsonl, tmp_path_factory) -> Path:
    """A budget-bound default-style index with the exact stage's full-space fit (``rerank_fit``)."""
    out = tmp_path_factory.mktemp("exact") / "idx"
    model, tok = load_causal_lm(gpt2_dir, device="cpu")
    data = tokenize_records(load_records(text_jsonl), tok, 64)
    cfg = BuildConfig(projection=ProjectionSpec(), budget="1/64", precondition="ekfac", shard_size=64, max_length=64,
                      rerank_fit=True)
    build_index(model, tok, data, out, cfg, model_id=str(gpt2_dir), data_id=str(text_jsonl), progress=False)
    build_indices(out, IndexConfig(), progress=False)
    return out


def _wait(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def test_first_stage_at_once_then_the_exact_stage_equal_to_the_engines(exact_index):
    with QueryEngine(exact_index, device="cpu") as engine:
        want = engine.query(TEXT, k=3, method="ekfac-selfnorm", rerank_full=C).to_dict()
        first = engine.query(TEXT, k=3, method="ekfac-selfnorm").to_dict()
        client = TestClient(create_app(engine))
        r = client.post("/query", json={"text": TEXT, "k": 3, "method": "ekfac-selfnorm", "rerank_full": C})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["stage"] == first["stage"] and [h["id"] for h in got["hits"]] == [h["id"] for h in first["hits"]]
        url = got["exact"]["url"]
        assert got["exact"]["status"] in ("queued", "running") and url == f"/exact/{got['exact']['id']}"
        other = client.post("/query", json={"text": "a dog ran", "k": 2})  # answered while (or after) it runs
        assert other.status_code == 200 and len(other.json()["hits"]) == 2
        _wait(lambda: client.get(url).json()["status"] in ("done", "failed"))
        done = client.get(url).json()
        assert done["status"] == "done", done
        assert done["done"] == done["total"] > 0 and done["seconds"] > 0
        res = done["result"]
        assert res["stage"] == want["stage"] == f"full-space re-rank of the top {C}"
        assert [h["id"] for h in res["hits"]] == [h["id"] for h in want["hits"]]
        assert [h["full_score"] for h in res["hits"]] == pytest.approx([h["full_score"] for h in want["hits"]],
                                                                       rel=1e-5)
        assert client.get("/exact/nope").status_code == 404
        assert client.get("/health").json()["queue"]["exact_waiting"] == 0
        client.app.state.batcher.stop()


def test_an_exact_stage_the_index_cannot_run_is_a_400_at_once(default_index):
    with QueryEngine(default_index, device="cpu") as engine:
        client = TestClient(create_app(engine))
        r = client.post("/query", json={"text": TEXT, "k": 2, "method": "ekfac", "rerank_full": 4})
        assert r.status_code == 400 and "--space full" in r.json()["detail"], r.text
        client.app.state.batcher.stop()


def test_a_request_waits_at_most_one_background_step_and_a_failing_one_fails_alone():
    b = Batcher(SimpleNamespace(), max_batch=4, queue_size=4, window=0)
    log: list[str] = []

    def steps(n: int, fail: bool = False):
        for i in range(n):
            log.append(f"step{i}")
            yield i + 1, n
        if fail:
            raise ValueError("no training data")
        return "answer"

    work = Background(steps(5), finish=str.upper)
    with b.turn:  # the worker waits here before its first step
        assert b.start_background(work)
        _wait(lambda: b.background_depth() == 1)
        request = Job(lambda: log.append("request") or "ok", deadline=time.monotonic() + 30)
        b.submit(request)
    assert request.future.result(timeout=10) == "ok"
    _wait(lambda: work.status == "done")
    assert log.index("request") <= 1 and [x for x in log if x != "request"] == [f"step{i}" for i in range(5)]
    assert work.answer == "ANSWER" and (work.done, work.total) == (5, 5)
    bad = Background(steps(2, fail=True), finish=str)
    b.start_background(bad)
    _wait(lambda: bad.status == "failed")
    assert isinstance(bad.error, ValueError) and b.background(bad.id) is bad
    after = Job(lambda: "still here", deadline=time.monotonic() + 30)
    b.submit(after)
    assert after.future.result(timeout=10) == "still here"
    b.stop()
