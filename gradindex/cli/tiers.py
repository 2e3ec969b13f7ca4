"""The registered index tiers as the CLI's ``--index-type`` help lists them, without importing them.

The registry (:data:`gradindex.index.tiers.base.TIERS`) fills as the tier modules are imported, and they load
numpy, torch and FAISS, which ``gradindex build --help`` must not (tests/test_cli_startup.py). So the tiers of the
package are read from its source (each class passed to ``register_tier`` with a literal ``name``), and where the
registry is loaded already (a tier registered by the caller's own code) it is the list. tests/test_cli_tiers.py
checks that the two agree.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TIERS_DIR = Path(__file__).resolve().parents[1] / "index" / "tiers"

TIER_WORDS = {
    "store": "queries scan the store's own codes (exhaustive, exact, no copy); auto's first choice while one scan "
             "is estimated under 0.5 s and the store fits a quarter of RAM",
    "sketch": "two tiers: an in-RAM sketch of each example's whole-model row ranks everything, its top --candidates "
              "are re-ranked exactly",
    "faiss": "per-layer FAISS indices of a factory string (Flat, IVF1024,PQ64, SQ4, HNSW32, ...): any string no "
             "other tier takes; auto's choice with --whiten/--normalize (the per-layer default)",
}
"""The CLI's words for tiers whose docstrings are written for the code; any other tier is described by its ``help``
attribute, else its docstring's first sentence."""


@dataclass(frozen=True)
class TierInfo:
    """What the help says of one registered tier."""

    name: str
    auto_order: float | None
    catch_all: bool
    help: str

    def sort_key(self) -> tuple:
        return self.catch_all, self.auto_order is None, self.auto_order or 0.0, self.name


def first_sentence(doc: str) -> str:
    """A docstring's first sentence in plain words (reST roles and literals reduced to their names)."""
    text = " ".join((doc or "").split())
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"\1", text)
    text = re.sub(r"\s*\(module doc\)", "", text.replace("``", ""))
    m = re.match(r"(.+?\.)(\s|$)", text)
    text = (m.group(1) if m else text).rstrip(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def _constants(node: ast.ClassDef) -> dict:
    out = {}
    for s in node.body:
        targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
        if isinstance(getattr(s, "value", None), ast.Constant):
            out.update({t.id: s.value.value for t in targets if isinstance(t, ast.Name)})
    return out


def declared_tiers(folder: Path = TIERS_DIR) -> dict[str, TierInfo]:
    """The tiers the modules of ``folder`` register, read from their source (nothing imported)."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        called = {c.args[0].id for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args
                  and getattr(c.func, "id", "") == "register_tier" and isinstance(c.args[0], ast.Name)}
        for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            decorated = any(getattr(d, "id", "") == "register_tier" for d in node.decorator_list)
            attrs = _constants(node)
            if (decorated or node.name in called) and isinstance(attrs.get("name"), str):
                out[attrs["name"]] = TierInfo(attrs["name"], attrs.get("auto_order"), bool(attrs.get("catch_all")),
                                              attrs.get("help") or first_sentence(ast.get_docstring(node) or ""))
    return out


def registered_tiers() -> list[TierInfo]:
    """Every registered tier, in ``auto``'s order (catch-all last): the registry's where it is loaded, else the
    package's as its source declares them."""
    declared = declared_tiers()
    base = sys.modules.get("gradindex.index.tiers.base")
    if base is None or "gradindex.index.tiers" not in sys.modules:
        return sorted(declared.values(), key=TierInfo.sort_key)
    live = [declared.get(n) or TierInfo(n, c.auto_order, c.catch_all,
                                        getattr(c, "help", "") or first_sentence(c.__doc__ or ""))
            for n, c in base.TIERS.items()]
    return sorted(live, key=TierInfo.sort_key)


def index_type_help() -> str:
    """``--index-type``'s help: each registered tier in words, then what ``auto`` does."""
    tiers = registered_tiers()
    each = "; ".join(f"{t.name}{' (catch-all)' if t.catch_all else ''}: {TIER_WORDS.get(t.name) or t.help}"
                     for t in tiers)
    order = ", ".join(t.name for t in tiers if t.auto_order is not None)
    return (f"The index tier, one of those registered (gradindex.index.tiers). {each}. auto: the first of {order} "
            "that suits the rows and the space.")
