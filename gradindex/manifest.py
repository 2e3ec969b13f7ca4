"""Moved: the manifest module is :mod:`gradindex.spec.manifest` (issue 32). These names stay here for the
two modules that still import them from here (``query/inputs.py``, ``store/basis.py``); delete this file once
they import :mod:`gradindex.spec.manifest`."""

from gradindex.spec.manifest import (  # noqa: F401  (re-exported)
    IndexMismatchError,
    baked_damping,
    build_command,
    identity_differences,
)
