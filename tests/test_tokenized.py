"""Tokenized data is held compactly (a flat array and offsets) and reads exactly as lists of lists."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from gradindex.data import IGNORE, Ragged, Records, tokenize_records
from tests.conftest import make_texts


def test_ragged_reads_as_a_list_of_lists():
    rows = [[5, 6, 7], [], [8], [2**40, -3]]
    r = Ragged(rows)
    assert len(r) == 4 and r == rows and list(r) == rows
    assert r[0] == [5, 6, 7] and r[-1] == [2**40, -3] and r[1:3] == [[], [8]] and r[::-2] == rows[::-2]
    assert r.flat.dtype == np.int64  # (a value past int32 keeps 8 bytes)
    assert Ragged([[1, 2]]).flat.dtype == np.int32
    assert r + [[1]] == rows + [[1]] and [[1]] + r == [[1]] + rows
    assert pickle.loads(pickle.dumps(r)) == rows
    assert r.lengths().tolist() == [3, 0, 1, 2]
    with pytest.raises(IndexError):
        r[4]
    assert Ragged([]) == [] and len(Ragged([])) == 0
    r[1] = [9, 9]  # rows can be replaced, longer, shorter or past int32
    r[0] = [1]
    r[-1] = [2**40]
    assert r == [[1], [9, 9], [8], [2**40]] and r.lengths().tolist() == [1, 2, 1, 1]
    s = Ragged([[1, 2], [3]])
    s[0] = [4, 5]
    s[1] = [2**35, 6]
    assert s == [[4, 5], [2**35, 6]] and s.flat.dtype == np.int64


def test_tokenize_records_holds_four_bytes_a_token_and_the_same_rows_as_the_tokenizer(tokenizer):
    tok = tokenizer
    texts = make_texts(3000, seed=4)
    t = tokenize_records(Records([{"text": x} for x in texts]), tok, max_length=12)
    assert isinstance(t.input_ids, Ragged) and isinstance(t.labels, Ragged)
    want = [tok(x, add_special_tokens=False)["input_ids"][:12] for x in texts]
    assert t.input_ids == want and t.labels == want
    assert t.truncated == tuple(len(tok(x, add_special_tokens=False)["input_ids"]) > 12 for x in texts)
    assert t.n_truncated == sum(t.truncated) > 0
    held = t.input_ids.flat.nbytes + t.input_ids.offsets.nbytes
    assert held <= 4 * sum(map(len, want)) + 8 * (len(want) + 1)


def test_prompt_completion_masks_and_a_targetless_row_is_still_refused(tokenizer):
    tok = tokenizer
    t = tokenize_records(Records([{"prompt": "the cat", "completion": " sat on a mat"}]), tok, max_length=16)
    p = len(tok("the cat", add_special_tokens=False)["input_ids"])
    assert t.labels[0][:p] == [IGNORE] * p and t.labels[0][p:] == t.input_ids[0][p:]
    with pytest.raises(ValueError, match=r"no target token .*rows 1\b"):
        rows = [{"prompt": "the cat", "completion": " sat"}, {"prompt": "the cat", "completion": ""}]
        tokenize_records(Records(rows), tok, max_length=16)
