"""A query's ``target``: only the loss tokens inside it are measured (gradindex.query.inputs.measure_target).

Checked independently: the scores are linear in the query's gradient, so a targeted query's scores equal the sum of
one-token queries (each ``input_ids`` + ``labels`` with a single label kept) over the tokens the target covers, the
tokens found here by decoding the completion's own tokenization, not by the code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from gradindex.data import IGNORE
from gradindex.query import QueryEngine
from gradindex.query.inputs import measure_target

PROMPT, COMPLETION, TARGET = "The secret of the castle is", " a small red lantern by the door.", "red lantern"


def test_measure_target_keeps_the_tokens_that_overlap_it(tokenizer):
    ids = tokenizer(PROMPT + COMPLETION)["input_ids"]
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    labels = [IGNORE] * n_prompt + ids[n_prompt:]
    kept = measure_target(labels, TARGET, tokenizer)
    assert len(kept) == len(labels) and all(y in (IGNORE, x) for y, x in zip(kept, labels, strict=True))
    text = tokenizer.decode([y for y in kept if y != IGNORE])
    assert TARGET in text and len(text) < len(COMPLETION)
    assert kept[:n_prompt] == [IGNORE] * n_prompt


def test_the_last_occurrence_is_measured(tokenizer):
    ids = tokenizer(" red one, then red two")["input_ids"]
    kept = measure_target(list(ids), "red", tokenizer)
    first = [k for k, y in enumerate(kept) if y != IGNORE]
    assert first and first[0] > len(ids) // 2


@pytest.mark.parametrize("target, match", [("blue door", "not in the text"), ("", "non-empty"), (3, "non-empty")])
def test_a_target_not_in_the_answer_is_refused(default_index, target, match):
    with QueryEngine(default_index) as engine, pytest.raises(ValueError, match=match):
        engine.scores([{"prompt": PROMPT, "completion": COMPLETION, "target": target}])


def test_a_targeted_query_scores_the_sum_of_its_target_tokens(default_index, tokenizer):
    ids = tokenizer(PROMPT + COMPLETION)["input_ids"]
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    pieces = [tokenizer.decode(ids[n_prompt:k + 1]) for k in range(n_prompt, len(ids))]
    start = COMPLETION.rfind(TARGET)
    inside = [n_prompt + i for i, end in enumerate(pieces)
              if (len(pieces[i - 1]) if i else 0) < start + len(TARGET) and len(end) > start]
    assert 0 < len(inside) < len(ids) - n_prompt
    singles = [{"input_ids": ids, "labels": [ids[k] if j == k else IGNORE for j in range(len(ids))]} for k in inside]
    with QueryEngine(default_index) as engine:
        targeted = engine.scores([{"prompt": PROMPT, "completion": COMPLETION, "target": TARGET}])
        whole = engine.scores([{"prompt": PROMPT, "completion": COMPLETION}])
        summed = engine.scores(singles).sum(0, keepdims=True)
    np.testing.assert_allclose(targeted, summed, rtol=1e-4, atol=1e-4 * np.abs(summed).max())
    assert not np.allclose(targeted, whole)


def test_cli_query_target(default_index, tokenizer, tmp_path):
    from gradindex.cli import main

    args = ["query", str(default_index), "--prompt", PROMPT, "--completion", COMPLETION, "--json", "-k", "3"]
    r = CliRunner().invoke(main, args + ["--target", TARGET])
    assert r.exit_code == 0, r.output
    with QueryEngine(default_index) as engine:
        want = engine.query({"prompt": PROMPT, "completion": COMPLETION, "target": TARGET}, k=3)
    assert [g["id"] for g in json.loads(r.stdout) if g["kind"] == "top"] == [h.id for h in want.hits]
    n = sum(1 for _ in tokenizer(COMPLETION)["input_ids"])
    assert any(note.startswith(f"only the target {TARGET!r} measured: ") and note.endswith(" tokens")
               for note in want.notes), want.notes
    assert 0 < want.num_tokens < n
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"prompt": PROMPT, "completion": COMPLETION, "target": TARGET}) + "\n")
    r2 = CliRunner().invoke(main, ["query", str(default_index), "--queries", str(q), "--json", "-k", "3"])
    assert r2.exit_code == 0, r2.output
    def ids(out: str) -> list[int]:
        return [g["id"] for g in json.loads(out)]

    assert ids(r2.stdout) == ids(r.stdout)
    bad = CliRunner().invoke(main, args + ["--target", "blue door"])
    assert bad.exit_code != 0 and "not in the text" in bad.output


def test_messages_count_queries_from_one_and_name_the_cause(default_index, tmp_path):
    """The results say `query 1:` for the first record; its errors and notes said `query 0`. A target covering only
    the first token, or cut off by truncation, was refused for another cause."""
    from gradindex.cli import main

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"prompt": PROMPT, "completion": COMPLETION}) + "\n"
                 + json.dumps({"prompt": PROMPT, "completion": COMPLETION, "target": "zebra"}) + "\n")
    r = CliRunner().invoke(main, ["query", str(default_index), "--queries", str(q), "-k", "2"])
    assert r.exit_code == 2 and "query 2's target 'zebra' is not in" in r.output, r.output
    with QueryEngine(default_index) as engine:
        with pytest.raises(ValueError, match="covers only its text's first token, which has no loss"):
            engine.scores([{"text": "the cat sat on a mat", "target": "the"}])
        long = " ".join(["word"] * 200)
        with pytest.raises(ValueError, match=r"was cut to the index's max length \(48 tokens\)"):
            engine.scores([{"prompt": long, "completion": " the red lantern.", "target": "lantern"}])
        res = engine.query_batch(["a b c", long], k=1)
    assert any(n.startswith("query 2 was longer than the index's max length") for n in res[1].notes), res[1].notes
