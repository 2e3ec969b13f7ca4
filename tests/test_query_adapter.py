"""``query IDX --model ADAPTER_DIR`` (issue 33 item 2): the adapter given is the one used, and refused in one
line naming the difference when it is not the index's; before, the index's own adapter was silently used."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("peft", reason="peft is not installed (pip install 'gradindex[peft]' or '[dev]')")

from test_adapter import _build, make_adapter  # noqa: E402

from gradindex.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def adapter_index(tmp_path_factory, tokenizer, text_jsonl):
    from fixtures.tiny import save_model_dir, tiny_qwen2

    root = tmp_path_factory.mktemp("qadapter")
    base = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer)), tokenizer, root / "base")
    adapter = make_adapter(base, root / "adapter", seed=1)
    other = make_adapter(base, root / "other", seed=2)
    r = _build(base, text_jsonl, root / "index", "--adapter", adapter)
    assert r.exit_code == 0, r.output
    return root / "index", adapter, other


def _query(index, *extra):
    return CliRunner().invoke(main, ["query", str(index), "--text", "the cat sat", "-k", "3", "--method", "graddot",
                                     "--device", "cpu", *map(str, extra)])


def test_another_adapter_given_with_model_is_refused_naming_the_adapter(adapter_index):
    index, _, other = adapter_index
    r = _query(index, "--model", other)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1 and "adapter (--adapter) differs" in lines[0] and "rebuild the index" in lines[0], r.output
    assert "Traceback" not in r.output


def test_the_index_s_own_adapter_given_with_model_is_used(adapter_index):
    index, adapter, _ = adapter_index
    plain, given = _query(index), _query(index, "--model", adapter)
    assert plain.exit_code == 0 and given.exit_code == 0, (plain.output, given.output)
    assert plain.output == given.output
