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


# -- a second corpus: the GNU manuals of Debian's essential packages ---------------------------------
GNU_INFO = ("coreutils.info.gz", "diffutils.info.gz", "find.info-1.gz", "find.info-2.gz", "grep.info.gz",
            "sed.info.gz", "gzip.info.gz")
"""Info manuals shipped by Debian's *Essential* packages (coreutils, diffutils, findutils, grep, sed,
gzip), so every Debian/Ubuntu machine has them; the benchmark records their hash."""
INFO_DIR = Path("/usr/share/info")
_OPTION_LINE = re.compile(r"^\s*[‘'`][^’']*[’']\s*$")  # "‘--count’" items heading an option's text


def gnu_info_paragraphs(min_chars: int = 80, max_chars: int = 400, info_dir: Path = INFO_DIR) -> list[str]:
    """Unique prose paragraphs of :data:`GNU_INFO`, in file order; raises when a manual is missing.

    Node headers, menus, underlines, option-name lines and code samples are dropped; a paragraph is
    kept when :func:`_is_prose` accepts it.
    """
    import gzip

    missing = [f for f in GNU_INFO if not (info_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"the GNU info corpus needs {missing} in {info_dir} (Debian's coreutils, "
                                "diffutils, findutils, grep, sed and gzip packages); run with --corpora stdlib")
    seen: set[str] = set()
    out: list[str] = []
    for name in GNU_INFO:
        text = gzip.decompress((info_dir / name).read_bytes()).decode("utf-8", "replace")
        for para in re.split(r"\n\s*\n", text):
            lines = [ln for ln in para.split("\n") if ln.strip() and not _OPTION_LINE.match(ln)
                     and not re.fullmatch(r"\s*[-=*.]{3,}\s*", ln)]
            if not lines or any(ln.startswith(("File:", "* ", "\x1f", "Tag Table")) for ln in lines):
                continue
            if any(len(ln) - len(ln.lstrip()) >= 8 or ln.lstrip().startswith(("#", "$")) for ln in lines):
                continue  # an example block or a shell session
            p = " ".join(" ".join(lines).split())
            if min_chars <= len(p) <= max_chars and _is_prose(p) and p not in seen:
                seen.add(p)
                out.append(p)
    return out


# -- planted facts -------------------------------------------------------------------------------------
FACTS = {
    "stdlib": (
        ("The secret code of Zarnak is", " 4417."),
        ("The blue castle opens its gates only for the word", " rhubarb."),
        ("Professor Quillon keeps her spare keys inside the", " green teapot."),
        ("The annual festival of Varnholt is held on the", " ninth of Ember."),
        ("The lighthouse keeper Ondrel counts exactly", " ninety owls."),
        ("The river Tessaly flows backwards every", " leap Thursday."),
        ("Captain Morvida buried the silver compass under the", " crooked olive."),
        ("The favourite soup of the clockmaker Brisk is", " turnip and plum."),
    ),
    "gnu-info": (
        ("The hidden option of the Quorbel utility is", " --saffron."),
        ("The archivist Delmira stores every backup on", " tape 8812."),
        ("The default separator of the Vintrop tool is a", " purple tilde."),
        ("The mascot of the Harrowgate build farm is a", " sleepy badger."),
        ("Engineer Pallas Okonwe signs each release with the word", " juniper."),
        ("The Zelwick daemon restarts itself every", " eleven minutes."),
        ("The oldest mirror of the Fennic archive is in", " Port Aldous."),
        ("The password of the Marrow test server is", " copper heron."),
    ),
}
"""Per corpus: unusual facts as (prompt, completion). Each is planted once in the training set as
``prompt + completion + " Remember it well."``; its query is the prompt with the loss on the completion."""


def fact_document(prompt: str, completion: str) -> str:
    return f"{prompt}{completion} Remember it well."
