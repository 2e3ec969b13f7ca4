"""Ranks under ``torchrun``: who writes what when a build or an in-loop capture runs on several processes.

gradindex needs no collective of its own for the gradients: each rank captures its own examples
(from activations and output gradients, however the parameters are sharded) and writes its own
files; rank 0 writes what is shared (the manifest, the preconditioner, the FAISS indices) once the
others are done. This module is the little that needs ``torch.distributed``: the rank and world
size, a barrier, gathering small Python objects, and starting the process group that ``torchrun``
describes in the environment (``gradindex build`` does so when it runs under ``torchrun``). After the
capture the ranks also share the per-file loops whose results add up (the EK-FAC correction's store pass,
the transcode) as a :class:`Team`: each its own store files, the results met in file order.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def active() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier() -> None:
    if active():
        dist.barrier()


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (on every rank); ``[obj]`` on one process."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0(fn):
    """``fn()`` on rank 0, its result (or its error, raised) on every rank; plain ``fn()`` on one process."""
    if world_size() == 1:
        return fn()
    out, err = None, None
    if rank() == 0:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 -- re-raised on every rank below
            err = e
    out, err = broadcast((out, err))
    if err is not None:
        raise err
    return out


BUILD_TIMEOUT = timedelta(hours=6)
"""A build's collective timeout: rank 0 alone fits the factors and indexes while the others wait."""
_timeout = BUILD_TIMEOUT


def init_from_env(device: str = "cpu", timeout: float | None = None) -> bool:
    """Start the process group ``torchrun`` describes (``WORLD_SIZE`` > 1), once; return whether one runs.

    Backend ``nccl`` for CUDA devices, else ``gloo``. Each rank uses CUDA device ``LOCAL_RANK``. ``timeout``: seconds
    a collective (and the start) may wait for the other ranks before it fails (default :data:`BUILD_TIMEOUT`; a
    lookup's ranks take seconds, :mod:`gradindex.query.ranks`).
    """
    global _timeout
    if active():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _timeout = BUILD_TIMEOUT if timeout is None else timedelta(seconds=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=_timeout, **_attempt_store())
    return True


def _attempt_store() -> dict:
    """Under torchrun, the process group's store as keys of this attempt alone (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's agent keeps one store for every restart of a run, and the workers' keys are not told apart by attempt,
    so a restarted gloo rank read the dead attempt's listening addresses and failed its start (Connection refused; one
    restart in four in ``test_torchrun_restarts_a_killed_rank_and_the_server_answers_again``)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    store, rank, world = next(dist.rendezvous("env://", timeout=_timeout))
    return {"store": dist.PrefixStore(f"gradindex/attempt-{attempt}", store), "rank": rank, "world_size": world}


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank died or stalled (torch's ``DistError``, gloo's
    transport errors), not an error of this rank's own work."""
    if isinstance(e, dist.DistError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and any(w in msg for w in ("gloo/transport", "Connection closed by peer",
                                                                   "Connection reset by peer"))


def timeout() -> float:
    """Seconds a collective of this run waits for the other ranks (:func:`init_from_env`)."""
    return _timeout.total_seconds()


def store() -> dist.Store:
    """The process group's key-value store (``torchrun``'s rendezvous store): small keys every rank sees."""
    return dist.distributed_c10d._get_default_store()


def shutdown(wait: bool = True) -> None:
    """Leave the process group, once every rank is done if ``wait`` (a gloo group left to the interpreter's exit
    can abort a rank with ``terminate called without an active exception``)."""
    if dist.is_available() and dist.is_initialized():
        if wait and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int = 0) -> None:
    """End a ``torchrun`` rank whose work is done and synchronized: flush its output, then leave without the
    interpreter's teardown. Gloo's C++ threads can still hold work objects then; their destructors during
    finalization aborted a rank now and then (SIGABRT, ``terminate called without an active exception``)
    even after :func:`shutdown`, failing a build that had finished (seen in CI once in a few runs)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def local_device(device: str) -> str:
    """``cuda`` → this rank's ``cuda:LOCAL_RANK`` under ``torchrun``; anything else as given."""
    if active() and device in ("cuda", "auto") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a ``DistributedDataParallel`` wrapper (FSDP2 shards in place: as is)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@dataclass(frozen=True)
class Team:
    """The ranks that share a build's per-store-file loops (the capture, the EK-FAC correction's sums, the
    transcode): each works on its own files (:meth:`owns`' round robin), rank 0 (the lead) writes what is shared.
    :data:`SOLO` is one process; :func:`team` the running ranks, every one of them calling the same stage (rank 0
    alone must never be handed a team: its collectives would wait for the others)."""

    rank: int = 0
    size: int = 1

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def owns(self, k: int) -> bool:
        """Whether this rank does store file ``k``."""
        return k % self.size == self.rank

    def on_lead(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the lead, its result (or its error, raised on every rank: :func:`shared`)."""
        if self.size == 1:
            return fn()
        try:
            return on_rank0(fn)
        except Exception as e:
            raise _shared(e) from None

    def each(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on every rank; the first rank's error raised on every rank (:func:`shared`)."""
        if self.size == 1:
            return fn()
        out, err = None, None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 -- raised on every rank below
            err = e
        self._raise_first(gather(err), err, lambda r: f"(on rank {r})")
        return out

    def _raise_first(self, errors: list, mine: BaseException | None, where: Callable[[int], str]) -> None:
        """The first failed rank's error of ``errors`` (one a rank, gathered) raised on every rank: this rank's own
        ``mine`` as it is, another rank's with the note ``where(rank)``."""
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, e = failed[0]
            raise _shared(mine) if r == self.rank else _shared(e, where(r))

    def rounds(self, n: int, work: Callable[[int], Any], combine: Callable[[int, Any], None],
               unit: str = "store file") -> None:
        """``work(k)`` for this rank's files ``k < n``, ``size`` files a round; after each round ``combine(k,
        result)`` on every rank for every file of the round, in file order, so that sums come out in the order one
        process adds them (bit for bit). A rank's error reaches every rank after its round (raised on each: the
        collectives stay matched, and the next build resumes), noted with the rank and ``unit k``."""
        for start in range(0, n, self.size):
            k = start + self.rank
            out, err = None, None
            if k < n:
                try:
                    out = work(k)
                except Exception as e:  # noqa: BLE001 -- raised on every rank below
                    err = e
            results = [(out, err)] if self.size == 1 else gather((out, err))
            self._raise_first([e for _, e in results], err, lambda r, s=start: f"(on rank {r}, {unit} {s + r})")
            for r, (res, _) in enumerate(results):
                if start + r < n:
                    combine(start + r, res)


def _shared(e: BaseException, note: str | None = None) -> BaseException:
    """``e`` marked as raised on every rank of a :class:`Team` at the same point (:func:`shared`)."""
    if note:
        e.add_note(note)
    e.gradindex_team_error = True  # type: ignore[attr-defined]
    return e


def shared(e: BaseException) -> bool:
    """Whether ``e`` came out of a :class:`Team`'s collective step, raised on every rank alike (so a rank that
    waits for the next step may go on; any other error leaves the ranks out of step: fatal)."""
    return bool(getattr(e, "gradindex_team_error", False))


SOLO = Team()
"""One process: every file, no collective."""

Share = Callable[..., Team]
"""A torchrun build's rank 0 handing a per-file pass to the other ranks: ``share(kind, *args)`` broadcasts the job
and returns the :class:`Team` to run it with (:data:`SOLO` in one process)."""


def team() -> Team:
    """The running ranks as a :class:`Team` (:data:`SOLO` on one process)."""
    return Team(rank(), world_size())
