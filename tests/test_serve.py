"""The query server on a real tiny GPT-2 index: answers equal QueryEngine's, bad input is a clear 4xx,
the bearer token is enforced; `gradindex serve` end to end in a subprocess, its page in headless Chromium."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from fixtures.browser import find_chromium, load, visible_text
from gradindex.apps.serve import create_app
from gradindex.query import QueryEngine

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
])
def test_answers_equal_the_engines(client, engine, body, query):
    r = client.post("/query", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    ref = engine.query(query, k=body["k"], method=body.get("method", "ekfac"), damping=body.get("damping", 0.1),
                       lowest=body.get("lowest", 0)).to_dict()
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


def test_busy_engine_answers_503(engine):
    app = create_app(engine, busy_timeout=0.05)
    c = TestClient(app)
    with app.state.lock:  # another request holds the engine
        r = c.post("/query", json={"text": "the cat sat", "k": 2})
    assert r.status_code == 503 and "busy" in r.json()["detail"]
    assert c.post("/query", json={"text": "the cat sat", "k": 2}).status_code == 200


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
        ref = engine.query("the cat sat on a mat", k=3, method="ekfac")  # the server's default on this index
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
