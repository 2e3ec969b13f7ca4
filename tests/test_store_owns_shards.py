"""The store owns every byte of its shards: outside ``gradindex/store/`` no module opens an HDF5 file or
memory-maps one except the owners of other files (the fit files, the training-time capture log)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gradindex"
OTHER_FILES = {"precondition/files.py": "precond/<method>.h5", "integrations/capture_log.py": "capture-log parts"}
"""Modules outside the store that open HDF5 files of their own (none of them a shard)."""
OPENERS = {("h5py", "File"), ("np", "memmap"), ("numpy", "memmap")}


def file_openers(root: Path = PKG) -> set[str]:
    """Modules (relative to ``root``) outside ``store/`` that call ``h5py.File`` or ``np.memmap``."""
    found = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in OPENERS:
                found.add(rel)
    return found


def test_only_the_store_opens_shard_files():
    assert file_openers() == set(OTHER_FILES)


def test_the_check_sees_an_opener(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "ok.py").write_text("import h5py\nh5py.File('s.h5')\n")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "rows.py").write_text("import numpy as np\nnp.memmap('store/shard-00000.h5')\n")
    assert file_openers(tmp_path) == {"index/rows.py"}
