"""One worker thread owns a :class:`QueryEngine`; requests wait in a bounded queue, and the queries
waiting together are answered by one :meth:`QueryEngine.query_batch` (one gradient pass) per group
of equal settings.

The worker takes every waiting job, up to ``max_batch``, after a collection window of ``window``
seconds from the first; queries with the same method, damping, layers and ``lowest`` share a
call, with the largest ``k`` of the group (each answer trimmed to its own ``k``). ``k`` is shared
only where the answers cannot depend on it: when every layer's index is exhaustive and ``k`` is at
most the index's size; otherwise it is part of the group's key. Other jobs (plain callables) run
alone, in turn. A job whose client gave up (its future cancelled) or whose deadline passed before
its turn is skipped. No exception stops the worker: a failed group is retried one query at a time
so that one bad query fails alone.

Long work (a query's exact stage) runs as :class:`Background` steps: one step (a forward + backward) at a
time, and only while no request waits, so a request waits at most one step for it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gradindex.query import QueryEngine, QueryResult

log = logging.getLogger("gradindex")


class Expired(Exception):
    """The job's deadline passed before the worker reached it."""


class Stopped(Exception):
    """The worker stopped before answering the job."""


@dataclass
class QueryJob:
    """A query to answer in a batch: ``record`` (``query_batch``'s form), its ``k`` and the settings it
    shares with its group (``method``, ``damping``, ``layers``, ``lowest``). ``finish`` turns the
    result into the answer (run in the worker; jobs without one are answered first, by ``to_dict``)."""

    record: dict
    k: int
    settings: dict
    """Keyword arguments of ``query_batch`` besides ``k`` (lists of strings are fine)."""
    finish: Callable[[QueryResult], Any] | None = None


@dataclass
class Job:
    work: QueryJob | Callable[[], Any]
    deadline: float
    """``time.monotonic()`` after which the answer is no longer wanted."""
    future: Future = field(default_factory=Future)
    queued: float = field(default_factory=time.monotonic)
    started: float | None = None
    batch: int = 0
    """Queries in the engine call that answered this one."""


@dataclass
class Background:
    """Work done a step at a time between requests: ``steps`` yields its progress ``(done, total)`` and returns
    its outcome, which ``finish`` turns into the ``answer``; ``status`` queued → running → done or failed."""

    steps: Generator[tuple[int, int], None, Any]
    finish: Callable[[Any], Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    status: str = "queued"
    done: int = 0
    total: int = 0
    answer: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    """Seconds of the worker's time spent on its steps."""

    def to_dict(self) -> dict:
        return {"id": self.id, "status": self.status, "done": self.done, "total": self.total,
                "seconds": round(self.seconds, 3)}


@dataclass
class Stats:
    batches: int = 0
    queries: int = 0
    calls: int = 0
    largest_batch: int = 0
    rejected: int = 0
    timed_out: int = 0
    skipped: int = 0
    failed: int = 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_batch"] = round(self.queries / self.batches, 3) if self.batches else 0.0
        return d


class Batcher:
    """The engine's only user: a bounded queue and the worker thread that empties it."""

    KEPT = 256
    """Background work kept for its client to read (the oldest finished ones are dropped first)."""

    def __init__(self, engine: QueryEngine, max_batch: int = 16, queue_size: int = 64, window: float = 0.002):
        if max_batch < 1 or queue_size < 1 or window < 0:
            raise ValueError(f"max_batch and queue_size must be >= 1 and window >= 0, got {max_batch}, "
                             f"{queue_size}, {window}")
        self.engine, self.max_batch, self.queue_size, self.window = engine, max_batch, queue_size, window
        indices = getattr(engine, "indices", None)
        self._share_k = indices is not None and all(li.exhaustive for li in indices.layers.values())
        self.stats = Stats()
        self.turn = threading.Lock()
        """Held while the worker answers a batch (a test holds it to keep the worker busy)."""
        self.answering = 0
        """Jobs in the batch being answered (0: the worker is idle)."""
        self._queue: deque[Job] = deque()
        self._background: deque[Background] = deque()
        self._kept: OrderedDict[str, Background] = OrderedDict()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gradindex-engine", daemon=True)
        self._thread.start()

    # -- the clients' side -----------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the queue is full (or the worker stopped)."""
        with self._cv:
            if self._stopped or len(self._queue) >= self.queue_size:
                self.stats.rejected += 1
                return False
            self._queue.append(job)
            self._cv.notify()
            return True

    def start_background(self, work: Background) -> bool:
        """Queue background ``work`` (stepped while no request waits); False when ``queue_size`` already wait."""
        with self._cv:
            if self._stopped or len(self._background) >= self.queue_size:
                self.stats.rejected += 1
                return False
            self._background.append(work)
            self._kept[work.id] = work
            while len(self._kept) > self.KEPT:
                old = next((k for k, w in self._kept.items() if w.status in ("done", "failed")), None)
                if old is None:
                    break
                del self._kept[old]
            self._cv.notify()
            return True

    def background(self, work_id: str) -> Background | None:
        """The background work ``work_id`` (queued, running or finished and still kept), else None."""
        with self._cv:
            return self._kept.get(work_id)

    def background_depth(self) -> int:
        with self._cv:
            return len(self._background)

    def note_timeout(self) -> None:
        """Count a request its handler answered 504."""
        with self._cv:
            self.stats.timed_out += 1

    def depth(self) -> int:
        """Jobs waiting (not counting the batch being answered)."""
        with self._cv:
            return len(self._queue)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current batch; waiting jobs fail with :class:`Stopped`."""
        with self._cv:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
            for work in self._background:
                work.status, work.error = "failed", Stopped("the server is stopping")
            self._background.clear()
            self._cv.notify_all()
        for job in left:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Stopped("the server is stopping"))
        self._thread.join(timeout)

    # -- the worker ------------------------------------------------------------------------------
    def _take(self) -> list[Job] | None:
        """The next batch of requests; ``[]`` when none waits but background work does (one step of it next)."""
        with self._cv:
            while not self._queue and not self._background and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            if not self._queue:
                return []
            end = time.monotonic() + self.window
            while len(self._queue) < self.max_batch and not self._stopped and (left := end - time.monotonic()) > 0:
                self._cv.wait(left)
            jobs = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            self.answering = len(jobs)
            return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            if not jobs:
                with self.turn:
                    self._step()
                continue
            with self.turn:
                try:
                    self._answer(jobs)
                except BaseException as e:  # noqa: BLE001 - the worker must outlive anything
                    log.exception("query worker: unexpected error")
                    for job in jobs:
                        _fail(job, e)
                finally:
                    self.answering = 0

    def _step(self) -> None:
        """One step of the oldest background work; its answer or error kept when it ends."""
        work = self._background[0]
        work.status = "running"
        t0 = time.perf_counter()
        end = True
        try:
            try:
                work.done, work.total = next(work.steps)
                end = False
            except StopIteration as stop:
                work.answer = work.finish(stop.value)
                work.status = "done"
        except Exception as e:  # noqa: BLE001 -- kept for its client; the worker goes on
            work.error, work.status = e, "failed"
            self.stats.failed += 1
        finally:
            work.seconds += time.perf_counter() - t0
        if end:
            with self._cv:
                self._background.popleft()

    def _answer(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        live = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():  # its client was answered 504 already
                self.stats.skipped += 1
            elif now > job.deadline:
                self.stats.skipped += 1
                job.future.set_exception(Expired("the request's time limit passed while it waited"))
            else:
                job.started = now
                live.append(job)
        groups: dict[tuple, list[Job]] = {}
        for job in live:
            if isinstance(job.work, QueryJob):
                groups.setdefault(self._key(job.work), []).append(job)
            else:
                self.stats.calls += 1
                _settle(job, job.work)
        for group in groups.values():
            self._query(group)

    def _key(self, q: QueryJob) -> tuple:
        """Jobs with equal keys share one engine call: equal settings, and ``k`` unless it may be shared."""
        shared = self._share_k and q.k <= self.engine.n
        settings = tuple(sorted((n, tuple(v) if isinstance(v, list) else v) for n, v in q.settings.items()))
        return settings, None if shared else q.k

    def _query(self, group: list[Job]) -> None:
        now = time.monotonic()  # an earlier group of this batch may have taken long
        for job in [j for j in group if now > j.deadline]:
            self.stats.skipped += 1
            job.future.set_exception(Expired("the request's time limit passed while it waited"))
        group = [j for j in group if now <= j.deadline]
        if not group:
            return
        qs = [j.work for j in group]
        try:
            results = self.engine.query_batch([q.record for q in qs], k=max(q.k for q in qs), **qs[0].settings)
        except Exception as e:
            if len(group) > 1:  # one bad query (no target token, ...) fails alone
                for job in group:
                    self._query([job])
                return
            self.stats.failed += 1
            _fail(group[0], e)
            return
        self.stats.batches += 1
        self.stats.queries += len(group)
        self.stats.largest_batch = max(self.stats.largest_batch, len(group))
        for job, r in zip(group, results, strict=True):
            job.batch = len(group)
            r.hits = r.hits[:job.work.k]
        for job, r in sorted(zip(group, results, strict=True), key=lambda p: p[0].work.finish is not None):
            _settle(job, lambda q=job.work, r=r: q.finish(r) if q.finish else r.to_dict())


def _settle(job: Job, fn: Callable[[], Any]) -> None:
    try:
        job.future.set_result(fn())
    except Exception as e:
        _fail(job, e)


def _fail(job: Job, e: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(e)
