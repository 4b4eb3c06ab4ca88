"""Asynchronous loads are fair and bounded: each has a deadline, a slow tier holding every fetch thread cannot
delay another request's load past its own deadline, and a load reported (expired, cancelled, done) writes
no block afterwards. Played with real threads, the engine's thread polling ``finished`` as ``get_finished``
does each step."""

from __future__ import annotations

import random
import threading
import time
import types

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.async_loads import AsyncLoads, load_workers  # noqa: E402
from scd_store.adapters.vllm.plan import ChunkLoad  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide  # noqa: E402
from tests.adapters.vllm.test_async_loads import load  # noqa: E402
from tests.adapters.vllm.test_scheduler_side import CHUNK  # noqa: E402


def engine_poll(fetch, until, timeout=10.0, every=0.005, started=None):
    """Poll ``fetch.finished()`` as vLLM's engine does each step; ``{req: (seconds since started, failed
    blocks)}`` when ``until(reports)``; also the slowest single call (the engine's thread must never wait)."""
    started = time.monotonic() if started is None else started
    reports, slowest = {}, 0.0
    while time.monotonic() - started < timeout:
        t0 = time.perf_counter()
        done, failed = fetch.finished()
        slowest = max(slowest, time.perf_counter() - t0)
        for req in done:
            assert req not in reports, f"{req} reported twice"
            reports[req] = (time.monotonic() - started, failed)
        if until(reports):
            break
        time.sleep(every)
    return reports, slowest


# ------------------------------------------------------------ the pool's size
def test_the_pool_is_sized_from_the_engines_config():
    assert [load_workers(0, n) for n in (1, 8, 16, 32, 64, 128, 256, 1024)] == [2, 2, 2, 4, 8, 8, 8, 8]
    assert load_workers(3, 256) == 3  # set: taken as it is
    fetch = AsyncLoads(lambda job, gate: set(), workers=load_workers(0, 32))
    assert fetch.threads() == 4
    assert fetch.close()


def test_the_connector_derives_its_fetch_threads_and_deadline_from_vllm_config(tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from scd_store.adapters.vllm import connector as module
    from tests.adapters.vllm.vllm_scheduler import _config

    monkeypatch.setattr(module, "acquire_service", lambda settings: settings)
    vllm_config, kv_config = _config(tmp_path / "model")
    seen = []
    for seqs, extra, expect in ((8, {}, 2), (256, {}, 8), (256, {"load_workers": 3, "load_deadline_s": 1.5}, 3)):
        vllm_config.scheduler_config.max_num_seqs = seqs
        connector = module.ScdConnector.__new__(module.ScdConnector)
        KVConnectorBase_V1.__init__(connector, vllm_config=vllm_config, role=KVConnectorRole.WORKER,
                                    kv_cache_config=kv_config)
        connector.max_positions = 1024
        connector._open_service(extra)
        seen.append((connector.load_workers, connector.load_deadline_s))
        assert connector.load_workers == expect
    assert seen[-1] == (3, 1.5) and seen[0][1] == 5.0  # the default deadline


# ------------------------------------------------------------ fairness
def test_slow_loads_holding_every_thread_cannot_delay_another_requests_load_past_its_deadline():
    """Measured before the deadlines: two 3 s loads of a slow tier on the pool's two threads delayed a third
    request's 10 ms load to 3 s. Now they are reported at their deadline, replacement threads start, and the
    fast load runs at once."""
    release, entered = threading.Event(), []

    def run(job, gate):
        entered.append(job.req_id)
        if job.req_id.startswith("slow"):
            release.wait(3.0)  # inside a store call that cannot be interrupted (a hung socket)
            assert not gate.begin_write()  # reported meanwhile: no write
            return set()
        time.sleep(0.01)
        return set()

    expired = []
    fetch = AsyncLoads(run, workers=2, deadline_s=1.0, on_expired=expired.append)
    submitted = time.monotonic()
    fetch.submit(load("slow-a"))
    fetch.submit(load("slow-b"))
    time.sleep(0.5)
    fetch.submit(load("fast"))  # its deadline: 1.5 s after the first submit
    reports, slowest = engine_poll(fetch, lambda r: len(r) == 3, started=submitted)
    fast_at, fast_failed = reports["fast"]
    assert set(reports) == {"slow-a", "slow-b", "fast"}
    assert fast_at < 1.5 and fast_failed == set()  # loaded (not failed) before its own deadline
    assert reports["slow-a"][1] == load("slow-a").blocks_from(0)  # nothing filled: every block recomputed
    assert 0.95 < reports["slow-a"][0] < 1.4
    assert sum(expired) == 2 and fetch.threads() <= 4  # two stuck threads and their replacements at most
    assert slowest < 0.2  # the engine's thread never waited (for a 3 s load, or a thread)
    release.set()
    deadline = time.monotonic() + 10
    while fetch.threads() > 2 and time.monotonic() < deadline:  # the stuck threads leave once they return
        time.sleep(0.01)
    assert fetch.threads() == 2 and fetch.in_flight() == 0
    print(f"fast load reported {fast_at - 0.5:.3f} s after its submit; slow loads reported at "
          f"{reports['slow-a'][0]:.3f} s; all done after {time.monotonic() - submitted:.3f} s")
    assert fetch.close()


def test_a_queued_load_past_its_deadline_is_reported_with_every_block_failed_when_threads_are_capped():
    """Every thread stuck and the replacement cap reached: queued loads are still reported at their deadline."""
    release = threading.Event()

    def run(job, gate):
        release.wait(5.0)
        return set()

    fetch = AsyncLoads(run, workers=1, deadline_s=0.3)
    for req in ("a", "b", "c", "d"):
        fetch.submit(load(req))
    reports, _ = engine_poll(fetch, lambda r: len(r) == 4)
    assert set(reports) == {"a", "b", "c", "d"} and all(t < 1.0 for t, _ in reports.values())
    assert fetch.threads() <= 2
    release.set()
    assert fetch.close(timeout=10)


# ------------------------------------------------------------ no write after the report
def _cpu_worker(get=None, get_paged=None, deadline_s=0.3):
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim = 32, 3, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(8, heads, block, 2 * dim) for _ in layers]
    counted = []
    service = types.SimpleNamespace(get=get, get_paged=get_paged, observe=lambda *a: None,
                                    incidents=lambda log: types.SimpleNamespace(
                                        count=lambda name, *a, n=1, **k: counted.append((name, n))))
    worker = WorkerSide(service, load_workers=1, load_deadline_s=deadline_s)
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    return worker, caches, counted


def _snapshot(caches):
    return [c.clone() for c in caches]


def test_a_load_whose_decode_outlives_its_deadline_writes_no_block_after_it_is_reported(monkeypatch):
    from scd_store.adapters.vllm import worker_side

    writes, reported, decoding = [], threading.Event(), threading.Event()
    real_write = worker_side.write_tokens

    def write_tokens(*args):
        writes.append(time.monotonic())
        return real_write(*args)

    monkeypatch.setattr(worker_side, "write_tokens", write_tokens)

    def get(model, hashes, into):  # the service's decode loop: chunk 1's decode is slow
        states = []
        for i in range(len(hashes)):
            buffers = into(i, 64)
            if buffers is None:
                break
            buffers[0].fill_(i + 1)
            buffers[1].fill_(i + 1)
            if i == 1:
                decoding.set()
                assert reported.wait(10)  # the deadline passed mid-decode and the engine reported the load
            states.append(i)
        return states

    worker, caches, counted = _cpu_worker(get=get)
    job = ChunkLoad("r", "consumer", [bytes([i]) * 16 for i in range(3)], 64, 0, [7, 2, 5, 0, 3, 6], 32, True)
    worker.load(types.SimpleNamespace(loads=[job], cancelled=[]))
    assert decoding.wait(10)
    done, deadline = set(), time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = worker.finished_loads()  # vLLM's get_finished, each step
        time.sleep(0.005)
    at, before = time.monotonic(), _snapshot(caches)
    assert done == {"r"} and worker.failed_blocks() == {5, 0, 3, 6}  # chunk 0 (blocks 7, 2) was written
    reported.set()
    assert worker.close(10)  # the thread has left: whatever it would do, it did
    assert writes and all(t < at for t in writes)  # every write happened before the report
    assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))  # nothing changed since
    assert counted == [("load_deadlines", 1)]


class _PagedCaches:
    device = torch.device("cpu")


def test_a_load_that_expires_while_writing_is_reported_at_the_end_of_that_chunk_and_writes_no_more():
    """The paged path decodes straight into the blocks: a chunk's write spans its decode. The deadline passes
    mid-write; the engine's thread does not wait for it, and the report comes when the chunk is written."""
    blocks = torch.zeros(3 * 64, dtype=torch.int64)
    writing, finish, log = threading.Event(), threading.Event(), []

    def get_paged(model, hashes, into):
        written = 0
        for i in range(len(hashes)):
            slots = into.slots(i, 64)
            if slots is None:
                break
            log.append(("write", i, time.monotonic()))
            blocks[slots] = i + 1
            if i == 1:
                writing.set()
                assert finish.wait(10)  # still writing chunk 1 while its deadline passes
                log.append(("written", i, time.monotonic()))
            written += 1
        return written

    worker, _, counted = _cpu_worker(get_paged=get_paged, deadline_s=0.2)
    worker._paged = (_PagedCaches(),)
    job = ChunkLoad("p", "consumer", [bytes([i]) * 16 for i in range(3)], 64, 0, [0, 1, 2, 3, 4, 5], 32, True)
    worker.load(types.SimpleNamespace(loads=[job], cancelled=[]))
    assert writing.wait(10)
    time.sleep(0.3)  # past the deadline, mid-write
    slowest = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        assert worker.finished_loads() == set()  # writing: not reported, and the call did not wait
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.005)
    finish.set()
    done, deadline = set(), time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = worker.finished_loads()
        time.sleep(0.005)
    assert done == {"p"} and worker.failed_blocks() == {4, 5}  # chunks 0 and 1 are in their blocks
    assert worker.close(10)
    assert [e[:2] for e in log] == [("write", 0), ("write", 1), ("written", 1)]  # chunk 2 never written
    assert bool((blocks[:128] > 0).all()) and bool((blocks[128:] == 0).all())
    assert slowest < 0.2 and counted == [("load_deadlines", 1)]


def test_each_load_is_reported_once_and_never_written_after_under_cancel_and_expiry_races():
    rng = random.Random(7)
    state = {"writing": set(), "after": []}
    guard = threading.Lock()
    reported: set[str] = set()

    def run(job, gate):
        for chunk in range(4):
            time.sleep(rng.uniform(0, 0.01))  # a fetch, a decode
            if gate() or not gate.begin_write():
                return job.blocks_from(chunk * CHUNK)
            with guard:
                if job.req_id in reported:
                    state["after"].append(job.req_id)
                state["writing"].add(job.req_id)
            time.sleep(rng.uniform(0, 0.005))  # the write
            with guard:
                state["writing"].discard(job.req_id)
            gate.end_write((chunk + 1) * CHUNK)
        return set()

    for round_ in range(3):
        fetch = AsyncLoads(run, workers=2, deadline_s=0.03 + 0.02 * round_)
        ids = [f"{round_}-{i}" for i in range(40)]
        for req in ids:
            fetch.submit(load(req, chunks=4))
        counts: dict[str, int] = {}
        deadline = time.monotonic() + 20
        while len(counts) < len(ids) and time.monotonic() < deadline:
            fetch.cancel(rng.sample(ids, 3))  # aborts, some of loads already reported
            done, _ = fetch.finished()
            with guard:
                assert not done & state["writing"], "reported while a write into its blocks was under way"
                reported.update(done)
            for req in done:
                counts[req] = counts.get(req, 0) + 1
            time.sleep(0.002)
        assert fetch.close(10)
        done, _ = fetch.finished()
        for req in done:
            counts[req] = counts.get(req, 0) + 1
        assert counts == dict.fromkeys(ids, 1) and fetch.in_flight() == 0
    assert state["after"] == []


def test_on_a_gpu_a_load_is_reported_only_once_its_last_write_is_done_on_the_device(monkeypatch):
    import contextlib

    done_on_device, events = threading.Event(), []

    class Event:
        def query(self):
            return done_on_device.is_set()

    class Stream:
        def __init__(self, device):
            pass

        def record_event(self):
            events.append(Event())
            return events[-1]

        def synchronize(self):
            done_on_device.wait(10)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    release = threading.Event()

    def run(job, gate):
        assert gate.begin_write()
        gate.end_write(CHUNK)  # a kernel launched, not finished
        release.wait(10)  # then a slow fetch
        return set()

    fetch = AsyncLoads(run, device=torch.device("cuda", 0), workers=1, deadline_s=0.1)
    fetch.submit(load("g", chunks=2))
    time.sleep(0.3)
    assert fetch.finished() == (set(), set()) and events  # expired, not writing, but its kernel may still write
    done_on_device.set()
    assert fetch.finished() == ({"g"}, load("g").blocks_from(CHUNK))  # reported once the event completed
    release.set()
    assert fetch.close(10)
