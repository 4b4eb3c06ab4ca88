"""Hits the store holds only remotely load off the engine's step: the scheduler half says so to vLLM,
the worker half's fetch thread loads them and reports each one finished (failed blocks with it)."""

from __future__ import annotations

import threading
import time
import types

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.async_loads import AsyncLoads  # noqa: E402
from scd_store.adapters.vllm.plan import ChunkLoad, StepPlan  # noqa: E402
from scd_store.adapters.vllm.scheduler_side import SchedulerSide  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide  # noqa: E402
from scd_store.service import Lookup  # noqa: E402
from tests.adapters.vllm.test_scheduler_side import BLOCK, CHUNK, PROMPT, request  # noqa: E402


def load(req_id="r", chunks=2, asynchronous=True):
    return ChunkLoad(req_id, "consumer-a", [bytes([i]) * 16 for i in range(chunks)], CHUNK, 0,
                     list(range(chunks * CHUNK // BLOCK)), BLOCK, asynchronous)


def wait_done(fetch, n=1, timeout=10.0):
    done, failed = set(), set()
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        more, bad = fetch.finished()
        done |= more
        failed |= bad
        time.sleep(0.01)
    return done, failed


def _side(lookup):
    service = types.SimpleNamespace(chunk_size=CHUNK, lookup=lambda model, hashes, tokens=None: lookup,
                                    binding=lambda model: types.SimpleNamespace(role="consumer"),
                                    readable_by_others=lambda *a: 0, incidents=lambda log: None)
    return SchedulerSide(service, "consumer-a", BLOCK)


def test_a_hit_held_remotely_is_loaded_asynchronously_and_a_local_one_is_not():
    assert _side(Lookup(3, 0)).match(request("a"), 0) == (3 * CHUNK, False)
    remote = _side(Lookup(3, 1))
    assert remote.match(request("b"), 0) == (3 * CHUNK, True)
    remote.after_alloc(request("b"), list(range(8)), 3 * CHUNK)
    remote.after_alloc(request("b"), list(range(8)), 0)  # vLLM's second call, once the load is done: no new plan
    plan = remote.build(types.SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                              scheduled_cached_reqs=types.SimpleNamespace(
                                                  req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                  resumed_req_ids=set())))
    assert [(x.req_id, x.asynchronous) for x in plan.loads] == [("b", True)]
    off = _side(Lookup(3, 1))
    off.async_loads = False
    assert off.match(request("c"), 0) == (3 * CHUNK, False)
    assert _side(Lookup(0, 0)).match(request("d"), 0) == (0, False)  # never (0, True): vLLM forbids it
    assert len(PROMPT) > 3 * CHUNK


def test_the_fetch_thread_runs_loads_off_the_caller_and_reports_each_once():
    gate, threads = threading.Event(), []

    def run(job):
        threads.append(threading.current_thread().name)
        gate.wait(10)
        return {99} if job.req_id == "bad" else set()

    fetch = AsyncLoads(run)
    fetch.submit(load("ok"))
    fetch.submit(load("bad"))
    assert fetch.finished() == (set(), set()) and fetch.in_flight() == 2  # the caller did not wait
    gate.set()
    done, failed = wait_done(fetch, 2)
    assert done == {"ok", "bad"} and failed == {99} and threads == ["scd-store-fetch"] * 2
    assert fetch.finished() == (set(), set())  # reported once
    fetch.close()


def test_a_load_that_raises_on_the_fetch_thread_is_reported_finished_with_all_its_blocks_failed():
    def run(job):
        raise RuntimeError("the remote tier went away")

    fetch = AsyncLoads(run)
    job = load("r")
    fetch.submit(job)
    done, failed = wait_done(fetch)
    assert done == {"r"} and failed == set(job.block_ids)
    fetch.close()


def test_the_worker_reports_finished_loads_and_their_failed_blocks_in_the_same_step():
    calls = []

    def get(model, hashes, into):
        calls.append(threading.current_thread().name)
        return []  # the remote tier lost them since the lookup: nothing decoded

    worker = WorkerSide(types.SimpleNamespace(get=get, observe=lambda *a: None))
    worker.caches = []
    sync, remote = load("s", asynchronous=False), load("a")
    worker._load_one = lambda job: 0  # the cache writes are covered elsewhere; here: the reporting
    worker.load(StepPlan(loads=[sync, remote]))
    assert worker.failed_blocks() == set(sync.block_ids)  # the sync load's failure: this step
    deadline = time.monotonic() + 10
    done = set()
    while not done and time.monotonic() < deadline:
        done = worker.finished_loads()
        time.sleep(0.01)
    assert done == {"a"} and worker.failed_blocks() == set(remote.block_ids)
    worker.close()


def test_a_request_whose_load_was_planned_is_not_offered_another():
    """A tier that answers lookups but fails gets (a timeout on a slow link) made vLLM reschedule the
    request after each failed load and the connector offer the same hit again, forever: one load per
    request, then the engine computes it."""
    side = _side(Lookup(3, 1))
    assert side.match(request("r"), 0) == (3 * CHUNK, True)
    assert side.match(request("r"), 0) == (3 * CHUNK, True)  # asked again while it waits for blocks: same offer
    side.after_alloc(request("r"), list(range(8)), 3 * CHUNK)
    assert side.match(request("r"), 0) == (0, False)  # the load failed and vLLM rescheduled it
    side.finished(request("r"))
    assert side.match(request("r"), 0) == (3 * CHUNK, True)  # a new request of that id starts afresh
