"""Imports only go forward along the data flow (docs/design.md, "Modules by stage"); this fails on any going back."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gradindex"

# Stage of every top-level module or package of gradindex; a module may import its own stage or earlier ones.
STAGES = {
    "__init__": 0, "errors": 0, "data": 0, "model": 0, "fingerprint": 0, "manifest": 0, "methods": 0, "checksum": 0,
    "lock": 0, "distributed": 0, "progress": 0, "chat": 0, "adapter": 0, "quantize": 0, "deps": 0, "spec": 0, "heap": 0,
    "diskspace": 0,
    "capture": 1,
    "store": 2,
    "precondition": 3,
    "index": 4,
    "query": 5,
    "pipeline": 6, "plan": 6, "estimate": 6, "apps": 6,
    "integrations": 7, "cli": 7, "__main__": 7,
}


def _stage_of(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "__init__"
    if top not in STAGES:
        raise AssertionError(f"gradindex.{top} has no stage in tests/test_stage_order.py: give it one")
    return top, STAGES[top]


def _imports(path: Path, pkg: Path = PKG) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``gradindex`` import in a file, lazy ones inside functions included."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gradindex"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradindex":
            targets = _from_targets(node.module, [a.name for a in node.names], pkg)
            out += [(node.lineno, m) for m in dict.fromkeys(targets)]
    return out


def _from_targets(module: str, names: list[str], pkg: Path = PKG) -> list[str]:
    """What ``from module import names`` imports: ``module.name`` where that is a submodule (a file or a
    package), else ``module`` itself (the name is an attribute of it)."""
    here = pkg.parent.joinpath(*module.split("."))
    out = []
    for name in names:
        sub = here / name
        out.append(f"{module}.{name}" if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists() else module)
    return out


def test_imports_follow_the_stage_order():
    bad = []
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 20
    for f in files:
        rel = f.relative_to(PKG.parent).with_suffix("")
        me = ".".join(rel.parts)
        top, mine = _stage_of(me if me != "gradindex.__init__" else "gradindex")
        for line, mod in _imports(f):
            other, theirs = _stage_of(mod)
            if theirs > mine:
                bad.append(f"{f.relative_to(PKG.parent)}:{line} ({top}, stage {mine}) imports {mod} (stage {theirs})")
    assert not bad, "imports against the stage order:\n" + "\n".join(bad)


def test_the_checker_catches_a_backward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from gradindex.query import QueryEngine\n")
    assert _imports(f) == [(2, "gradindex.query")]
    assert _stage_of("gradindex.query")[1] > _stage_of("gradindex.store.builder")[1]


def _module_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module → the modules of ``pkg`` it imports (lazy imports included); a package is its ``__init__``,
    and ``from a.b import c`` is the submodule ``a.b.c`` where one exists, else ``a.b``."""
    mods = {}
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        mods[name] = f
    graph = {}
    for name, f in mods.items():
        deps = set()
        for _, mod in _imports(f, pkg):
            while mod not in mods and "." in mod:  # `import a.b.c.name`-style leftovers: the enclosing module
                mod = mod.rsplit(".", 1)[0]
            if mod in mods and mod != name:
                deps.add(mod)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle per back edge of a depth-first walk; no exemption, a package's ``__init__`` included."""
    cycles, state = [], {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return cycles


def test_no_import_cycles_between_modules():
    """No two modules of gradindex import each other, however indirectly or lazily (a lazy import only
    hides a cycle), packages' ``__init__`` files included."""
    cycles = _cycles(_module_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_from_package_import_submodule(tmp_path):
    """``from pkg import sub`` is an import of ``pkg/sub.py``: the registry cycle gradindex once had
    (``layers`` → ``rules/__init__`` → ``rules/linear`` → ``layers``) is found."""
    pkg = tmp_path / "gradindex"
    (pkg / "capture" / "rules").mkdir(parents=True)
    for f in ("__init__.py", "capture/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "capture" / "layers.py").write_text("def f():\n    from gradindex.capture import rules\n")
    (pkg / "capture" / "rules" / "__init__.py").write_text("from gradindex.capture.rules import linear\n")
    (pkg / "capture" / "rules" / "linear.py").write_text("from gradindex.capture.layers import f\n")
    graph = _module_graph(pkg)
    assert graph["gradindex.capture.layers"] == {"gradindex.capture.rules"}
    cycle = ("layers", "rules", "rules.linear", "layers")
    assert _cycles(graph) == [" -> ".join(f"gradindex.capture.{m}" for m in cycle)]
