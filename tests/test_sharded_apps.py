"""`gradindex serve` and `gradindex audit` over a sharded index answer as over the index it was split from (in one
process, and over 2 gloo ranks); a rank that stalls or dies fails the request within --rank-timeout with one line
naming it, its part and the fix, and the server says so (503) instead of hanging."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from gradindex.apps.report import ReportConfig, build_report
from gradindex.apps.serve import create_app
from gradindex.cli import main
from gradindex.index.parts import OpenParts
from gradindex.index.sharded import SHARDS_FILE, split_index
from gradindex.query import QueryEngine
from gradindex.query.sharded import ShardedQueryEngine
from tests.conftest import make_texts
from tests.test_distributed import torchrun

ROOT = Path(__file__).resolve().parents[1]
QUERIES = make_texts(3, seed=5, max_words=10)


@pytest.fixture(scope="module")
def sharded(default_index, tmp_path_factory):
    return split_index(default_index, tmp_path_factory.mktemp("apps") / "three", 3)


def test_parts_store_reads_rows_and_columns_as_the_index(default_index, sharded):
    with OpenParts(sharded) as whole, QueryEngine(default_index, load_model=False) as one:
        assert whole.n == one.n == 40 and len(whole.store.paths) == 3
        for name in ("ids", "num_tokens", "loss", "token_hash"):
            np.testing.assert_array_equal(whole.store.column(name), one.store.column(name))
        ids = np.array([39, 0, 17, 16, 15, 33])
        a, b = whole.store.read_rows(ids), one.store.read_rows(ids)
        assert all(np.array_equal(a[n], b[n]) for n in b)
        a, b = whole.rows.read(ids), one.rows.read(ids)
        assert all(np.array_equal(a[n], b[n]) for n in b)
        got = [(i.copy(), r) for i, r in whole.store.iter_blocks(block=7)]
        want = [(i.copy(), r) for i, r in one.store.iter_blocks(block=7)]
        np.testing.assert_array_equal(np.concatenate([i for i, _ in got]), np.arange(40))
        for (ia, ra), (ib, rb) in zip(got, want, strict=True):
            assert np.array_equal(ia, ib) and all(np.array_equal(ra[n], rb[n]) for n in rb)


def test_another_ranks_columns_come_in_one_round_and_are_kept(default_index, sharded):
    """The server's /example of a row another rank holds: its columns and its token hash in one round (three
    before), the hash kept for the text read next; the values are the index's own."""
    from gradindex.query.sharded import PartSearch, _Columns
    from gradindex.store import Store

    other = PartSearch(sharded, [1, 2])
    rounds = []

    def fetch(names, ids):
        rounds.append((tuple(names), ids.tolist()))
        return other.column_rows(names, ids)

    with Store(sharded.parts[0].dir) as mine, Store(default_index) as whole:
        cols = _Columns(sharded, {0: mine}, fetch)
        ids = [3, 33, 17]
        got = cols.rows(("num_tokens", "loss", "token_hash"), ids)
        assert rounds == [(("num_tokens", "loss", "token_hash"), [17, 33])]
        for n, v in got.items():
            np.testing.assert_array_equal(v, whole.column(n)[ids])
        np.testing.assert_array_equal(cols.rows_of("token_hash", [33]), whole.column("token_hash")[[33]])
        assert len(rounds) == 1  # (kept)
        cols.rows_of("loss", [34])
        assert rounds[-1] == (("loss",), [34])
    other.close()


def _report_equal(a: Path, b: Path) -> None:
    """Two audit reports' per-query results and summaries equal (but where they were written and how long)."""
    qa = [json.loads(x) for x in (a / "queries.jsonl").read_text().splitlines()]
    qb = [json.loads(x) for x in (b / "queries.jsonl").read_text().splitlines()]
    assert qa == qb
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for s in (sa, sb):
        s.pop("seconds"), s.pop("index")
    assert sa == sb


def test_audit_report_over_parts_equals_the_index(gpt2_dir, default_index, sharded, tmp_path):
    cfg = ReportConfig(k=4, outliers=5)
    with QueryEngine(default_index, gpt2_dir, device="cpu") as one:
        s1 = build_report(one, QUERIES, tmp_path / "one", cfg)
    with ShardedQueryEngine(sharded.dir, gpt2_dir, device="cpu") as many:
        s2 = build_report(many, QUERIES, tmp_path / "many", cfg)
    assert s2["index"] == str(sharded.dir) and s1["examples"] == s2["examples"] == 40
    assert [o["id"] for o in s2["outliers"]] == [o["id"] for o in s1["outliers"]] and len(s1["outliers"]) == 5
    _report_equal(tmp_path / "one", tmp_path / "many")


def test_server_over_parts_answers_as_the_index(gpt2_dir, default_index, sharded):
    body = {"text": QUERIES[0], "k": 5, "lowest": 2, "explain": 2}
    with QueryEngine(default_index, gpt2_dir, device="cpu") as one:
        c1 = TestClient(create_app(one))
        a, ex_a, h_a = c1.post("/query", json=body).json(), c1.get("/example/33").json(), c1.get("/health").json()
    with ShardedQueryEngine(sharded.dir, gpt2_dir, device="cpu") as many:
        c2 = TestClient(create_app(many))
        r = c2.post("/query", json=body)
        assert r.status_code == 200, r.text
        b, ex_b, h_b = r.json(), c2.get("/example/33").json(), c2.get("/health").json()
    for key in ("hits", "lowest"):
        assert [(h["id"], h["score"], h["text"]) for h in b[key]] == [(h["id"], h["score"], h["text"])
                                                                       for h in a[key]]
    assert [h["explanation"] for h in b["hits"][:2]] == [h["explanation"] for h in a["hits"][:2]]  # (explain: 2)
    assert ex_b == ex_a and ex_b["text"]  # (a row of the last part: its text, tokens and loss)
    assert (h_b["status"], h_b["examples"], h_b["methods"]) == (h_a["status"], 40, h_a["methods"])


def test_server_over_parts_is_stale_when_a_part_other_than_0_is_replaced(gpt2_dir, sharded, tmp_path):
    """The server checked part 0's manifest per request: a rebuilt part 1 answered with its new rows beside the
    old parts'. Now every part open here is checked, and a part another rank holds refuses its search there; either
    way /query is 503 and /health says stale, naming the part."""
    from gradindex.spec.manifest import read_manifest, write_manifest

    d = tmp_path / "three"
    shutil.copytree(sharded.dir, d)
    with ShardedQueryEngine(d, gpt2_dir, device="cpu") as many:
        c = TestClient(create_app(many))
        assert c.post("/query", json={"text": QUERIES[0], "k": 3}).status_code == 200
        m = read_manifest(d / "part-00001")
        m["generation"] = "rebuilt"
        write_manifest(d / "part-00001", m)
        r = c.post("/query", json={"text": QUERIES[0], "k": 3})
        assert r.status_code == 503 and "part-00001" in r.json()["detail"] and "restart the server" in r.text, r.text
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"].startswith("stale:") and "part-00001" in h.text, h.text


def _run(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


@pytest.mark.slow
def test_cli_audit_over_parts_one_process_and_two_ranks_equal_the_index(default_index, sharded, tmp_path):
    qf = tmp_path / "q.jsonl"
    qf.write_text("".join(json.dumps({"text": t}) + "\n" for t in QUERIES))
    common = ["--queries", qf, "-k", "3", "--outliers", "4", "--device", "cpu"]
    _run("audit", default_index, *common, "--out", tmp_path / "one")
    out = _run("audit", sharded.dir, *common, "--out", tmp_path / "many")
    assert "3 queries, 4 outliers" in out
    _report_equal(tmp_path / "one", tmp_path / "many")
    printed = torchrun("-m", "gradindex", "audit", str(sharded.dir), *map(str, common), "--out",
                       str(tmp_path / "ranks"))
    assert printed.count("3 queries, 4 outliers") == 1  # (rank 0 prints)
    _report_equal(tmp_path / "one", tmp_path / "ranks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _ranks(args: list[str], world: int = 2, cwds: list[Path] | None = None) -> list[subprocess.Popen]:
    """``world`` ranks of ``gradindex ARGS`` started as torchrun would (its environment), each its own process, so that
    a test can stop or kill one (torchrun would end the others with it); ``cwds``: each rank's working directory
    (a relative index path then names each rank's own copy: hosts without a shared filesystem)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-m", "gradindex", *args], cwd=cwds[r] if cwds else ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _up(procs: list[subprocess.Popen], base: str) -> tuple[int, dict]:
    """Wait (up to 120 s) for served ranks' ``/health`` to answer; its status and body."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return _http(base + "/health", timeout=5)
        except OSError as e:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                _end(procs)
                raise AssertionError("ranks did not come up: " + " | ".join(p.stdout.read() for p in procs)) from e
            time.sleep(0.5)


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.slow
def test_served_ranks_a_stalled_then_dead_rank_is_named_within_the_timeout(default_index, tmp_path):
    sh = split_index(default_index, tmp_path / "two", 2)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    procs = _ranks(["serve", str(sh.dir), "--port", str(port), "--device", "cpu", "--cpu-index",
                    "--rank-timeout", "3", "--request-timeout", "60"])
    try:
        code, health = _up(procs, base)
        assert code == 200 and health["examples"] == 40
        code, got = _http(base + "/query", {"text": QUERIES[1], "k": 5})
        assert code == 200, got
        with QueryEngine(default_index, device="cpu") as one:
            want = one.query(QUERIES[1], k=5, method=got["method"])
        assert [h["id"] for h in got["hits"]] == [h.id for h in want.hits]  # (ranks 0 and 1 both answered)
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1 stalls
        t0 = time.monotonic()
        code, got = _http(base + "/query", {"text": QUERIES[2], "k": 5})
        waited = time.monotonic() - t0
        assert code == 503 and waited < 20, (code, waited, got)
        assert "rank 1 (part-00001, rows 16-39) did not answer within 3 s" in got["detail"], got
        assert "restart the run" in got["detail"] and "--rank-timeout" in got["detail"]
        code, health = _http(base + "/health")
        assert code == 503 and health["status"].startswith("lost: rank 1 (part-00001"), health
        os.kill(procs[1].pid, signal.SIGKILL)  # then dies: the next request is refused at once, the same way
        t0 = time.monotonic()
        code, got = _http(base + "/query", {"text": QUERIES[0], "k": 5})
        assert code == 503 and "rank 1 (part-00001" in got["detail"] and time.monotonic() - t0 < 5
        procs[0].send_signal(signal.SIGINT)
        procs[0].wait(timeout=30)  # rank 0 ends (no barrier with a lost rank)
    finally:
        _end(procs)


@pytest.mark.slow
def test_query_ranks_a_dead_rank_is_one_line_within_the_timeout(default_index, tmp_path):
    """`gradindex query` on 2 ranks whose rank 1 never answers, then is killed: rank 0 exits with one line (the rank
    that died, its part and the fix; or that the ranks did not all start) instead of waiting or answering.

    Rank 1 is stopped as it is launched: a query of the tiny index can end within seconds, so a rank killed
    after a fixed sleep could miss it on a quick machine (it did: rank 0 answered). A rank stopped mid-query is
    test_served_ranks_a_stalled_then_dead_rank_is_named_within_the_timeout's."""
    sh = split_index(default_index, tmp_path / "two", 2)
    procs = _ranks(["query", str(sh.dir), "--text", QUERIES[0], "--device", "cpu", "--rank-timeout", "5"])
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)  # (it cannot answer, so rank 0 cannot finish the query)
        time.sleep(3)
        procs[1].kill()
        t0 = time.monotonic()
        out, _ = procs[0].communicate(timeout=60)
        assert procs[0].returncode not in (0, None) and time.monotonic() - t0 < 30, out
        lines = [x for x in out.splitlines() if x.startswith("Error:")]
        assert len(lines) == 1, out
        assert ("rank 1 (part-00001, rows 16-39) died" in lines[0] and "restart the run" in lines[0]
                or "did not all start within --rank-timeout 5 s" in lines[0]), out
    finally:
        _end(procs)


def test_cli_info_and_verify_over_parts(sharded):
    out = _run("info", sharded.dir)
    assert "sharded: 3 parts" in out and "40 examples" in out, out
    assert "part-00000  rows 0-15 (16 examples, complete)" in out and "part-00002  rows 32-39 (8 examples" in out, out
    s = json.loads(_run("info", sharded.dir, "--json"))
    assert [p["rows"] for p in s["parts"]] == [[0, 16], [16, 32], [32, 40]] and s["data"]["examples"] == 40
    out = _run("verify", sharded.dir)
    assert "part-00002  rows 32-39: intact" in out and out.strip().endswith("intact; 18 files verified in 3 parts"), out


def _verify_fails(d: Path) -> str:
    res = CliRunner().invoke(main, ["verify", str(d)], catch_exceptions=False)
    assert res.exit_code == 1, res.output
    return res.output


def test_verify_names_a_mismatched_or_damaged_part_and_the_query_refuses_it(sharded, tmp_path):
    import shutil

    from gradindex.index.sharded import SHARDS_FILE, read_sharded
    from gradindex.spec.manifest import IndexMismatchError, read_manifest, write_manifest

    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    m = read_manifest(bad / "part-00001")
    m["build"]["model_fingerprint"] = "0" * 16  # a part of another model's index
    write_manifest(bad / "part-00001", m)
    out = _verify_fails(bad)
    assert f"DAMAGED {SHARDS_FILE}:" in out and "part-00001' holds another build" in out, out
    assert "manifest's model_fingerprint differs" in out and "split the index again" in out, out
    with pytest.raises(IndexMismatchError, match="part-00001.*model_fingerprint differs"):
        read_sharded(bad)
    res = CliRunner().invoke(main, ["query", str(bad), "--text", "a b", "--device", "cpu"])
    assert res.exit_code == 2 and "model_fingerprint differs" in res.output, res.output
    # rows that do not tile [0, N): a gap after part 0; and a damaged store file of part 2
    doc = json.loads((bad / SHARDS_FILE).read_text())
    doc["parts"][1]["first"] = 17
    (bad / SHARDS_FILE).write_text(json.dumps(doc))
    shard = bad / "part-00002" / "store" / "shard-00000.h5"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    out = _verify_fails(bad)
    assert "part 1 holds rows [17, 32), expected them to start at 16" in out, out
    assert "DAMAGED part-00002/store/shard-00000.h5" in out and "part-00002  rows 32-39: 1 damaged" in out, out


def test_more_parts_than_files_cut_them_and_merge_joins_them(gpt2_dir, default_index, tmp_path):
    """5 parts of 40 rows in 3 files (16, 16, 8): files 0 and 1 are cut at rows 8 and 24; the answers equal the
    index's, and a merge joins the pieces again: the same rows and columns (file 2, never cut, byte for byte)."""
    import filecmp

    from gradindex.index.sharded import merge_index
    from gradindex.spec.manifest import read_manifest
    from gradindex.store import Store

    sh = split_index(default_index, tmp_path / "five", 5)
    assert [(p.first, p.stop) for p in sh.parts] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert read_manifest(sh.parts[1].dir)["shard"]["files"] == [[0, 8, 16, 16]]
    with QueryEngine(default_index, gpt2_dir, device="cpu") as one, \
            ShardedQueryEngine(sh.dir, gpt2_dir, device="cpu") as many:
        a = many.query_batch(QUERIES, k=10, lowest=3)
        b = one.query_batch(QUERIES, k=10, lowest=3)
        for x, y in zip(a, b, strict=True):
            assert [(h.id, h.score) for h in x.hits + x.lowest] == [(h.id, h.score) for h in y.hits + y.lowest]
    merged = merge_index(sh.dir, tmp_path / "merged")
    with Store(default_index) as s1, Store(merged) as s2:
        assert (s1.sizes, s1.first_ids) == (s2.sizes, s2.first_ids) == ([16, 16, 8], [0, 16, 32])
        for name in ("ids", "loss", "num_tokens", "token_hash", "finite"):
            np.testing.assert_array_equal(s1.column(name), s2.column(name))
        r1, r2 = s1.read_rows(np.arange(40)), s2.read_rows(np.arange(40))
        assert all(np.array_equal(r1[n], r2[n]) for n in r1)
    assert filecmp.cmp(default_index / "store" / "shard-00002.h5", merged / "store" / "shard-00002.h5", shallow=False)
    assert "intact" in _run("verify", merged) and "intact" in _run("verify", sh.dir)


def test_a_damaged_row_read_across_parts_is_named_in_its_part(sharded, tmp_path):
    import shutil

    import h5py

    from gradindex.checksum import DamagedIndexError

    bad = tmp_path / "bad"
    shutil.copytree(sharded.dir, bad)
    with h5py.File(bad / "part-00002" / "store" / "shard-00000.h5", "r+") as f:
        ds = f["grads"][next(iter(f["grads"]))]
        ds[1] = ds[1] ^ 0x11  # (row 33 of the whole index: its codes no longer match their recorded hash)
    from gradindex.index.sharded import read_sharded

    with OpenParts(read_sharded(bad)) as whole:
        assert whole.store.read_rows(np.array([0, 20, 32]))  # (other rows read)
        for read in (whole.store.read_rows, whole.rows.read):
            with pytest.raises(DamagedIndexError, match=r"part-00002.*shard-00000\.h5.*rows \[1\]"):
                read(np.array([5, 33, 17]))


def _hosts(sh, root: Path) -> list[Path]:
    """Each part on its own "host": ``root/hostR/idx`` holds shards.json and part R only."""
    out = []
    for r, part in enumerate(sh.parts):
        idx = root / f"host{r}" / "idx"
        idx.mkdir(parents=True)
        shutil.copy(sh.dir / SHARDS_FILE, idx)
        shutil.copytree(part.dir, idx / part.dir.name)
        out.append(idx.parent)
    return out


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    try:
        return [p.communicate(timeout=300)[0] for p in procs]
    finally:
        _end(procs)


@pytest.mark.slow
def test_ranks_on_hosts_without_a_shared_filesystem_answer_as_the_index(default_index, tmp_path):
    """Each rank sees only its own part (and shards.json): the query prints what the one index prints, texts of
    the other host's rows included (their token hashes come from that rank); the audit, which reads every part's
    rows on rank 0, names the missing part; another shards.json on a host is refused."""
    sh = split_index(default_index, tmp_path / "two", 2)
    hosts = _hosts(sh, tmp_path)
    q = ["--text", QUERIES[0], "--text", QUERIES[1], "-k", "10", "--lowest", "2", "--device", "cpu"]
    one = _run("query", default_index, *q)
    ids = [int(m.group(1)) for m in re.finditer(r"^\s+\d+\s+(\d+)\s+-?[\d.]+\s+\S", one, re.M)]
    assert len(ids) == 24 and any(i >= sh.parts[1].first for i in ids), one  # (texts of the other host's rows)
    out = _finish(_ranks(["query", "idx", *q], cwds=hosts))
    assert out[0].endswith(one) and "Error" not in out[0], out
    qf = tmp_path / "q.jsonl"
    qf.write_text(json.dumps({"text": QUERIES[0]}) + "\n")
    out = _finish(_ranks(["audit", "idx", "--queries", str(qf), "--out", str(tmp_path / "audit"), "--device", "cpu"],
                         cwds=hosts))
    assert "is not on this host" in out[0] and "part-00001" in out[0] and "shared filesystem" in out[0], out
    _served_example_from_its_host(default_index, hosts, sh.parts[1].first + 3)
    doc = json.loads((hosts[1] / "idx" / SHARDS_FILE).read_text())
    doc["parts"][1]["stop"] = doc["parts"][1]["stop"]  # (the same index, written otherwise: refused all the same)
    (hosts[1] / "idx" / SHARDS_FILE).write_text(json.dumps(doc, indent=4))
    out = _finish(_ranks(["query", "idx", *q], cwds=hosts))
    assert "rank 1's" in out[0] and "is not rank 0's" in out[0] and "same shards.json" in out[0], out
    shutil.copy(sh.dir / SHARDS_FILE, hosts[1] / "idx")
    shutil.rmtree(hosts[1] / "idx" / "part-00001")  # (a host without its own part)
    procs = _ranks(["query", "idx", *q], cwds=hosts)
    out = _finish(procs)
    assert "rank 1 of 2 answers for part-00001" in out[0] and str(hosts[1]) in out[0], out
    assert all(p.returncode != 0 for p in procs) and "rank 0 ended the run after an error" in out[1], out


def _served_example_from_its_host(index: Path, hosts: list[Path], row: int) -> None:
    """`serve` over ranks in their own folders: /example of a row on the other host (its columns and token hash
    come from that rank) equals the one index's."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    procs = _ranks(["serve", "idx", "--port", str(port), "--device", "cpu", "--cpu-index"], cwds=hosts)
    try:
        _up(procs, base)
        code, got = _http(f"{base}/example/{row}")
        with QueryEngine(index, device="cpu") as one:
            want = one.texts.texts(np.array([row]))[0]
            cols = one.example_columns(("num_tokens", "loss"), [row])
        assert code == 200 and got["text"] == want and want, got
        assert got["num_tokens"] == int(cols["num_tokens"][0]), got
    finally:
        _end(procs)


def _serve_two(index: Path, tmp_path: Path) -> tuple[list[subprocess.Popen], str]:
    """``index`` split in 2 and served by 2 ranks (``--rank-timeout 5``); the ranks and the server's base URL."""
    sh = split_index(index, tmp_path / "two", 2)
    port = _free_port()
    procs = _ranks(["serve", str(sh.dir), "--port", str(port), "--device", "cpu", "--cpu-index", "--rank-timeout", "5"])
    return procs, f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_health_finds_a_rank_that_died_while_the_server_was_idle(default_index, tmp_path):
    """/health said "ok" for as long as no request came after a rank died."""
    procs, base = _serve_two(default_index, tmp_path)
    try:
        code, health = _up(procs, base)
        assert code == 200 and health["status"] == "ok", health
        procs[1].kill()
        procs[1].wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            code, health = _http(base + "/health", timeout=10)
            if code == 503:
                break
            time.sleep(1)
        assert code == 503 and health["status"].startswith("lost: rank 1 (part-00001"), health
        assert time.monotonic() - t0 < 15, time.monotonic() - t0  # (probed every 5 s)
        assert health["served"]["rejected"] == 0
    finally:
        _end(procs)


@pytest.mark.slow
def test_a_rank_whose_rank_0_died_stops_with_one_line(default_index, tmp_path):
    """Rank 1 printed two chained tracebacks (the store's wait, then the shutdown barrier) when rank 0 was killed."""
    procs, base = _serve_two(default_index, tmp_path)
    try:
        _up(procs, base)
        procs[0].kill()
        out, _ = procs[1].communicate(timeout=60)
        assert procs[1].returncode not in (0, None), out
        errors = [x for x in out.splitlines() if x.startswith("Error:")]  # (torch's own C++ warning may precede it)
        assert "Traceback" not in out and len(errors) == 1 and "rank 0 went away" in errors[0], out
    finally:
        _end(procs)



def _worker_pid(agent: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker ``rank`` (a process under ``agent`` whose environment says ``RANK=rank``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
                parents = [int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])]
                parents.append(int((Path("/proc") / str(parents[0]) / "stat").read_text().rsplit(")", 1)[1].split()[1]))
            except (OSError, ValueError, IndexError):
                continue
            if agent.pid in parents and f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env):
                return int(p.name)
        time.sleep(0.5)
    raise AssertionError(f"torchrun's rank {rank} did not start")


def _back(agent: subprocess.Popen, base: str, timeout: float = 120) -> tuple[int, dict]:
    """Wait for ``/health`` to answer 200 again (torchrun restarting the run); its last status and body."""
    deadline = time.monotonic() + timeout
    code, health = 0, {}
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            code, health = _http(base + "/health", timeout=5)
            if code == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    return code, health


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_server_answers_again(default_index, tmp_path):
    """kill -9 of rank 1 under `torchrun --max-restarts 1`: the request answers 503 naming its part (or finds the server
    gone while torchrun restarts the run); once the run is back, requests answer as before. No part is written."""
    sh = split_index(default_index, tmp_path / "two", 2)
    before = {p: p.stat().st_mtime_ns for p in sh.dir.rglob("*") if p.is_file()}
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--max-restarts", "1", "--monitor-interval", "1", "-m", "gradindex", "serve",
                              str(sh.dir), "--port", str(port), "--device", "cpu", "--cpu-index", "--rank-timeout",
                              "10"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _up([agent], base)[0] == 200
        code, first = _http(base + "/query", {"text": QUERIES[1], "k": 5})
        assert code == 200, first
        os.kill(_worker_pid(agent, 1), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            code, got = _http(base + "/query", {"text": QUERIES[1], "k": 5}, timeout=30)
            assert code == 503 and "rank 1 (part-00001, rows 16-39) died (its connection closed)" in got["detail"], got
            assert time.monotonic() - t0 < 10  # (measured: 0.02 s; the connection closes at once)
        except OSError:  # torchrun stopped rank 0 before the request came
            pass
        code, health = _back(agent, base)
        if code != 200:
            agent.kill()
            raise AssertionError(f"not back after {time.monotonic() - t0:.1f} s: {health}\n{agent.communicate()[0]}")
        code, again = _http(base + "/query", {"text": QUERIES[1], "k": 5})
        assert code == 200 and again["hits"] == first["hits"], (first, again)
        assert {p: p.stat().st_mtime_ns for p in sh.dir.rglob("*") if p.is_file()} == before
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
