"""The library's own error types (no heavy imports: the CLI's error handling loads this at start)."""

from __future__ import annotations


class IndexMismatchError(ValueError):
    """An index directory was built with something other than what is being used now."""


class DiskFullError(OSError):
    """The disk filled (or would fill) during a stage; the message says what is kept and how to resume."""


class CorruptFileError(OSError):
    """A file of an index is torn, unreadable or of the wrong shape; the message names it and its rebuild."""


class UnsupportedLayerError(TypeError):
    """A layer of the model has no capture rule; the message names the supported types and how to add one."""
