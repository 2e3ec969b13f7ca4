"""A deterministic corpus of real English text from the Python standard library's docstrings.

No network and no data files: the text is the docstrings of a fixed list of pure-Python standard
library modules (module, class, function and method docstrings, read with ``inspect.getdoc``),
split into paragraphs. It is the same on every machine with the same Python minor version; the
benchmark records a hash of the corpus so two runs can be compared. The docstrings are read in a
fresh interpreter, because third-party imports patch standard-library objects (``transformers``
adds a documented ``warning_advice`` method to ``logging.Logger``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

# Pure-Python modules present in every CPython 3.10+ installation (no optional C extensions).
MODULES = (
    "argparse", "ast", "asyncio.events", "asyncio.locks", "asyncio.queues", "base64", "bisect",
    "calendar", "cmd", "codecs", "collections", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email.message",
    "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt",
    "gettext", "glob", "gzip", "heapq", "hmac", "html.parser", "http.client", "http.cookies",
    "imaplib", "inspect", "io", "ipaddress", "json", "json.decoder", "logging", "logging.handlers",
    "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "pstats",
    "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "types", "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid",
    "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
)

_WORDY = re.compile(r"[A-Za-z]{2,}")


def _docstrings(mod) -> list[str]:
    """Docstrings of a module and of the classes, functions and methods it defines, in name order."""
    out = [inspect.getdoc(mod) or ""]
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for mname, m in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(m) and m.__module__ == mod.__name__:
                    out.append(inspect.getdoc(m) or "")
    return out


def _is_prose(p: str) -> bool:
    """A paragraph of sentences, not a code sample, a table or an argument list."""
    if p.startswith((">>>", "...", "$", "|", "-", "*", "+", "=")) or "::" in p or "\t" in p:
        return False
    words = p.split()
    alpha = sum(1 for w in words if _WORDY.fullmatch(w.strip(".,;:()'\"")))
    return len(words) >= 8 and alpha >= 0.7 * len(words)


def stdlib_paragraphs(min_chars: int = 80, max_chars: int = 400) -> list[str]:
    """Unique prose paragraphs from the docstrings of :data:`MODULES`, in a fixed order.

    Gathered in a fresh ``python -I`` process, so what the caller imported cannot change them.
    """
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import _corpus; " \
           f"print(json.dumps(_corpus._gather({min_chars}, {max_chars})))"
    out = subprocess.run([sys.executable, "-I", "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def _gather(min_chars: int, max_chars: int) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - every listed module ships with CPython
            continue
        for doc in _docstrings(mod):
            for para in re.split(r"\n\s*\n", doc):
                p = " ".join(para.split())
                if min_chars <= len(p) <= max_chars and _is_prose(p) and p not in seen:
                    seen.add(p)
                    out.append(p)
    return out


def corpus_hash(texts: list[str]) -> str:
    """Short content hash of a list of texts (order matters)."""
    h = hashlib.blake2b(digest_size=8)
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()
