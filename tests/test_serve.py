"""The query server on a real tiny GPT-2 index: answers equal QueryEngine's (one at a time and batched),
bad input is a clear 4xx, the bearer token is enforced, a full queue is 503 and a late request 504;
`gradindex serve` end to end in a subprocess, its page in headless Chromium."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fixtures.browser import find_chromium, load, visible_text
from gradindex.apps.batching import Batcher, Expired, Job, QueryJob
from gradindex.apps.serve import QueryRequest, create_app
from gradindex.methods import DEFAULT_DAMPING
from gradindex.query import Hit, QueryEngine, QueryResult

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(audit_index):
    with QueryEngine(audit_index, device="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(engine))


@pytest.mark.parametrize("body,query", [
    ({"text": "the cat sat on a mat", "k": 4, "lowest": 2}, "the cat sat on a mat"),
    ({"prompt": "dog ran far", "completion": " away from home", "k": 3, "method": "ekfac"},
     ("dog ran far", " away from home")),
    ({"input_ids": [5, 9, 12, 40, 7], "k": 5, "method": "kfac", "damping": 0.5}, [5, 9, 12, 40, 7]),
    ({"prompt": "dog ran far", "completion": " away from home", "target": "from home", "k": 3},
     {"prompt": "dog ran far", "completion": " away from home", "target": "from home"}),
])
def test_answers_equal_the_engines(client, engine, body, query):
    r = client.post("/query", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    ref = engine.query(query, k=body["k"], method=body.get("method", "ekfac-selfnorm"),
                       damping=body.get("damping", DEFAULT_DAMPING), lowest=body.get("lowest", 0)).to_dict()
    for key in ("hits", "lowest"):
        assert [h["id"] for h in got[key]] == [h["id"] for h in ref[key]]
        assert [h["score"] for h in got[key]] == pytest.approx([h["score"] for h in ref[key]], rel=1e-6)
        assert [h["text"] for h in got[key]] == [h["text"] for h in ref[key]]
    assert got["method"] == ref["method"] and got["num_tokens"] == ref["num_tokens"]


def test_layers_and_explanations(client, engine):
    layer = engine.layer_names[1]
    r = client.post("/query", json={"text": "green hills near old town", "k": 3, "layers": [layer], "explain": 2,
                                    "method": "kfac"}).json()
    ref = engine.query("green hills near old town", k=3, layers=[layer], method="kfac")
    assert r["layers"] == [layer] and [h["id"] for h in r["hits"]] == [h.id for h in ref.hits]
    for h in r["hits"][:2]:
        e = h["explanation"]
        assert sum(e["scores"]) == pytest.approx(h["score"], rel=1e-5)
        assert sum(e["query_scores"]) == pytest.approx(h["score"], rel=1e-5)
    assert "explanation" not in r["hits"][2]


def test_example_and_health(client, engine):
    ex = client.get("/example/3").json()
    assert ex["id"] == 3 and ex["text"] == engine.texts.texts([3])[0] and ex["num_tokens"] > 0
    r = client.get(f"/example/{engine.n}")
    assert r.status_code == 404 and "ids are 0.." in r.json()["detail"]
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["examples"] == engine.n and "ekfac" in h["methods"]
    page = client.get("/")
    assert page.status_code == 200 and "<form" in page.text and "https://" not in page.text


@pytest.mark.parametrize("body,code,msg", [
    ({}, 422, "give exactly one query"),
    ({"text": "a", "prompt": "b", "completion": "c"}, 422, "give exactly one query"),
    ({"prompt": "b"}, 422, "prompt and completion go together"),
    ({"text": "the cat sat", "k": 0}, 422, "k: Input should be greater than or equal to 1"),
    ({"text": "the cat sat", "k": 100000}, 422, "k: Input should be less than or equal to 1000"),
    ({"text": "the cat sat", "method": "magic"}, 422, "method 'magic' is not one of"),
    ({"text": "x" * 30000}, 422, "text: String should have at most 20000 characters"),
    ({"text": "the cat sat", "colour": "red"}, 422, "colour: Extra inputs are not permitted"),
    ({"text": "the cat sat", "layers": ["nope.*"]}, 400, "match no indexed layer"),
    ({"text": "the cat sat", "method": "cosine", "explain": 2}, 422, "explain works for graddot"),
    ({"input_ids": [3, 4], "labels": [-100, -100]}, 400, "no target token"),
    ({"prompt": "the cat", "completion": " sat on a mat", "target": "dog"}, 400, "is not in the text"),
    ({"input_ids": [3, 99999]}, 422, "outside the model's vocabulary"),
    ({"input_ids": [3, 4], "labels": [-5, 4]}, 422, "outside the model's vocabulary"),
    ({"input_ids": [3, 4], "labels": [4]}, 422, "labels go with input_ids, one per token"),
])
def test_bad_input_is_a_clear_4xx(client, body, code, msg):
    r = client.post("/query", json=body)
    assert r.status_code == code, r.text
    assert msg in r.json()["detail"], r.json()
    assert client.get("/health").status_code == 200  # still alive


def test_bearer_token(engine):
    c = TestClient(create_app(engine, token="s3cret"))
    body = {"text": "the cat sat", "k": 2}
    assert c.post("/query", json=body).status_code == 401
    assert c.post("/query", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/example/1").status_code == 401
    r = c.post("/query", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and len(r.json()["hits"]) == 2
    assert c.get("/health").status_code == 200 and c.get("/").status_code == 200


def _same_answer(got: dict, ref: dict) -> None:
    for key in ("hits", "lowest"):
        assert [h["id"] for h in got[key]] == [h["id"] for h in ref[key]]
        assert [h["score"] for h in got[key]] == pytest.approx([h["score"] for h in ref[key]], rel=1e-6)
        assert [h["text"] for h in got[key]] == [h["text"] for h in ref[key]]
    assert got["method"] == ref["method"] and got["num_tokens"] == ref["num_tokens"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6) and got["notes"] == ref["notes"]


def _wait(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def test_concurrent_queries_are_answered_in_one_batch_each_equal_to_one_at_a_time(engine):
    bodies = [{"text": "the cat sat on a mat", "k": 3}, {"text": "dog ran far away from home and ate fish", "k": 5},
              {"prompt": "green hills near", "completion": " old town river", "k": 2},
              {"input_ids": [5, 9, 12, 40, 7, 8], "labels": [-100, -100, 12, 40, 7, 8], "k": 4},
              {"text": "blue sky with red sun", "k": 4, "method": "kfac"},
              {"text": "bread at noon under blue sky", "k": 3, "lowest": 2},
              {"text": "the dog sat on the cat", "k": 3, "explain": 1}]
    app = create_app(engine, max_batch=len(bodies), batch_window=30.0)  # the worker waits for all of them
    c = TestClient(app)
    with ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda b: c.post("/query", json=b), bodies))
    assert [r.status_code for r in got] == [200] * len(bodies), [r.text for r in got]
    served = c.get("/health").json()["served"]
    # groups: the default ekfac-selfnorm (k shared: the index is exhaustive) x4, the explained one (ekfac), kfac,
    # the default with lowest=2
    assert served["batches"] == 4 and served["queries"] == len(bodies) and served["largest_batch"] == 4
    for body, r in zip(bodies, got, strict=True):
        q = QueryRequest(**body)
        default = "ekfac" if q.explain else "ekfac-selfnorm"  # (explanations split the base method's score)
        ref = engine.query(q.record(), k=q.k, method=q.method or default, lowest=q.lowest).to_dict()
        ans = r.json()
        _same_answer(ans, ref)
        assert ans["method"] == (q.method or default)
        assert ans["batch"] == (4 if q.method is None and q.lowest == 0 and not q.explain else 1)
        assert ans["seconds"]["queue"] >= 0 and ans["seconds"]["total"] >= ans["seconds"]["queue"]
        assert ("explanation" in ans["hits"][0]) == bool(q.explain)


def test_full_queue_is_503_a_late_request_504_and_the_server_answers_after(engine):
    # the time limit leaves a loaded machine room to queue all three requests before any times out
    app = create_app(engine, queue_size=2, max_batch=1, batch_window=0, request_timeout=4.0)
    c, batcher = TestClient(app), app.state.batcher
    body = {"text": "the cat sat", "k": 2}
    with ThreadPoolExecutor(3) as pool:
        with batcher.turn:  # the engine is busy: the worker holds one request, two wait in the queue
            # the first request is taken by the worker before the other two queue (else, on a loaded machine,
            # all three could arrive first and the third find the queue of 2 full)
            waiting = [pool.submit(c.post, "/query", json=body)]
            _wait(lambda: batcher.answering == 1)
            waiting += [pool.submit(c.post, "/query", json=body) for _ in range(2)]
            _wait(lambda: batcher.answering == 1 and batcher.depth() == 2)
            r = c.post("/query", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "queue is full" in r.json()["detail"]
            late = [f.result(timeout=30) for f in waiting]
        assert [x.status_code for x in late] == [504] * 3
        assert "time limit (4 s)" in late[0].json()["detail"]
    _wait(lambda: batcher.stats.skipped == 3)  # the worker dropped the three unwanted queries unanswered
    r = c.post("/query", json=body)
    assert r.status_code == 200
    _same_answer(r.json(), engine.query("the cat sat", k=2, method="ekfac-selfnorm").to_dict())
    h = c.get("/health").json()
    assert h["queue"] == {"depth": 0, "answering": 0, "size": 2, "exact_waiting": 0, "max_batch": 1,
                          "window_s": 0, "request_timeout_s": 4.0}
    assert {k: h["served"][k] for k in ("rejected", "timed_out", "skipped", "queries", "batches")} == {
        "rejected": 1, "timed_out": 3, "skipped": 3, "queries": 1, "batches": 1}
    assert c.get("/example/2").status_code == 200


def test_an_engine_error_is_a_500_with_its_message_and_the_next_query_is_answered(engine, monkeypatch):
    c = TestClient(create_app(engine))

    def boom(*a, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine, "query_batch", boom)
    r = c.post("/query", json={"text": "the cat sat", "k": 2})
    assert r.status_code == 500 and r.json()["detail"] == "internal error: RuntimeError: out of memory"
    monkeypatch.undo()
    assert c.post("/query", json={"text": "the cat sat", "k": 2}).status_code == 200
    assert c.get("/health").json()["served"]["failed"] == 1


class _Engine:
    """A stand-in for QueryEngine.query_batch that records its calls (the batcher's logic alone)."""

    def __init__(self, exhaustive: bool, n: int = 50):
        self.n, self.calls = n, []
        self.indices = SimpleNamespace(layers={"a": SimpleNamespace(exhaustive=exhaustive)})

    def query_batch(self, records, k, method, damping, layers, lowest):
        self.calls.append(([r["text"] for r in records], k, method, lowest))
        if any(r["text"] == "bad" for r in records):
            raise ValueError("no target token")
        if any(r["text"] == "boom" for r in records):
            raise RuntimeError("boom")
        return [QueryResult([Hit(i, float(k - i), {}) for i in range(k)], [], method, damping, [], num_tokens=len(r))
                for r in records]


def _job(text: str, k: int = 3, method: str = "ekfac", lowest: int = 0, life: float = 30.0) -> Job:
    settings = {"method": method, "damping": 0.1, "layers": None, "lowest": lowest}
    return Job(QueryJob({"text": text}, k, settings), deadline=time.monotonic() + life)


@pytest.mark.parametrize("exhaustive", [True, False])
def test_batcher_groups_equal_settings_and_a_bad_query_fails_alone(exhaustive):
    eng = _Engine(exhaustive)
    b = Batcher(eng, max_batch=8, queue_size=8, window=30.0)
    with b.turn:
        jobs = [_job("a", 3), _job("b", 5), _job("bad", 3), _job("c", 2, method="kfac"), _job("d", 3, lowest=1),
                _job("e", 99), _job("f", 1, life=-1), Job(lambda: "called", deadline=time.monotonic() + 30)]
        assert all(b.submit(j) for j in jobs)
        assert not b.submit(_job("g"))  # full
    out = [j.future.exception(timeout=10) or j.future.result() for j in jobs]
    assert [len(o["hits"]) for o in out[:2]] == [3, 5] and [len(out[3]["hits"]), len(out[4]["hits"])] == [2, 3]
    assert isinstance(out[2], ValueError) and isinstance(out[6], Expired) and out[7] == "called"
    assert len(out[5]["hits"]) == 99  # k > n: a group of its own (the engine's note is per k)
    calls = sorted((tuple(t), k) for t, k, _, _ in eng.calls)
    if exhaustive:  # k is shared (the largest): an exhaustive search's top k does not depend on it
        first = [(("a", "b", "bad"), 5), (("a",), 3), (("b",), 5), (("bad",), 3)]  # then one at a time
    else:  # ANN candidates may depend on k: only equal k share a call
        first = [(("a", "bad"), 3), (("a",), 3), (("b",), 5), (("bad",), 3)]
    assert calls == sorted(first + [(("c",), 2), (("d",), 3), (("e",), 99)])
    assert b.stats.to_dict() | {"mean_batch": 0} == {
        "batches": 5, "queries": 5, "calls": 1, "largest_batch": 1, "rejected": 1,
        "timed_out": 0, "skipped": 1, "failed": 1, "mean_batch": 0}
    b.stop()
    assert not b.submit(_job("late"))


def test_batcher_outlives_engine_errors_and_stops_cleanly():
    eng = _Engine(True)
    b = Batcher(eng, max_batch=4, queue_size=4, window=0)
    boom, ok = _job("boom"), _job("a")
    b.submit(boom)
    with pytest.raises(RuntimeError, match="boom"):
        boom.future.result(timeout=10)
    b.submit(ok)
    assert len(ok.future.result(timeout=10)["hits"]) == 3
    with b.turn:
        held, waiting = _job("x"), _job("y")
        b.submit(held)
        _wait(lambda: b.depth() == 0)  # the worker took it and waits for its turn
        b.submit(waiting)
        waiting.future.cancel()  # its client gave up
        threading.Thread(target=b.stop, daemon=True).start()
        _wait(lambda: b._stopped)
    assert held.future.result(timeout=10)["hits"] and waiting.future.cancelled()
    b._thread.join(10)
    assert not b._thread.is_alive()


def test_cli_refuses_bad_queue_options(audit_index):
    from click.testing import CliRunner

    from gradindex.cli import main

    r = CliRunner().invoke(main, ["serve", str(audit_index), "--queue-size", "0"])
    assert r.exit_code != 0 and "--queue-size and --max-batch >= 1" in r.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, token: str | None = None, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_serve_subprocess_end_to_end_and_its_page(audit_index, engine, tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gradindex.cli", "serve", str(audit_index), "--port", str(port),
                             "--device", "cpu", "--cpu-index"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                h = _get(base + "/health", timeout=5)
                break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.poll() is not None else "(still starting)"
                    raise AssertionError(f"server did not come up: {out}") from e
                time.sleep(0.5)
        assert h["examples"] == engine.n
        got = _get(base + "/query", {"text": "the cat sat on a mat", "k": 3})
        ref = engine.query("the cat sat on a mat", k=3, method="ekfac-selfnorm")  # the server's default here
        assert [x["id"] for x in got["hits"]] == [x.id for x in ref.hits]
        chromium, why = find_chromium()
        if chromium is None:
            pytest.skip(f"server checked; no headless Chromium for its page: {why}")
        page = load(chromium, f"{base}/?text={quote('the cat sat on a mat')}&k=3", tmp_path, "serve-page",
                    size="1200,1000", budget_ms=30000)
        assert page.console == [], page.console
        text = visible_text(page.dom)
        top = got["hits"][0]
        assert f"id {top['id']}" in text and "3 results" in text, text[:2000]
        assert page.dom.count('class="heat"') >= 3  # the token heatmaps were drawn
        print(f"screenshot: {page.screenshot}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- hardening (issue 21: 1, 10, 11) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def default_engine(default_index):
    with QueryEngine(default_index, device="cpu") as e:
        yield e


class _Served:
    """``create_app(engine, ...)`` served by uvicorn on a free port in a thread of this process."""

    def __init__(self, engine, **kw):
        import uvicorn

        self.port = _free_port()
        self.app = create_app(engine, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        _wait(lambda: self.server.started)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.app.state.batcher.stop()


def test_health_and_page_offer_exactly_the_methods_the_default_index_answers(default_engine, default_index):
    from gradindex.methods import methods_of

    answers = methods_of(default_engine.manifest, default_index, selfnorm=True)
    default = default_engine.resolve_method()
    assert "graddot" not in answers and default == "ekfac-selfnorm"  # the EK-FAC-eigenbasis index of `gradindex build`
    c = TestClient(create_app(default_engine))
    h = c.get("/health").json()
    assert sorted(h["methods"]) == sorted(answers) and h["methods"][0] == default == h["default_method"]
    page = c.get("/").text
    import re

    offered = re.findall(r"<option( selected)?>([^<]+)</option>", page)
    assert [m for _, m in offered] == h["methods"] and [m for sel, m in offered if sel] == [default]
    for m in h["methods"]:  # every offered method is answered
        r = c.post("/query", json={"text": "the cat sat on a mat", "k": 2, "method": m})
        assert r.status_code == 200, (m, r.text)
    r = c.post("/query", json={"text": "the cat sat on a mat", "k": 2, "method": "graddot"})
    assert r.status_code == 422 and "ekfac-selfnorm" in r.json()["detail"], r.text


def test_page_answers_on_its_default_setting_in_headless_chromium(default_engine, tmp_path):
    chromium, why = find_chromium()
    if chromium is None:
        pytest.skip(f"no headless Chromium for the page: {why}")
    with _Served(default_engine) as s:
        page = load(chromium, f"http://127.0.0.1:{s.port}/?text={quote('the cat sat on a mat')}&k=3", tmp_path,
                    "default-page", size="1200,1000", budget_ms=30000)
    text = visible_text(page.dom)
    ref = default_engine.query("the cat sat on a mat", k=3)
    assert "error" not in text.split("Find", 1)[-1][:200], text[:2000]
    assert f"3 results, method {ref.method}" in text and f"id {ref.hits[0].id}" in text, text[:2000]
    assert page.console == [], page.console


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes, float]:
    """Send ``head`` (and part of a body) on a raw socket; the status, the reply and the seconds it took."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return int(got.split(b" ", 2)[1]), got, time.monotonic() - t0


def _length(reply: bytes) -> int:
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n")[0]) if b"content-length:" in head else 0


def test_token_is_checked_before_the_body_and_a_large_body_is_413_unread(engine):
    huge = 100 * 2**20
    with _Served(engine, token="s3cret") as s:
        head = (f"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {huge}\r\n").encode()
        # 1 KiB of a 100 MiB body sent: the answer comes before the rest (which never comes)
        code, _, secs = _raw(s.port, head + b"\r\n", b"{" + b" " * 1023)
        assert code == 401 and secs < 10
        code, got, _ = _raw(s.port, head + b"Authorization: Bearer s3cret\r\n\r\n", b"{" + b" " * 1023)
        assert code == 413 and b"request body over" in got
        chunked = (b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Authorization: Bearer s3cret\r\nTransfer-Encoding: chunked\r\n\r\n")
        part = b" " * 65536
        code, _, _ = _raw(s.port, chunked, (f"{len(part):x}\r\n".encode() + part + b"\r\n") * 17)
        assert code == 413
        ok = _get(f"http://127.0.0.1:{s.port}/query", {"text": "the cat sat", "k": 2}, token="s3cret")
        assert [h["id"] for h in ok["hits"]] == [h.id for h in engine.query("the cat sat", k=2).hits]
    r = TestClient(create_app(engine)).post("/query", content=b" " * (2 * 2**20),
                                            headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_health_reports_each_stages_seconds(engine):
    c = TestClient(create_app(engine))
    assert c.get("/health").json()["stages"] == {}
    got = [c.post("/query", json=b).json() for b in ({"text": "the cat sat", "k": 2},
                                                     {"text": "dog ran far away", "k": 3, "explain": 1},
                                                     {"prompt": "blue sky", "completion": " with red sun"})]
    st = c.get("/health").json()["stages"]
    for stage in ("queue", "gradient", "precondition", "search", "rerank", "texts", "total"):
        seen = [g["seconds"][stage] for g in got]
        assert st[stage]["count"] == 3 and st[stage]["max_s"] == pytest.approx(max(seen))
        assert st[stage]["p50_s"] == pytest.approx(float(np.median(seen)))
    assert st["explain"]["count"] == 1 and st["explain"]["max_s"] == pytest.approx(got[1]["seconds"]["explain"])


# -- hardening (issue 33: 6, 12, 13) ----------------------------------------------------------------
_ABS = __import__("re").compile(r"(?<![\w.~/-])/(?:[^\s'\"`/:,;()\[\]]+/)+[^\s'\"`/:,;()\[\]]+")


def _no_server_path(r, *dirs) -> None:
    """No absolute path in a response body (the index directory least of all)."""
    assert not any(str(d) in r.text for d in dirs), r.text
    assert not _ABS.search(r.text), r.text


def test_rerank_full_without_its_fit_is_a_400_naming_the_fix_without_server_paths(engine, client, audit_index):
    r = client.post("/query", json={"text": "the cat sat on a mat", "k": 2, "method": "ekfac", "rerank_full": 4})
    assert r.status_code == 400, r.text
    assert "no full-space ekfac curvature" in r.json()["detail"] and "--space full" in r.json()["detail"]
    _no_server_path(r, audit_index, Path(audit_index).resolve())
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/query", json={"text": "the cat sat", "k": 2}).status_code == 200


@pytest.fixture
def copied(default_index, tmp_path):
    import shutil

    d = tmp_path / "index"
    shutil.copytree(default_index, d)
    with QueryEngine(d, device="cpu") as e:
        yield d, e


def test_a_damaged_shard_is_503_and_health_says_damaged_with_the_repair(copied):
    import h5py

    d, eng = copied
    c = TestClient(create_app(eng))
    body = {"text": "the cat sat on a mat", "k": 3}
    assert c.post("/query", json=body).status_code == 200
    shard = d / "store" / "shard-00001.h5"
    with h5py.File(shard, "r") as f:  # the rows' bytes flipped, the file's size kept (the cheap check passes)
        chunks = []
        f.visititems(lambda _, o: chunks.extend(
            (c.byte_offset, c.size) for c in map(o.id.get_chunk_info, range(o.id.get_num_chunks())))
            if isinstance(o, h5py.Dataset) and o.chunks and o.name.startswith("/grads") else None)
    raw = bytearray(shard.read_bytes())
    for off, size in chunks:
        raw[off:off + size] = bytes(b ^ 0x5A for b in raw[off:off + size])
    shard.write_bytes(bytes(raw))
    r = c.post("/query", json=body)
    assert r.status_code == 503, r.text
    assert "damaged: shard 1" in r.json()["detail"] and "gradindex build ... --repair" in r.json()["detail"]
    _no_server_path(r, d)
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"].startswith("damaged: shard 1 ("), h.text
    assert "--repair" in h.json()["status"] and "restart the server" in h.json()["status"]
    _no_server_path(h, d)
    again = c.get("/example/1")  # refused at once from then on
    assert again.status_code == 503 and "damaged: shard 1" in again.json()["detail"]


def test_an_overwritten_index_is_refused_at_once_never_500(copied, monkeypatch):
    from gradindex.store.builder import clear_out_dir

    d, eng = copied
    c = TestClient(create_app(eng))
    body = {"text": "the cat sat on a mat", "k": 3}
    assert c.post("/query", json=body).status_code == 200
    real = eng.query_batch

    def overwritten_under_it(*a, **kw):  # `build --overwrite` clears the directory while a query is answered
        clear_out_dir(d)
        raise FileNotFoundError(2, "No such file or directory", str(d / "store" / "shard-00000.h5"))

    monkeypatch.setattr(eng, "query_batch", overwritten_under_it)
    r = c.post("/query", json=body)
    assert r.status_code == 503 and "rebuilt" in r.json()["detail"] and "restart the server" in r.json()["detail"]
    _no_server_path(r, d)
    monkeypatch.setattr(eng, "query_batch", real)
    for got in (c.post("/query", json=body), c.get("/example/2")):  # refused before it is queued
        assert got.status_code == 503 and "rebuilt" in got.json()["detail"], got.text
        _no_server_path(got, d)
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"].startswith("stale: ") and str(d) not in h.text


def test_results_cap_long_texts_and_example_gives_the_whole(engine, client, monkeypatch):
    from gradindex.apps.texts import RESULT_TEXT_CHARS

    long = "word " * 5000  # 25,000 characters
    real = engine.texts.texts
    monkeypatch.setattr(engine.texts, "texts", lambda ids: [long if i % 2 else t for i, t in zip(ids, real(ids))])
    got = client.post("/query", json={"text": "the cat sat on a mat", "k": 6, "lowest": 2}).json()
    for h in got["hits"] + got["lowest"]:
        if h["id"] % 2:
            assert h["text"] == long[:RESULT_TEXT_CHARS] and h["text_chars"] == len(long) and h["truncated"]
        else:
            assert len(h["text"]) == h["text_chars"] < RESULT_TEXT_CHARS and h["truncated"] is False
    odd = next(h["id"] for h in got["hits"] if h["id"] % 2)
    ex = client.get(f"/example/{odd}").json()
    assert ex["text"] == long and ex["text_chars"] == len(long)


def test_cli_query_json_caps_long_texts(engine, audit_index, monkeypatch):
    from click.testing import CliRunner

    from gradindex.apps.texts import RESULT_TEXT_CHARS
    from gradindex.cli import main
    from gradindex.query.texts import TrainingTexts

    long = "x" * (RESULT_TEXT_CHARS + 500)
    monkeypatch.setattr(TrainingTexts, "texts", lambda self, ids: [long] * len(ids))
    r = CliRunner().invoke(main, ["query", str(audit_index), "--text", "the cat sat", "-k", "2", "--lowest", "1",
                                  "--json", "--device", "cpu", "--cpu-index"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 and all(g["text"] == long[:RESULT_TEXT_CHARS] and g["text_chars"] == len(long)
                                  and g["truncated"] for g in rows)


def test_page_k_field_and_server_share_one_limit(client):
    import re

    from gradindex.apps.serve import MAX_EXPLAIN

    page = client.get("/").text
    limit = int(re.search(r'id="k" type="number" value="5" min="1" max="(\d+)"', page).group(1))
    le = next(m.le for m in QueryRequest.model_fields["explain"].metadata if hasattr(m, "le"))
    assert limit == le == MAX_EXPLAIN
    # what the page posts at its largest k on an explaining method is answered
    r = client.post("/query", json={"text": "the cat sat", "k": limit, "method": "kfac", "explain": limit})
    assert r.status_code == 200, r.text


def test_scores_have_one_format_in_tables_and_pages():
    import shutil

    from gradindex.apps.html import NUMBER_JS, number, table

    xs = [37880.2, 2084.3, 0.5, -0.00123, 1.5e-5, 3.2e9, -7.7e-12, 12345678.9, 0.0]
    assert [number(x) for x in xs[:2]] == ["37880", "2084"]
    html = table(["score"], [[x] for x in xs[:2]])
    assert ">37880<" in html and ">2084<" in html and "e+04" not in html
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's formatter")
    js = NUMBER_JS + f"console.log(JSON.stringify({json.dumps(xs)}.map(gxNum)))"
    out = subprocess.run([node, "-e", js], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == [number(x) for x in xs], out.stderr


def test_page_hides_the_legend_without_heatmaps_and_explains_at_most_its_limit(default_engine, tmp_path):
    import re

    from gradindex.apps.html import number

    chromium, why = find_chromium()
    if chromium is None:
        pytest.skip(f"no headless Chromium for the page: {why}")
    q = quote("the cat sat on a mat")
    with _Served(default_engine) as s:
        plain = load(chromium, f"http://127.0.0.1:{s.port}/?text={q}&k=3&method=ekfac-selfnorm", tmp_path,
                     "selfnorm-page", size="1200,1000", budget_ms=30000)
        heat = load(chromium, f"http://127.0.0.1:{s.port}/?text={q}&k=60&method=ekfac", tmp_path,
                    "k60-page", size="1200,1000", budget_ms=60000)
    legend = re.compile(r'<div id="legend" style="([^"]*)"')
    text = visible_text(plain.dom)
    assert "3 results, method ekfac-selfnorm" in text and plain.dom.count('class="heat"') == 3, text[:1500]
    assert "display:none" in legend.search(plain.dom).group(1).replace(" ", "")
    ref = default_engine.query("the cat sat on a mat", k=3, method="ekfac-selfnorm")
    assert all(f"score {number(h.score)}" in text for h in ref.hits), text[:1500]
    text = visible_text(heat.dom)
    assert "error" not in text and f"{default_engine.n} results" in text, text[:1500]
    assert "display:none" not in legend.search(heat.dom).group(1).replace(" ", "")


def test_cli_serve_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from gradindex.cli.serve import TOKEN_ENV, bearer_token

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert bearer_token(None, str(f)) == "s3cret"
    assert bearer_token(None, None) == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    assert bearer_token(None, None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty; write the token on its first line"):
        bearer_token(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not both"):
        bearer_token("a", str(f))


def test_cli_serve_reads_token_file(audit_index, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import gradindex.apps.serve as served
    from gradindex.cli import main

    seen = {}
    monkeypatch.setattr(served, "serve", lambda engine, host, port, token, *a: seen.setdefault("token", token))
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    r = CliRunner().invoke(main, ["serve", str(audit_index), "--token-file", str(f), "--device", "cpu",
                                  "--cpu-index"])
    assert r.exit_code == 0, r.output
    assert seen == {"token": "s3cret"} and "(bearer token required)" in r.output


def test_a_busy_port_is_refused_before_the_model_loads(default_index):
    """serve printed "serving ... on" and loaded the model before uvicorn's own bind error (exit 3)."""
    from click.testing import CliRunner

    from gradindex.cli import main
    from tests.conftest import refused

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = CliRunner().invoke(main, ["serve", str(default_index), "--port", str(port), "--device", "cpu"])
    refused(res.exit_code, res.output, None, f"port {port} on 127.0.0.1 is in use", "pick another --port")
    assert "serving" not in res.output
