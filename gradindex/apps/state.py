"""What the server says about its index, and how an error inside the engine becomes an HTTP status.

The index is ``ok``, ``lost`` (a rank of a sharded index's run died or stalled: :mod:`gradindex.query.ranks`),
``stale`` (a build replaced or is rebuilding the directory since the server opened
it: :meth:`~gradindex.index.opened.OpenIndex.check_current`, one ``stat`` of ``manifest.json`` per
request) or ``damaged`` (a read met a file whose bytes differ from those recorded at the build). Stale
and damaged are 503 at once, before the request is queued; a request the engine refuses is 400 with the
reason; only an unexpected failure is 500. No message leaves the server with an absolute path in it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fastapi import HTTPException

from gradindex.checksum import DamagedIndexError
from gradindex.index import IndexReplacedError
from gradindex.query.ranks import RankLostError

log = logging.getLogger("gradindex")

INDEX = "INDEX_DIR"
"""What messages say for the served index directory."""
REPAIR = "gradindex build ... --repair"
_ABSOLUTE = re.compile(r"(?<![\w.~/-])/(?:[^\s'\"`/:,;()\[\]]+/)+([^\s'\"`/:,;()\[\]]+)")
_SHARD = re.compile(r"shard-0*(\d+)\.h5")


class IndexState:
    """The served index's health (:meth:`status`), checked per request (:meth:`refuse`), and the HTTP
    error of an engine exception (:meth:`http_error`)."""

    def __init__(self, index_dir: str | Path, check_current, lost=None) -> None:
        d = Path(index_dir)
        self._dirs = sorted({str(d), str(d.absolute()), str(d.resolve())}, key=len, reverse=True)
        self._check_current = check_current
        self._lost = lost or (lambda: None)
        """Why a sharded index's ranks can no longer answer (a rank died or stalled), else None."""
        self.damage: str | None = None
        """Set by the first read that met a damaged file; the server answers 503 from then on."""
        self.stale: str | None = None
        """Set by the first answer refused because a build replaced what it read (a sharded index's part on another
        rank, which the server's own check does not see); 503 from then on."""

    def public(self, msg: str) -> str:
        """``msg`` without server paths: the index directory as ``INDEX_DIR``, any other absolute path cut to
        ``…/its-name``."""
        for d in self._dirs:
            msg = msg.replace(d, INDEX)
        return _ABSOLUTE.sub(lambda m: f"…/{m.group(1)}", msg)

    def replaced(self) -> str | None:
        """Why the directory no longer holds the index the server opened (``None`` while it does)."""
        try:
            self._check_current()
        except IndexReplacedError as e:
            return self._restart(e)
        return self.stale

    def _restart(self, e: IndexReplacedError) -> str:
        return self.public(str(e)).replace("reopen it (a QueryEngine: open a new one; `gradindex serve`: restart it)",
                                           "restart the server")

    def status(self) -> str:
        """``ok``, ``damaged: shard N (...)`` with the repair command, or ``stale: ...``."""
        if self.damage:
            return f"damaged: {self.damage}"
        if self._lost():
            return f"lost: {self.public(self._lost())}"
        why = self.replaced()
        return f"stale: {why}" if why else "ok"

    def refuse(self) -> None:
        """503 at once when the index is damaged or no longer the directory's."""
        if self.damage:
            raise HTTPException(503, f"the index is damaged: {self.damage}")
        if self._lost():
            raise HTTPException(503, self.public(self._lost()))
        why = self.replaced()
        if why:
            raise HTTPException(503, why)

    def http_error(self, e: Exception) -> HTTPException:
        """The status of an exception raised while answering: 503 for a replaced or damaged index, 400 for a
        request the engine refuses, 500 (logged) for anything else; the message without server paths."""
        if isinstance(e, HTTPException):
            return e
        if isinstance(e, RankLostError):  # (a sharded index's rank died or stalled: named, 503 now and after)
            log.error("%s", e)
            return HTTPException(503, self.public(str(e)))
        if isinstance(e, IndexReplacedError) and not self.stale:  # (another rank's part: what self.replaced
            self.stale = self._restart(e)                          # cannot see; kept, /health says it too)
        why = self.replaced()  # a build may have replaced the files under a request in flight
        if why:
            return HTTPException(503, why)
        if isinstance(e, DamagedIndexError):
            self.damage = self._damage(e)
            log.error("damaged index: %s", e)
            return HTTPException(503, f"the index is damaged: {self.damage}")
        if isinstance(e, (ValueError, TypeError)) or (isinstance(e, FileNotFoundError) and e.errno is None):
            return HTTPException(400, self.public(str(e)))  # the library's refusal (a FileNotFoundError of its own
            # has no errno: the file a request needs was never made, e.g. the full-space fit of rerank_full)
        if isinstance(e, OSError):
            log.error("index file unreadable: %s", e)
            return HTTPException(503, f"an index file could not be read ({self.public(str(e))}); "
                                      f"`gradindex verify {INDEX}` checks every file, `{REPAIR}` repairs them")
        log.error("request failed: %s: %s", type(e).__name__, e)
        return HTTPException(500, f"internal error: {type(e).__name__}: {self.public(str(e))}")

    def _damage(self, e: DamagedIndexError) -> str:
        """``shard N (problem)[; ...]; repair with `gradindex build ... --repair`, then restart the server``."""
        found = getattr(e, "damage", None) or []
        parts = []
        for d in found:
            m = _SHARD.search(d.file)
            parts.append(f"{f'shard {int(m.group(1))}' if m else d.file} ({self.public(d.problem)})")
        what = "; ".join(parts) or self.public(str(e))
        return (f"{what}; repair with `{REPAIR}` (the index's build command with --repair; `gradindex verify "
                f"{INDEX}` checks every file), then restart the server")
