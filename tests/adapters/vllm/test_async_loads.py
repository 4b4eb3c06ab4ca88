"""Hits the store holds only remotely load off the engine's step: the scheduler half says so to vLLM,
the worker half's fetch thread loads them and reports each one finished (failed blocks with it)."""

from __future__ import annotations

import threading
import time
import types

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.async_loads import AsyncLoads, OpenGate  # noqa: E402
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

    def run(job, stopped=None):
        threads.append(threading.current_thread().name)
        gate.wait(10)
        return {99} if job.req_id == "bad" else set()

    fetch = AsyncLoads(run)
    fetch.submit(load("ok"))
    fetch.submit(load("bad"))
    assert fetch.finished() == (set(), set()) and fetch.in_flight() == 2  # the caller did not wait
    deadline = time.monotonic() + 10
    while len(threads) < 2 and time.monotonic() < deadline:  # both start: the pool's two threads
        time.sleep(0.01)
    gate.set()
    done, failed = wait_done(fetch, 2)
    assert done == {"ok", "bad"} and failed == {99}
    assert sorted(threads) == ["scd-store-fetch-0", "scd-store-fetch-1"]  # one load each: the pool's two threads
    assert fetch.finished() == (set(), set())  # reported once
    fetch.close()


def test_a_load_that_raises_on_the_fetch_thread_is_reported_finished_with_all_its_blocks_failed():
    def run(job, stopped=None):
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
    worker._load_one = lambda job, stopped=None: 0  # the cache writes are covered elsewhere; here: the reporting
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


def _plan(side):
    return side.build(types.SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                            scheduled_cached_reqs=types.SimpleNamespace(
                                                req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                resumed_req_ids=set())))


def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


# ------------------------------------------------------------ cancellation (aborted requests)
def test_a_request_finished_while_its_load_is_in_flight_has_the_load_cancelled_by_the_next_plan():
    side = _side(Lookup(3, 1))
    for req_id in ("aborted", "loaded"):
        assert side.match(request(req_id), 0) == (3 * CHUNK, True)
        side.after_alloc(request(req_id), list(range(8)), 3 * CHUNK)
    assert [x.req_id for x in _plan(side).loads] == ["aborted", "loaded"]
    side.loads_finished({"loaded"})  # the workers reported it (vLLM's finished_recving)
    side.finished(request("aborted"))
    side.finished(request("loaded"))
    assert _plan(side).cancelled == ["aborted"]  # the load already reported is not cancelled
    assert _plan(side).cancelled == []  # once
    local = _side(Lookup(3, 0))
    assert local.match(request("sync"), 0) == (3 * CHUNK, False)
    local.after_alloc(request("sync"), list(range(8)), 3 * CHUNK)
    local.finished(request("sync"))
    assert _plan(local).cancelled == []  # a synchronous load completed within its step


def test_cancelled_loads_are_skipped_when_queued_stopped_when_running_and_each_reported_once():
    started, ran, reports = threading.Event(), [], []

    def run(job, stopped):
        ran.append(job.req_id)
        if job.req_id == "running":
            started.set()
            assert _until(stopped)  # a chunk boundary: the load looks, and stops
            return set(job.block_ids)  # its blocks were left unwritten: not reported (the request is gone)
        return set()

    fetch = AsyncLoads(run, workers=1)
    fetch.submit(load("running"))
    fetch.submit(load("queued"))
    fetch.submit(load("other"))
    assert started.wait(10)
    fetch.cancel(["queued", "running", "never-handed-over"])
    reports.append(fetch.finished())
    assert reports[0] == ({"queued"}, set())  # reported at once, never run
    assert _until(lambda: reports.append(fetch.finished()) or fetch.in_flight() == 0)
    reports.append(fetch.finished())
    fetch.cancel(["running", "other"])  # after their report: ignored
    reports.append(fetch.finished())
    assert ran == ["running", "other"]
    assert sorted(r for done, _ in reports for r in done) == ["other", "queued", "running"]  # each once
    assert set().union(*(failed for _, failed in reports)) == set()
    assert fetch.close()


def test_a_cancelled_load_writes_no_block_past_the_chunk_boundary_it_stopped_at():
    import torch

    from scd_store.adapters.vllm.paged_layout import probe, read_tokens
    from scd_store.adapters.vllm.plan import slots_of
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim, chunk = 32, 3, 64, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(8, heads, block, 2 * dim) for _ in layers]
    cancelled = threading.Event()

    def get(model, hashes, into):
        states = []
        for i in range(len(hashes)):
            buffers = into(i, chunk)
            if buffers is None:  # the run ends there (the service's decode loop)
                break
            buffers[0].fill_(i + 1)
            buffers[1].fill_(i + 1)
            states.append(i)
            if i == 1:
                cancelled.set()  # the request was aborted while chunk 1 decoded
        return states

    worker = WorkerSide(types.SimpleNamespace(get=get))
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    blocks = [7, 2, 5, 0, 3, 6]
    job = ChunkLoad("r", "consumer", [bytes([i]) * 16 for i in range(3)], chunk, 0, blocks, block, True)
    assert worker._load_one(job, OpenGate(cancelled.is_set)) == chunk  # chunk 0 written; chunks 1 and 2 not
    keys, _ = read_tokens(probe(layers[0], caches[0]), caches[0], torch.tensor(slots_of(blocks, block, 0, 3 * chunk)))
    assert bool((keys[:chunk] == 1).all()) and bool((keys[chunk:] == 0).all())
    assert worker._load_one(job, OpenGate(lambda: True)) == 0  # cancelled before it started: nothing fetched


def test_the_connector_hands_a_plan_with_only_cancellations_to_the_worker_and_tracks_reported_loads():
    from vllm.v1.outputs import KVConnectorOutput

    from scd_store.adapters.vllm.connector import ScdConnector

    handed, reported = [], []
    connector = ScdConnector.__new__(ScdConnector)
    connector._worker = types.SimpleNamespace(load=handed.append)
    connector._scheduler = types.SimpleNamespace(loads_finished=lambda ids: reported.append(set(ids)))
    connector.bind_connector_metadata(StepPlan(cancelled=["r"]))
    connector.start_load_kv(None)
    assert [plan.cancelled for plan in handed] == [["r"]]
    connector.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    connector.update_connector_output(KVConnectorOutput())
    assert reported == [{"a"}, set()]


# ------------------------------------------------------------ the pool
def test_a_slow_remote_load_does_not_hold_up_another_requests_load():
    slow = threading.Event()

    def run(job, stopped=None):
        if job.req_id == "slow":
            slow.wait(10)
        return set()

    fetch = AsyncLoads(run)
    fetch.submit(load("slow"))
    fetch.submit(load("fast"))
    done, _ = wait_done(fetch, 1)
    assert done == {"fast"} and fetch.in_flight() == 1  # while the slow one still waits on its link
    slow.set()
    assert wait_done(fetch, 1)[0] == {"slow"}
    assert fetch.close()


def test_loads_of_one_request_run_one_at_a_time_in_the_order_they_came():
    events, lock = [], threading.Lock()

    def run(job, stopped=None):
        with lock:
            events.append(("start", job.req_id, len(job.hashes)))
        time.sleep(0.05)
        with lock:
            events.append(("end", job.req_id, len(job.hashes)))
        return set()

    fetch = AsyncLoads(run, workers=3)
    fetch.submit(load("r", chunks=1))
    fetch.submit(load("r", chunks=2))
    fetch.submit(load("s", chunks=1))
    assert _until(lambda: fetch.in_flight() == 0)
    mine = [e for e in events if e[1] == "r"]
    assert mine == [("start", "r", 1), ("end", "r", 1), ("start", "r", 2), ("end", "r", 2)]
    assert fetch.close()


def test_each_fetch_thread_has_its_own_stream_synchronised_before_its_load_is_reported(monkeypatch):
    import contextlib

    import torch

    streams = []

    class Stream:
        def __init__(self, device):
            self.thread, self.synced = threading.current_thread().name, []
            streams.append(self)

        def synchronize(self):
            self.synced.append(fetch.in_flight())  # the load it ran is not reported yet

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def run(job, stopped=None):
        if job.req_id == "bad":
            raise RuntimeError("the peer went away")
        return set()

    fetch = AsyncLoads(run, device=torch.device("cuda", 0))
    fetch.submit(load("bad"))
    fetch.submit(load("ok"))
    done, failed = wait_done(fetch, 2)
    assert done == {"bad", "ok"} and failed == set(load("bad").block_ids)
    assert fetch.close()
    assert sorted(s.thread for s in streams) == ["scd-store-fetch-0", "scd-store-fetch-1"]
    assert sum(len(s.synced) for s in streams) == 2 and all(n >= 1 for s in streams for n in s.synced)


# ------------------------------------------------------------ shutdown
def test_close_cancels_queued_loads_stops_the_running_one_at_a_chunk_boundary_and_reports_them():
    started, ran = threading.Event(), []

    def run(job, stopped):
        ran.append(job.req_id)
        started.set()
        assert _until(stopped)
        return set(job.block_ids)

    fetch = AsyncLoads(run, workers=1)
    fetch.submit(load("running"))
    fetch.submit(load("queued"))
    assert started.wait(10)
    assert fetch.close(timeout=10) is True  # every thread left: nothing is inside a load
    assert ran == ["running"] and fetch.finished() == ({"running", "queued"}, set())
    fetch.submit(load("late"))  # after close: reported at once, never run
    assert fetch.finished() == ({"late"}, set()) and ran == ["running"]


def test_close_says_so_when_a_thread_is_still_inside_a_load():
    stuck, inside = threading.Event(), threading.Event()

    def run(job, stopped):
        inside.set()
        stuck.wait(10)  # a remote get that does not look at stopped() (a hung socket)
        return set()

    fetch = AsyncLoads(run)
    fetch.submit(load("r"))
    assert inside.wait(10)
    assert fetch.close(timeout=0.1) is False
    stuck.set()
    assert _until(lambda: fetch.in_flight() == 0)


def test_shutdown_leaves_the_service_open_while_a_load_thread_is_inside_a_load(caplog):
    from scd_store.adapters.vllm.connector import ScdConnector

    for idle in (False, True):
        released = []
        connector = ScdConnector.__new__(ScdConnector)
        connector._scheduler = types.SimpleNamespace(close=lambda timeout=None: True)
        connector._worker = types.SimpleNamespace(close=lambda timeout=None, idle=idle: idle)
        connector.service = service = object()
        connector._close_service = released.append
        with caplog.at_level("WARNING", logger="scd_store.adapters.vllm"):
            caplog.clear()
            connector.shutdown()
            connector.shutdown()  # vLLM may call it again: nothing more happens
        assert released == ([service] if idle else [])
        assert sum("left open" in r.getMessage() for r in caplog.records) == (0 if idle else 1)
