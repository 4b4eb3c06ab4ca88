"""Loads off the engine's step: :class:`AsyncLoads`, a small pool of fetch threads for the hits the store holds
remotely.

A consumer hit whose chunks only a remote tier (Redis, a peer) holds would make the whole batch wait
on the network if it were loaded before the step's forward. vLLM lets a connector load such a
request between steps instead: the scheduler parks it (``WAITING_FOR_REMOTE_KVS``, its blocks
reserved for it alone), a fetch thread fetches, decodes and writes its blocks while the other
requests keep running, and the worker reports it through ``get_finished`` once its blocks hold
the KV, with the blocks it could not fill reported as load errors in the same step (vLLM recomputes
them). Every load handed over is reported exactly once, failed, cancelled or not: vLLM frees an
aborted request's blocks only then (``Scheduler.finish_requests`` delays the free of a request still
``WAITING_FOR_REMOTE_KVS``), and a second report of a freed request trips its scheduler's assertion.

Loads run on ``workers`` threads (2 by default), so a slow remote load does not hold up another
request's; loads of one request run one at a time, in the order they came. A request that finished
(aborted) before its load completed is cancelled (:meth:`AsyncLoads.cancel`): a queued load is
reported at once without running, a running one stops at its next chunk boundary (``stopped()``
turns true) without writing more blocks. Neither reports failed blocks: vLLM frees the blocks of a
finished request uncached. On a GPU each thread writes on a CUDA stream of its own, synchronised
before its load is reported, also when the load raised. :meth:`AsyncLoads.close` cancels everything
and says whether every thread left in time (the caller keeps the service open when one did not).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from scd_store.adapters.vllm.plan import ChunkLoad
from scd_store.adapters.vllm.threads import join_all, start_threads

log = logging.getLogger("scd_store.adapters.vllm")

# run(load, stopped) -> the blocks it could not fill; stopped() turns true once the load was cancelled
Run = Callable[[ChunkLoad, Callable[[], bool]], set[int]]


@dataclass(slots=True, eq=False)
class _Job:
    """A load handed over, until it is reported."""

    load: ChunkLoad
    cancelled: bool = False

    def stopped(self) -> bool:
        return self.cancelled


class AsyncLoads:
    """Runs ``run(load, stopped) -> blocks that failed`` on fetch threads; :meth:`finished` collects the outcomes."""

    def __init__(self, run: Run, device: torch.device | None = None, name: str = "scd-store-fetch",
                 workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"an asynchronous load pool needs a thread, got workers={workers}")
        self._run = run
        self._device = device if device is not None else torch.device("cpu")
        self._cond = threading.Condition()
        self._queued: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._busy: set[str] = set()  # requests a thread is loading (their next load waits for it)
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._in_flight = 0
        self._closing = False
        self._threads = start_threads(self._work, name, workers)

    def submit(self, load: ChunkLoad) -> None:
        """Start ``load`` off the engine's thread (never blocks); after :meth:`close`, reported at once unrun."""
        job = _Job(load)
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
        """Requests whose loads completed since the last call, and the blocks those loads could not fill."""
        with self._cond:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def in_flight(self) -> int:
        """Loads handed over and not reported yet."""
        with self._cond:
            return self._in_flight

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
        return join_all(self._threads, timeout)

    def _report(self, job: _Job, failed: set[int]) -> None:
        """Hand ``job``'s outcome to :meth:`finished` (under the lock; once per job)."""
        self._done.add(job.load.req_id)
        if not job.cancelled:
            self._failed |= failed
        self._in_flight -= 1

    def _take(self) -> _Job | None:
        """The oldest queued load whose request no thread is loading; None once closing (under the lock)."""
        while not self._closing:
            for job in self._queued:
                if job.load.req_id not in self._busy:
                    self._queued.remove(job)
                    self._running.append(job)
                    self._busy.add(job.load.req_id)
                    return job
            self._cond.wait()
        return None

    def _work(self) -> None:
        stream = self._stream()
        while True:
            with self._cond:
                job = self._take()
            if job is None:
                return
            try:
                failed = self._run_on(stream, job)
            except BaseException as exc:  # noqa: BLE001 - a load that fails is recomputed; the thread goes on
                log.warning("scd-store: an asynchronous load of %r failed (recomputed): %s", job.load.model, exc)
                failed = job.load.blocks_from(0)
            with self._cond:
                self._running.remove(job)
                self._busy.discard(job.load.req_id)
                self._report(job, failed)
                self._cond.notify_all()  # the request's next load may run now

    def _stream(self) -> Any:
        return torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None

    def _run_on(self, stream: Any, job: _Job) -> set[int]:
        if stream is None:
            return self._run(job.load, job.stopped)
        try:
            with torch.cuda.stream(stream):
                return self._run(job.load, job.stopped)
        finally:
            stream.synchronize()  # the blocks hold the KV (or nothing is in flight) before the load is reported
