"""Commands that read the store without hashing it (query, explain, outliers, dedup) refuse a damaged shard clearly.

At open, every shard's size is checked against ``checksums.json`` (O(1) a shard); an h5py failure while
reading a shard's structure or rows becomes a DamagedIndexError naming the file, ``gradindex verify``
and the repair command, instead of an h5py traceback.
"""

from __future__ import annotations

import shutil

import h5py
import pytest
from click.testing import CliRunner

from gradindex.checksum import DamagedIndexError
from gradindex.cli import main
from gradindex.store import Store
from gradindex.store.rows import RowReader

SHARD = "store/shard-00001.h5"


@pytest.fixture
def index(default_index, tmp_path):
    d = tmp_path / "index"
    shutil.copytree(default_index, d)
    return d


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _clear(output: str, index, problem: str) -> None:
    assert "Traceback" not in output and "Error: damaged files" in output, output
    assert f"{SHARD} ({problem}" in output and f"gradindex verify {index}" in output, output
    assert "--repair`" in output, output


def test_a_truncated_shard_is_named_by_query_outliers_and_dedup(index, tmp_path):
    shard = index / SHARD
    shard.write_bytes(shard.read_bytes()[:-100])
    for args in (("query", index, "--text", "a b c", "-k", "2", "--device", "cpu"),
                 ("outliers", index, "--top", "2"),
                 ("dedup", index, "--out", tmp_path / "g.jsonl", "--quiet")):
        r = _cli(*args)
        assert r.exit_code != 0, args
        _clear(r.output, index, r"")
        assert "bytes, " in r.output and "were written" in r.output


def test_a_shard_h5py_cannot_read_is_named_not_a_traceback(index):
    shard = index / SHARD
    with h5py.File(shard, "r") as f:  # every byte that is not row data: headers, B-trees, heaps
        data = []
        f.visititems(lambda _, o: data.extend(
            (c.byte_offset, c.byte_offset + c.size) for c in map(o.id.get_chunk_info, range(o.id.get_num_chunks())))
            if isinstance(o, h5py.Dataset) and o.chunks else None)
    raw = bytearray(shard.read_bytes())
    keep = bytearray(raw)
    for i in range(2048, len(raw)):
        raw[i] = 0xFF
    for a, b in data:
        raw[a:b] = keep[a:b]
    shard.write_bytes(bytes(raw))  # same size: the cheap check at open passes
    with pytest.raises(DamagedIndexError, match=r"shard-00001\.h5 \(unreadable: .*gradindex verify"):
        with Store(index) as st:
            st.read_rows(list(range(len(st))))
    with pytest.raises(DamagedIndexError, match=r"shard-00001\.h5 \(unreadable: "), Store(index) as st:
        RowReader(st)  # the query's direct row reader
    for args in (("outliers", index, "--top", "2"), ("query", index, "--text", "a b c", "-k", "2", "--device", "cpu")):
        r = _cli(*args)
        assert r.exit_code != 0
        _clear(r.output, index, "")  # on a file this small the sampled hash at the open (store or index) sees it first


def test_a_missing_shard_is_named(index):
    (index / SHARD).unlink()
    r = _cli("outliers", index, "--top", "2")
    assert r.exit_code != 0
    _clear(r.output, index, "missing")
