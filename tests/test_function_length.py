"""No function in gradindex/ is longer than 60 lines (issues 20, 32): long ones are split along their steps."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gradindex"
LIMIT = 60


def long_functions(root: Path = PKG, limit: int = LIMIT) -> list[str]:
    """``path:line name (N lines)`` of every function or method over ``limit`` lines, ``def`` to its end."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_60_lines():
    assert long_functions() == []


def test_the_count_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\n@staticmethod\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:6 long ({LIMIT + 1} lines)"]
