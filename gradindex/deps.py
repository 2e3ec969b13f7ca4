"""Optional dependencies the plain ``pip install gradindex`` leaves out, and the one line that says so.

FAISS comes in two packages that install the same ``faiss`` module (``faiss-cpu``, ``faiss-gpu``);
installing both breaks it, so neither is a plain dependency: the extras ``gradindex[cpu]`` and
``gradindex[gpu]`` choose one, and every command that searches or builds an index refuses to start
without it (the build would otherwise capture for minutes, then fail at the index stage).
"""

from __future__ import annotations

import importlib.util

FAISS_MISSING = ("FAISS is not installed (the plain `pip install gradindex` leaves it out: there is one package "
                 "per device); install `pip install 'gradindex[cpu]'`, or `pip install 'gradindex[gpu]'` on Linux "
                 "x86-64 with an NVIDIA GPU (from a clone: `pip install -e '.[cpu]'`, or `bash scripts/setup.sh`)")


def has_faiss() -> bool:
    """Whether the ``faiss`` module can be imported (without importing it: that takes a second)."""
    try:
        return importlib.util.find_spec("faiss") is not None
    except (ValueError, ImportError):
        return False
