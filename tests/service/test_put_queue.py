"""The put queue: engine threads hand over and return; one worker encodes and stores; overflow is dropped."""

from __future__ import annotations

import threading

import pytest

from scd_store.service.put_queue import PutJob, PutQueue
from scd_store.store.stats import StoreStats


def job(tag: int, chunks: int = 1, log: list | None = None, **kwargs) -> PutJob:
    hashes = [bytes([tag, i]) * 8 for i in range(chunks)]
    return PutJob(f"m{tag}", hashes, lambda: [tag] * chunks,
                  release=lambda: log.append(("release", tag)) if log is not None else None, **kwargs)


def test_jobs_run_in_order_off_the_caller_and_release_their_memory():
    ran, log, done = [], [], []
    stats = StoreStats()
    queue = PutQueue(lambda j: (ran.append((threading.current_thread().name, j.model)), j.chunks)[1], stats)
    assert queue.submit(job(1, 2, log, done=done.append)) and queue.submit(job(2, 1, log, done=done.append))
    assert queue.drain(timeout=10)
    assert [m for _, m in ran] == ["m1", "m2"] and {t for t, _ in ran} == {"scd-store-put"}
    assert log == [("release", 1), ("release", 2)] and done == [2, 1]
    assert queue.close(timeout=1) == 0


def test_a_full_queue_drops_releases_and_counts_without_waiting(caplog):
    gate, log = threading.Event(), []
    stats = StoreStats()
    queue = PutQueue(lambda j: (gate.wait(10), j.chunks)[1], stats, max_chunks=3)
    first = job(1, 2, log)
    assert queue.submit(first) and queue.pending(first.hashes[0]) and queue.queued_chunks() == 2
    with caplog.at_level("WARNING"):
        assert not queue.submit(job(2, 2, log))  # 2 + 2 > 3: dropped at once
        assert not queue.submit(job(3, 2, log))
    assert ("release", 2) in log and ("release", 3) in log and stats.value("dropped_puts") == 4
    assert sum("put queue is full" in r.message for r in caplog.records) == 1  # logged once per incident
    gate.set()
    assert queue.drain(timeout=10) and not queue.pending(first.hashes[0])
    assert queue.submit(job(4, 3, log)) and queue.drain(timeout=10)
    queue.close()


def test_a_failing_job_does_not_stop_the_worker():
    stats = StoreStats()

    def run(j):
        if j.model == "m1":
            raise RuntimeError("tier exploded")
        return j.chunks

    done = []
    queue = PutQueue(run, stats)
    queue.submit(job(1, done=done.append))
    queue.submit(job(2, done=done.append))
    assert queue.drain(timeout=10) and done == [0, 1]
    queue.close()


def test_close_drops_what_it_cannot_store_in_time():
    gate, log = threading.Event(), []
    stats = StoreStats()
    queue = PutQueue(lambda j: (gate.wait(2), j.chunks)[1], stats)
    queue.submit(job(1, 1, log))
    queue.submit(job(2, 3, log))
    assert queue.close(timeout=0.1) == 4  # both still queued when the deadline passed
    gate.set()
    queue._thread.join(timeout=5)
    assert stats.value("dropped_puts") >= 3 and ("release", 2) in log
    assert not queue.submit(job(3, 1, log)) and ("release", 3) in log  # closed: nothing more is taken


def test_the_queue_needs_room():
    with pytest.raises(ValueError, match="max_chunks"):
        PutQueue(lambda j: 0, StoreStats(), max_chunks=0)


def test_the_queue_is_bounded_in_bytes_too():
    """A GPU engine's put holds pinned host copies of its KV: chunks of a large model must not pile up
    gigabytes, whatever the chunk bound says."""
    gate, log = threading.Event(), []
    stats = StoreStats()
    queue = PutQueue(lambda j: (gate.wait(10), j.chunks)[1], stats, max_chunks=100, max_bytes=1000)
    assert queue.submit(job(1, 1, log, nbytes=600)) and queue.queued_bytes() == 600
    assert not queue.submit(job(2, 1, log, nbytes=500))  # 600 + 500 > 1000: dropped, released, counted
    assert ("release", 2) in log and stats.value("dropped_puts") == 1
    assert queue.submit(job(3, 1, log, nbytes=400))
    gate.set()
    assert queue.drain(timeout=10) and queue.queued_bytes() == 0
    assert queue.submit(job(4, 1, log, nbytes=1000))
    queue.close(timeout=5)
    with pytest.raises(ValueError, match="max_bytes"):
        PutQueue(lambda j: 0, stats, max_bytes=0)
