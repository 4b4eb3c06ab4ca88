"""Producers' chunks are encoded and stored off the engine's thread: :class:`PutQueue` runs :class:`PutJob`.

An engine thread hands over a :class:`PutJob` and returns at once. One worker thread builds the
job's states (so even the conversion from the engine's layout runs off the engine's thread),
encodes and stores them. The queue is bounded in chunks and in bytes (the engine's KV a job holds:
on a GPU engine, pinned host memory): a job that does not fit is dropped,
released at once and counted (``dropped_puts``); the engine's own cache still has the KV, so a
drop costs a later consumer a miss, never a wrong answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scd_store.codecs.kv_state import KVState
from scd_store.service.defaults import PUT_QUEUE_BYTES, PUT_QUEUE_CHUNKS
from scd_store.store.log_once import Incidents
from scd_store.store.stats import StoreStats

log = logging.getLogger("scd_store.service")


def _nothing() -> None:
    return None


@dataclass(slots=True)
class PutJob:
    """One batch of a producer's chunks: ``states()`` builds them on the worker (None: nothing to
    store), ``release()`` gives the engine's memory back, ``done(stored)`` reports the outcome;
    ``nbytes``: the memory the job holds until it has run (its copies of the engine's KV)."""

    model: str
    hashes: Sequence[bytes]
    states: Callable[[], Sequence[KVState] | None]
    release: Callable[[], None] = field(default=_nothing)
    done: Callable[[int], None] | None = None
    nbytes: int = 0

    @property
    def chunks(self) -> int:
        return len(self.hashes)


class PutQueue:
    """A queue of :class:`PutJob` bounded in chunks and bytes, and the worker thread that runs them with
    ``run(job) -> stored``."""

    def __init__(self, run: Callable[[PutJob], int], stats: StoreStats, *, max_chunks: int = PUT_QUEUE_CHUNKS,
                 max_bytes: int = PUT_QUEUE_BYTES, name: str = "scd-store-put") -> None:
        if max_chunks <= 0:
            raise ValueError(f"max_chunks must be positive, got {max_chunks}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes
        self._run = run
        self._stats = stats
        self._incidents = Incidents(stats, log)
        self._queue: queue.Queue[PutJob | None] = queue.Queue()
        self._lock = threading.Condition()
        self._queued_chunks = 0
        self._queued_bytes = 0
        self._pending: dict[bytes, int] = {}  # hash -> jobs holding it (queued or running)
        self._dropping = False
        self._closed = False
        self._abort = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: PutJob) -> bool:
        """Queue ``job`` if its chunks and bytes fit; otherwise release it, count it and return False. Never
        blocks."""
        with self._lock:
            fits = self._room(job.chunks, job.nbytes)
            if fits:
                self._queued_chunks += job.chunks
                self._queued_bytes += job.nbytes
                for h in job.hashes:
                    self._pending[h] = self._pending.get(h, 0) + 1
                if self._dropping:
                    self._dropping = False
                    log.warning("scd-store: the put queue has room again")
        if not fits:
            self._drop(job)
            return False
        self._queue.put(job)
        return True

    def _drop(self, job: PutJob) -> None:
        self._stats.inc("dropped_puts", job.chunks)
        with self._lock:
            first = not self._dropping
            self._dropping = True
        if first:
            log.warning("scd-store: the put queue is full (%d chunks, %d bytes) or closed; dropping puts until it "
                        "has room (counted as dropped_puts)", self.max_chunks, self.max_bytes)
        self._finish(job, 0, queued=False)

    def pending(self, chunk_hash: bytes) -> bool:
        """Whether a chunk with this hash is queued or being stored."""
        with self._lock:
            return chunk_hash in self._pending

    def queued_chunks(self) -> int:
        with self._lock:
            return self._queued_chunks

    def fits(self, chunks: int, nbytes: int) -> bool:
        """Whether a job of ``chunks`` holding ``nbytes`` would be queued now."""
        with self._lock:
            return self._room(chunks, nbytes)

    def _room(self, chunks: int, nbytes: int) -> bool:  # under the lock
        return not self._closed and self._queued_chunks + chunks <= self.max_chunks \
            and self._queued_bytes + nbytes <= self.max_bytes

    def queued_bytes(self) -> int:
        with self._lock:
            return self._queued_bytes

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queued_chunks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float | None = None) -> int:
        """Stop taking jobs, run what is queued (up to ``timeout``), stop the worker; returns the chunks
        that were still queued then (dropped and counted)."""
        with self._lock:
            self._closed = True
        self.drain(timeout)
        with self._lock:
            self._abort = True
            left = self._queued_chunks
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        if left:
            log.warning("scd-store: closed with %d chunks still queued: dropped", left)
        return left

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._abort:
                self._stats.inc("dropped_puts", job.chunks)
                self._finish(job, 0)
                continue
            stored = 0
            try:
                stored = self._run(job)
            except Exception as exc:  # one bad batch must not stop the worker
                self._incidents.count("failed_puts", "scd-store: storing %d chunks of %r failed (counted as "
                                      "failed_puts; logged once per model and error): %s", job.chunks, job.model,
                                      exc, n=job.chunks, once=f"failed:{job.model}:{type(exc).__name__}")
            self._finish(job, stored)

    def _finish(self, job: PutJob, stored: int, queued: bool = True) -> None:
        try:
            job.release()
        except Exception as exc:
            log.warning("scd-store: releasing an engine's memory failed: %s", exc)
        if job.done is not None:
            try:
                job.done(stored)
            except Exception as exc:  # the engine's callback must not break the worker
                log.warning("scd-store: an engine's put callback failed: %s", exc)
        with self._lock:
            if queued:
                self._queued_chunks -= job.chunks
                self._queued_bytes -= job.nbytes
                for h in job.hashes:
                    left = self._pending.get(h, 0) - 1
                    if left > 0:
                        self._pending[h] = left
                    else:
                        self._pending.pop(h, None)
            self._lock.notify_all()
