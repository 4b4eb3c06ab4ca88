"""Loads off the engine's step: :class:`AsyncLoads`, a bounded pool of fetch threads for the hits the store holds
remotely, with a deadline per load.

A consumer hit whose chunks only a remote tier (Redis, a peer) holds would make the whole batch wait
on the network if it were loaded before the step's forward. vLLM lets a connector load such a
request between steps instead: the scheduler parks it (``WAITING_FOR_REMOTE_KVS``, its blocks
reserved for it alone), a fetch thread fetches, decodes and writes its blocks while the other
requests keep running, and the worker reports it through ``get_finished`` once its blocks hold
the KV, with the blocks it could not fill reported as load errors in the same step (vLLM recomputes
them). Every load handed over is reported exactly once, failed, cancelled, expired or not: vLLM frees an
aborted request's blocks only then (``Scheduler.finish_requests`` delays the free of a request still
``WAITING_FOR_REMOTE_KVS``), and a second report of a freed request trips its scheduler's assertion.

**Fairness.** Loads run on ``workers`` threads (:func:`load_workers` sizes the pool from the engine's
config); loads of one request run one at a time, in the order they came. Each load has a deadline,
``deadline_s`` after it was handed over: a load still queued then is reported with every block failed,
and a running one is reported with the blocks it has not filled failed and writes no further block. A
thread stuck inside a slow store call cannot be interrupted, so a running load that expires while its
thread is not writing is reported at once (by :meth:`AsyncLoads.finished`, the engine's ``get_finished``)
and a replacement thread is started, at most ``workers`` of them (``2 * workers`` threads in all); the
stuck thread leaves once its call returns. So a slow tier or tenant delays another request's load by
at most that request's own deadline.

**No write after the report.** Once a load is reported vLLM may recompute into its blocks, or free and
reuse them, so every write into them happens between :meth:`Gate.begin_write` (refused once the load was
reported, expired, cancelled or the pool is closing) and :meth:`Gate.end_write`, under the pool's lock.
A load that expires while it writes is marked expired and reported at the end of that chunk's write; the
engine's thread never waits for one. On a GPU the end of a write records an event on the thread's CUDA
stream, and a load is reported only once that event has completed (``Event.query``, which never
blocks), so no kernel of it can still be writing; each thread's stream is also synchronised before the
thread reports its own load.

A request that finished (aborted) before its load completed is cancelled (:meth:`AsyncLoads.cancel`): a
queued load is reported at once without running, a running one stops at its next chunk boundary
(``gate()`` turns true) without writing more blocks. Neither reports failed blocks: vLLM frees the blocks
of a finished request uncached. :meth:`AsyncLoads.close` cancels everything and says whether every thread
left in time (the caller keeps the service open when one did not).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from scd_store.adapters.vllm.plan import ChunkLoad
from scd_store.adapters.vllm.threads import join_all

log = logging.getLogger("scd_store.adapters.vllm")
MAX_LOAD_WORKERS = 8  # the derived pool's ceiling


def load_workers(setting: int, max_num_seqs: int) -> int:
    """The fetch threads for ``load_workers = setting``: itself when positive, else derived from vLLM's
    ``max_num_seqs``: ``min(8, max(2, max_num_seqs // 8))``. At least 2, so one slow load never holds up
    another; one per 8 sequences the engine may batch, since only new requests whose hit a remote tier
    holds load here and each load is mostly waiting on its tier; at most 8, since on a CPU engine every
    thread that decodes competes with the engine's own threads (a stuck thread is replaced anyway)."""
    if setting > 0:
        return setting
    return min(MAX_LOAD_WORKERS, max(2, int(max_num_seqs) // 8))


class Gate(Protocol):
    """What a load asks before, and says after, each write into its request's blocks."""

    def __call__(self) -> bool:
        """Whether the load should stop (cancelled, past its deadline, or the pool is closing)."""

    def begin_write(self) -> bool:
        """Whether the load may write its next chunk into the request's blocks now (then it is writing)."""

    def end_write(self, filled: int) -> None:
        """The write begun last is done; the request's blocks now hold its prompt's first ``filled`` tokens."""


class OpenGate:
    """The gate of a synchronous load (on the engine's thread, reported in its own step): open until
    ``stopped()``, when given, turns true."""

    def __init__(self, stopped: Callable[[], bool] | None = None) -> None:
        self._stopped = stopped

    def __call__(self) -> bool:
        return self._stopped is not None and self._stopped()

    def begin_write(self) -> bool:
        return not self()

    def end_write(self, filled: int) -> None:
        return None


# run(load, gate) -> the blocks it could not fill; gate() turns true once the load should stop
Run = Callable[[ChunkLoad, Gate], set[int]]


@dataclass(slots=True, eq=False)
class _Job:
    """A load handed over, until it is reported (all fields under the pool's lock)."""

    load: ChunkLoad
    deadline: float
    cancelled: bool = False
    expired: bool = False
    reported: bool = False
    writing: bool = False
    running: bool = False  # a thread holds it (in the pool's running list)
    abandoned: bool = False  # reported while its thread was inside it; that thread was replaced
    filled: int = 0  # prompt tokens its writes have put into the request's blocks
    event: Any = None  # on a GPU: recorded on the thread's stream after its last write

    def stopped(self) -> bool:
        return self.cancelled or self.expired or self.reported


def _written(event: Any) -> bool:
    """Whether the writes before ``event`` are done on the device (never blocks)."""
    return event is None or bool(event.query())


class _JobGate:
    """A running job's :class:`Gate`, on the thread running it."""

    __slots__ = ("_pool", "_job", "_stream")

    def __init__(self, pool: AsyncLoads, job: _Job, stream: Any) -> None:
        self._pool, self._job, self._stream = pool, job, stream

    def __call__(self) -> bool:
        return self._job.stopped() or self._pool._closing

    def begin_write(self) -> bool:
        with self._pool._cond:
            if self._job.stopped() or self._pool._closing:
                return False
            self._job.writing = True
            return True

    def end_write(self, filled: int) -> None:
        event = self._stream.record_event() if self._stream is not None else None
        with self._pool._cond:
            job = self._job
            job.writing, job.filled, job.event = False, filled, event
            if job.expired and not job.reported and _written(event):  # it expired while writing: report it now
                self._pool._report(job, job.load.blocks_from(filled))


class AsyncLoads:
    """Runs ``run(load, gate) -> blocks that failed`` on fetch threads; :meth:`finished` collects the outcomes
    and reports the loads past their deadline (``on_expired(n)`` counts them)."""

    def __init__(self, run: Run, device: torch.device | None = None, name: str = "scd-store-fetch",
                 workers: int = 2, deadline_s: float | None = None, on_expired: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise ValueError(f"an asynchronous load pool needs a thread, got workers={workers}")
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"an asynchronous load's deadline must be positive, got {deadline_s!r}")
        self._run = run
        self._device = device if device is not None else torch.device("cpu")
        self._name = name
        self._deadline_s = deadline_s if deadline_s is not None else float("inf")
        self._on_expired = on_expired
        self._clock = clock
        self._cond = threading.Condition()
        self._queued: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._busy: set[str] = set()  # requests a thread is loading (their next load waits for it)
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._in_flight = 0
        self._expired = 0  # expiries not yet handed to on_expired
        self.expired_total = 0
        self._closing = False
        self._target = workers
        self._cap = 2 * workers  # threads in all, stuck ones included
        self._alive = 0  # threads started that have not left
        self._stuck = 0  # threads inside a load that was reported without them (replaced)
        self._started = 0
        self._threads: list[threading.Thread] = []
        with self._cond:
            for _ in range(workers):
                self._spawn()

    def submit(self, load: ChunkLoad) -> None:
        """Start ``load`` off the engine's thread (never blocks); after :meth:`close`, reported at once unrun."""
        job = _Job(load, self._clock() + self._deadline_s)
        with self._cond:
            self._in_flight += 1
            if self._closing:
                self._report(job, set())
                return
            self._queued.append(job)
            self._cond.notify()

    def cancel(self, req_ids: Iterable[str]) -> None:
        """The loads of requests that finished before their load completed: queued ones are reported now, running
        ones stop at their next chunk boundary. Requests whose loads were already reported are ignored."""
        ids = set(req_ids)
        with self._cond:
            for job in [job for job in self._queued if job.load.req_id in ids]:
                self._queued.remove(job)
                self._report(job, set())
            for job in self._running:
                if job.load.req_id in ids:
                    job.cancelled = True

    def finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads completed or expired since the last call, and the blocks those loads could not
        fill. Reports the loads past their deadline first (brief lock holds only: never waits for a write)."""
        now = self._clock()
        with self._cond:
            self._expire(now)
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
            expired, self._expired = self._expired, 0
        if expired and self._on_expired is not None:
            self._on_expired(expired)
        return done, failed

    def in_flight(self) -> int:
        """Loads handed over and not reported yet."""
        with self._cond:
            return self._in_flight

    def threads(self) -> int:
        """Fetch threads alive, stuck ones included (never more than twice the pool's size)."""
        with self._cond:
            return self._alive

    def close(self, timeout: float = 5.0) -> bool:
        """Cancel every load (queued ones are reported unrun, running ones stop at a chunk boundary) and wait up
        to ``timeout`` seconds for the threads; True when every one of them has left (none is inside a load)."""
        with self._cond:
            self._closing = True
            while self._queued:
                self._report(self._queued.popleft(), set())
            for job in self._running:
                job.cancelled = True
            self._cond.notify_all()
            threads = list(self._threads)
        return join_all(threads, timeout)

    # ------------------------------------------------------------ under the lock
    def _report(self, job: _Job, failed: set[int]) -> None:
        """Hand ``job``'s outcome to :meth:`finished`, once per job."""
        if job.reported:
            return
        job.reported = True
        self._done.add(job.load.req_id)
        if not job.cancelled:
            self._failed |= failed
        self._in_flight -= 1

    def _expire(self, now: float) -> None:
        """Report the loads past their deadline: queued ones with every block failed, running ones not writing
        (and whose last write is done on the device) with the blocks they have not filled failed; a running
        one that is writing is marked, and reported at the end of that write."""
        for job in [job for job in self._queued if now >= job.deadline]:
            self._queued.remove(job)
            self._mark_expired(job)
            self._report(job, job.load.blocks_from(0))
        for job in list(self._running):
            if not job.expired and now >= job.deadline:
                self._mark_expired(job)
            if job.expired and not job.reported and not job.writing and _written(job.event):
                self._report(job, job.load.blocks_from(job.filled))
                self._abandon(job)

    def _mark_expired(self, job: _Job) -> None:
        job.expired = True
        self._expired += 1
        self.expired_total += 1

    def _abandon(self, job: _Job) -> None:
        """``job`` was reported while its thread is inside it: free its place, start a replacement thread
        (within the cap); the thread leaves when its call returns."""
        job.abandoned = True
        self._retire(job)
        self._stuck += 1
        if not self._closing and self._alive - self._stuck < self._target and self._alive < self._cap:
            self._spawn()
        self._cond.notify_all()  # the request's next load may run now

    def _retire(self, job: _Job) -> None:
        if job.running:
            job.running = False
            self._running.remove(job)
            self._busy.discard(job.load.req_id)

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
        self._started += 1
        self._alive += 1
        self._threads.append(thread)
        thread.start()

    def _take(self) -> _Job | None:
        """The oldest queued load whose request no thread is loading (loads past their deadline are reported
        instead); None once closing."""
        while not self._closing:
            now = self._clock()
            for job in list(self._queued):
                if now >= job.deadline:
                    self._queued.remove(job)
                    self._mark_expired(job)
                    self._report(job, job.load.blocks_from(0))
                elif job.load.req_id not in self._busy:
                    self._queued.remove(job)
                    self._running.append(job)
                    job.running = True
                    self._busy.add(job.load.req_id)
                    return job
            self._cond.wait()
        return None

    def _finish(self, job: _Job, failed: set[int]) -> bool:
        """The thread's load returned: report it (unless it was already); False when the thread leaves."""
        if job.abandoned:  # replaced while it was stuck: leave, unless the cap kept the pool short
            self._stuck -= 1
            if self._closing or self._alive - self._stuck > self._target:
                self._alive -= 1
                return False
            return True
        self._retire(job)
        if job.expired:
            failed = failed | job.load.blocks_from(job.filled)
        self._report(job, failed)
        self._cond.notify_all()  # the request's next load may run now
        return True

    # ------------------------------------------------------------ the fetch threads
    def _work(self) -> None:
        stream = self._stream()
        while True:
            with self._cond:
                job = self._take()
                if job is None:
                    self._alive -= 1
                    return
            try:
                failed = self._run_on(stream, job)
            except BaseException as exc:  # noqa: BLE001 - a load that fails is recomputed; the thread goes on
                log.warning("scd-store: an asynchronous load of %r failed (recomputed): %s", job.load.model, exc)
                failed = job.load.blocks_from(0)
            with self._cond:
                if not self._finish(job, failed):
                    return

    def _stream(self) -> Any:
        return torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None

    def _run_on(self, stream: Any, job: _Job) -> set[int]:
        gate = _JobGate(self, job, stream)
        if stream is None:
            return self._run(job.load, gate)
        try:
            with torch.cuda.stream(stream):
                return self._run(job.load, gate)
        finally:
            stream.synchronize()  # the blocks hold the KV (or nothing is in flight) before the load is reported
