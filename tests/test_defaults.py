"""One relative damping default, :data:`gradindex.methods.DEFAULT_DAMPING`, behind every API, CLI option and
record fallback: changing it is a one-line change."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import click

from gradindex.methods import DEFAULT_DAMPING

PKG = Path(__file__).resolve().parents[1] / "gradindex"


def test_the_damping_default_is_written_in_one_place():
    again = []
    for f in sorted(PKG.rglob("*.py")):
        if f == PKG / "methods.py":
            continue
        lines = f.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(f))):
            if (isinstance(node, ast.Constant) and type(node.value) is float and node.value == DEFAULT_DAMPING
                    and "damping" in lines[node.lineno - 1].lower()
                    and not re.match(r"\s*[A-Z][A-Z0-9_]* = ", lines[node.lineno - 1])):  # another constant
                again.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not again, "use gradindex.methods.DEFAULT_DAMPING:\n" + "\n".join(again)


def _commands(group: click.Group):
    for cmd in group.commands.values():
        yield cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd)


def test_every_damping_default_is_the_constant():
    from gradindex.apps.explain import explain
    from gradindex.cli import main
    from gradindex.index import IndexSpace
    from gradindex.pipeline import BuildConfig
    from gradindex.precondition import FitConfig
    from gradindex.query import QueryEngine
    from gradindex.query.scores import score_matrix

    options = [p for c in _commands(main) for p in c.params if p.name == "damping"]
    assert len(options) >= 9 and {p.default for p in options} == {DEFAULT_DAMPING}
    for fn in (QueryEngine.query_batch, QueryEngine.scores, QueryEngine.search, score_matrix, explain):
        assert inspect.signature(fn).parameters["damping"].default == DEFAULT_DAMPING, fn
    assert BuildConfig().damping == FitConfig().damping == IndexSpace().damping == DEFAULT_DAMPING
    assert IndexSpace.from_dict({"whiten": "none", "damping": None}).damping == DEFAULT_DAMPING
