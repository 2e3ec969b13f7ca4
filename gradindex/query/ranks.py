"""Rank 0 asks, the other ranks answer: the request loop of a sharded index under ``torchrun``, with a deadline.

Rank 0 (the one that loads the model, prints or serves HTTP) announces request ``n`` in the process group's
key-value store (``gradindex/go/n``), then broadcasts it. Every other rank waits for that key with no deadline (a
server's ranks wait between requests as long as it is idle), takes the request (``gradindex/took/n/RANK``), searches
its parts, marks it answered (``gradindex/answered/n/RANK``) and joins the one gather that brings the answers to rank
0. The two collectives carry the process group's timeout (``--rank-timeout``): a rank that died fails them at once
(its connection closes), one that stalls after the timeout, and rank 0 raises :class:`RankLostError`, one line
naming the rank, its parts and the fix (the keys say which rank took no part), instead of waiting forever. The
group is unusable after that (gloo's connections to the lost rank are broken): every later request is refused with
the same error until the run is restarted.
"""

from __future__ import annotations

import pickle
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from gradindex import distributed

__all__ = ["RankLostError", "ask", "follow", "lost", "stop_followers"]

PREFIX = "gradindex"
IDLE_STEP = timedelta(seconds=30)
"""How long one wait of an idle rank for the next request lasts before it waits again."""


class RankLostError(RuntimeError):
    """A rank of a sharded index's run died or stalled during a request: one line naming it, its parts, the fix."""


class _Run:
    """This process's side of the loop (one run a process)."""

    seq = 0
    lost: str | None = None
    stopped = False


def _key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def lost() -> str | None:
    """Why this run's ranks can no longer answer (``None`` while they can)."""
    return _Run.lost


def _answer(local, op: str, kw: dict) -> tuple[str, object]:
    """``("ok", result)`` or ``("error", exception)`` (one that pickles: the type and message at worst)."""
    try:
        if isinstance(local, BaseException):
            raise local
        return "ok", local.run(op, kw)
    except Exception as e:  # noqa: BLE001 -- sent to rank 0, which raises it
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        return "error", e


def ask(local, op: str, kw: dict, describe: Callable[[int], str] = str) -> list:
    """Rank 0: ``op`` on every rank's parts (its own, ``local``, included), their answers in rank order; the first
    error a rank raised is raised here. A rank that dies or stalls: :class:`RankLostError` (``describe(rank)``
    names what it holds), within the run's timeout."""
    if _Run.lost:
        raise RankLostError(_Run.lost)
    _Run.seq += 1
    n, t0 = _Run.seq, time.monotonic()
    try:
        distributed.store().set(_key("go", n), op)
        distributed.broadcast((op, kw))
        replies = distributed.gather(_answer(local, op, kw))
    except RuntimeError as e:  # (gloo: "Connection closed by peer", "Timed out waiting ...ms")
        _Run.lost = _who(n, e, describe, time.monotonic() - t0)
        raise RankLostError(_Run.lost) from None
    _forget(n - 1)
    for status, value in replies:
        if status == "error":
            raise value
    return [value for _, value in replies]


def _forget(n: int) -> None:
    """Delete request ``n``'s keys (every rank is past it once request ``n + 1`` is answered)."""
    if n >= 1:
        store = distributed.store()
        for key in [_key("go", n)] + [_key(s, n, r) for s in ("took", "answered")
                                       for r in range(1, distributed.world_size())]:
            store.delete_key(key)


def _who(n: int, err: Exception, describe: Callable[[int], str], waited: float) -> str:
    """The one line of a lost request ``n``: which ranks took no part in it (else did not answer it), and the fix."""
    def has(key: str) -> bool:
        try:
            return distributed.store().check([key])
        except RuntimeError:
            return False

    others = range(1, distributed.world_size())
    silent = [r for r in others if not has(_key("took", n, r))]
    slow = [r for r in others if r not in silent and not has(_key("answered", n, r))]
    died = "closed" in str(err).lower() or waited < 0.9 * distributed.timeout()  # (gloo also says "reset by peer")
    state = ("died (its connection closed)" if died else
             f"did not answer within {distributed.timeout():g} s (died or stalled)")
    who = "; ".join(f"rank {r} ({describe(r)})" for r in (silent or slow)) or "a rank"
    more = "" if died else ", or give a larger --rank-timeout if its search is that slow"
    return (f"{who} {state} during request {n} after {waited:.1f} s: the sharded index cannot answer without its "
            f"rows; restart the run (every rank; `torchrun --max-restarts N` restarts it by itself){more}")


def follow(local) -> bool:
    """A rank other than 0: answer rank 0's requests until it broadcasts ``None`` (waiting for each with no
    deadline; the collectives carry the run's timeout); whether rank 0 ended the run after an error
    (:func:`stop_followers`). Ctrl-C is rank 0's to handle (a server stops, then ends this loop): this rank ignores
    SIGINT meanwhile (torchrun sends it to every rank)."""
    store, n = distributed.store(), 0
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        while True:
            n += 1
            _wait(store, _key("go", n))
            msg = distributed.broadcast(None)
            if msg is None:
                return store.get(_key("go", n)) == FAILED
            me = distributed.rank()
            store.set(_key("took", n, me), "1")
            answer = _answer(local, *msg)
            store.set(_key("answered", n, me), "1")
            distributed.gather(answer)
    finally:
        if main:
            signal.signal(signal.SIGINT, before)


def _wait(store: dist.Store, key: str) -> None:
    """Wait for ``key`` in the store as long as it takes (a store that went away raises)."""
    while True:
        try:
            store.wait([key], IDLE_STEP)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise


FAILED = b"stop: rank 0 failed"
"""The last request's key when rank 0 ends the run after an error (the other ranks then exit non-zero too)."""


def stop_followers(failed: bool = False) -> None:
    """Rank 0: end the other ranks' :func:`follow` (once a run; nothing outside ``torchrun``, nothing once a rank
    is lost: the group is broken, and ending the run ends them); ``failed``: rank 0 ends it after an error."""
    if _Run.stopped or _Run.lost or not distributed.active():
        return
    _Run.stopped = True
    _Run.seq += 1
    try:
        distributed.store().set(_key("go", _Run.seq), FAILED if failed else "stop")
        distributed.broadcast(None)
    except RuntimeError as e:  # (a rank lost since the last request)
        _Run.lost = f"a rank was lost before the run ended ({str(e).splitlines()[0][:200]})"
