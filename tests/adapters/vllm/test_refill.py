"""A producer's prefix-cache hits the store lost are stored again: checked off the engine's thread,
saved from the request's blocks, once. Driven the way vLLM's scheduler calls the scheduler half."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.plan import ChunkSave, StepPlan, slots_of  # noqa: E402
from scd_store.adapters.vllm.refill import Refill  # noqa: E402
from scd_store.adapters.vllm.scheduler_side import SchedulerSide  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.keys import chunk_hashes  # noqa: E402
from scd_store.store.registry import FileRegistry  # noqa: E402
from scd_store.store.stats import StoreStats  # noqa: E402
from scd_store.store.tiered import TieredStore  # noqa: E402
from scd_store.store.tiers.cpu import CpuTier  # noqa: E402
from tests.adapters.vllm.test_scheduler_side import (  # noqa: E402
    BLOCK,
    CHUNK,
    PROMPT,
    output,
    request,
    store_prompt,
)
from tests.bundles import PRODUCER, write_tiny_bundle  # noqa: E402

BLOCKS = [7, 3, 9, 1, 4, 2, 8, 5]
HASHES = chunk_hashes(PROMPT, CHUNK)


@pytest.fixture
def service(tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    store = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=CHUNK)
    service = KVService(store, [tmp_path / "bundle"])
    yield service
    service.close()


@pytest.fixture
def side(service):
    side = SchedulerSide(service, PRODUCER, BLOCK)
    yield side
    side.close()


def cached_hit(req_id, chunks=2, blocks=BLOCKS):
    """A producer request whose first ``chunks`` came from vLLM's own prefix cache."""
    return request(req_id, block_ids=(list(blocks),), num_computed_tokens=chunks * CHUNK)


def decode_step(*req_ids):
    return output(cached=SimpleNamespace(req_ids=list(req_ids), new_block_ids=[None] * len(req_ids),
                                         num_computed_tokens=[len(PROMPT)] * len(req_ids), resumed_req_ids=set()),
                  scheduled=dict.fromkeys(req_ids, 1))


def refills(plan: StepPlan) -> list[ChunkSave]:
    return [s for s in plan.saves if s.refill]


def test_chunks_the_store_lost_are_stored_again_from_the_requests_blocks(side):
    plan = side.build(output([cached_hit("p1")], scheduled={"p1": len(PROMPT) - 2 * CHUNK}))
    assert [s.starts for s in plan.saves] == [[16]] and not refills(plan)  # the check is not waited for
    assert side.refill.idle()
    (save,) = refills(side.build(decode_step("p1")))
    assert save.hashes == HASHES[:2] and save.starts == [0, CHUNK] and save.model == PRODUCER
    assert save.slots == [slots_of(BLOCKS, BLOCK, 0, CHUNK), slots_of(BLOCKS, BLOCK, CHUNK, 2 * CHUNK)]
    assert side.build(decode_step("p1")).saves == []  # stored again once


def test_only_the_chunks_the_store_lost_are_stored_and_present_ones_are_not(service, side):
    store_prompt(service, chunks=1)  # the store kept chunk 0 and lost chunk 1
    side.build(output([cached_hit("p1")], scheduled={"p1": 1}))
    assert side.refill.idle()
    (save,) = refills(side.build(decode_step("p1")))
    assert save.starts == [CHUNK] and save.hashes == HASHES[1:2]
    store_prompt(service, chunks=3)
    side.build(output([request("p2", prompt=PROMPT, block_ids=(BLOCKS,), num_computed_tokens=3 * CHUNK)],
                      scheduled={"p2": 1}))
    assert side.refill.idle()
    assert side.build(decode_step("p2")).saves == []  # all present: nothing stored


def test_the_check_never_runs_on_the_engines_thread(service):
    release, threads = threading.Event(), []

    def lookup(model, hashes):
        threads.append(threading.current_thread())
        release.wait(30)
        return 0

    side = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lookup))
    try:
        started = time.monotonic()
        side.build(output([cached_hit("p1")], scheduled={"p1": 1}))
        for _ in range(3):
            assert not refills(side.build(decode_step("p1")))  # the store's answer is not in: no wait, no save
        assert time.monotonic() - started < 2.0
        assert threads and threads[0] is not threading.current_thread()
        release.set()
        assert side.refill.idle()
        assert [s.starts for s in refills(side.build(decode_step("p1")))] == [[0, CHUNK]]
    finally:
        release.set()
        side.close()


def test_a_prefix_is_checked_once_and_its_chunks_stored_once(service):
    calls = []
    side = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lambda model, hashes: calls.append(hashes) or 0))
    try:
        other = [b + 10 for b in BLOCKS]
        saves = refills(side.build(output([cached_hit("p1"), cached_hit("p2", blocks=other)],
                                          scheduled={"p1": 1, "p2": 1})))
        assert side.refill.idle()
        saves += refills(side.build(decode_step("p1", "p2")))
        assert len(saves) == 1 and saves[0].starts == [0, CHUNK]  # one of the two copies is stored
        for req in ("p1", "p2"):
            side.finished(SimpleNamespace(request_id=req))
        side.build(output([cached_hit("p3")], scheduled={"p3": 1}))
        assert side.refill.idle()
        assert not refills(side.build(decode_step("p3")))
        assert len(calls) == 1  # the answer is reused, not asked again
    finally:
        side.close()


def test_a_request_that_finished_before_the_answer_is_held_and_refilled_from_its_blocks(service):
    release = threading.Event()
    side = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lambda model, hashes: release.wait(30) and 0))
    try:
        side.build(output([cached_hit("p1")], scheduled={"p1": 1}))
        assert side.finished(SimpleNamespace(request_id="p1")) is True  # vLLM keeps its blocks
        assert side.build(output()).released == []  # the answer is not in: still held
        release.set()
        assert side.refill.idle()
        other = [b + 20 for b in BLOCKS]
        plan = side.build(output([cached_hit("p2", blocks=other)], scheduled={"p2": 1}))
        (save,) = refills(plan)  # from p1's held blocks; p2 finds the answer taken
        assert save.req_id == "p1" and save.slots[0] == slots_of(BLOCKS, BLOCK, 0, CHUNK)
        assert plan.released == ["p1"] and side.held() == set()
        assert side.build(output()).released == [] and side.finished(SimpleNamespace(request_id="p2")) is False
    finally:
        release.set()
        side.close()


def test_a_request_not_held_leaves_the_missing_chunks_to_the_next_request_however_late(service):
    now, release = [0.0], threading.Event()
    refill = Refill(lambda model, hashes: release.wait(30) and 0, clock=lambda: now[0])
    side = SchedulerSide(service, PRODUCER, BLOCK, refill=refill, max_held=0)  # nothing may be held
    try:
        side.build(output([cached_hit("p1")], scheduled={"p1": 1}))
        assert side.finished(SimpleNamespace(request_id="p1")) is False
        release.set()
        assert side.refill.idle()
        now[0] = 60.0  # long past answer_ttl_s: an answer that chunks are missing waits for a request
        other = [b + 20 for b in BLOCKS]
        (save,) = refills(side.build(output([cached_hit("p2", blocks=other)], scheduled={"p2": 1})))
        assert save.req_id == "p2" and save.slots[0] == slots_of(other, BLOCK, 0, CHUNK)  # at once
        assert refill.checks == 1
    finally:
        release.set()
        side.close()


def test_consumers_and_producers_with_an_answer_are_never_held(service):
    consumer = SchedulerSide(service, "consumer-a", BLOCK)
    producer = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lambda model, hashes: 0))
    try:
        assert consumer.finished(request("c1")) is False
        producer.build(output([request("p0", block_ids=(BLOCKS,), num_computed_tokens=0)], scheduled={"p0": 1}))
        assert producer.finished(SimpleNamespace(request_id="p0")) is False  # computes its prompt: no check
        producer.build(output([cached_hit("p1")], scheduled={"p1": 1}))
        assert producer.refill.idle()
        producer.build(decode_step("p1"))  # the answer was in while it ran: planned then
        assert producer.finished(SimpleNamespace(request_id="p1")) is False
    finally:
        consumer.close()
        producer.close()


def test_an_answer_that_chunks_are_missing_waits_for_a_request_and_a_tier_that_cannot_answer_stores_nothing():
    now, present = [0.0], [2]  # the shared tier cannot answer: counted as holding them (never a guess)
    refill = Refill(lambda model, hashes: present[0], answer_ttl_s=5.0, missing_ttl_s=300.0, clock=lambda: now[0])
    try:
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        assert refill.take(PRODUCER, HASHES[:2]) == []  # nothing stored while it is down
        present[0], now[0] = 0, 6.0  # back, empty; the "all present" answer has expired
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        now[0] = 200.0  # no request for the prefix since: the missing chunks' answer still holds
        assert refill.take(PRODUCER, HASHES[:2]) == [0, 1] and refill.checks == 2
        now[0] = 1000.0  # handed out long ago: asked again (the put may have failed)
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        assert refill.take(PRODUCER, HASHES[:2]) == [0, 1]
        assert refill.take(PRODUCER, HASHES[:3]) is None and refill.idle()  # a longer prefix: missing, no taker
        now[0] = 1400.0  # past missing_ttl_s: asked again
        assert refill.take(PRODUCER, HASHES[:3]) is None and refill.idle() and refill.checks == 5
    finally:
        refill.close()


def test_a_preempted_request_never_stores_from_freed_blocks(service):
    side = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lambda model, hashes: 0))
    try:
        side.build(output([cached_hit("p1")], scheduled={"p1": 1}))
        assert side.refill.idle()
        resumed = SimpleNamespace(req_ids=["p1"], new_block_ids=[([11, 12, 13, 14, 15, 16, 17, 18],)],
                                  num_computed_tokens=[0], resumed_req_ids={"p1"})
        assert not refills(side.build(output(cached=resumed, scheduled={"p1": CHUNK})))
        (save,) = refills(side.build(output([cached_hit("p2")], scheduled={"p2": 1})))  # the answer was kept
        assert save.req_id == "p2"
    finally:
        side.close()


def test_chunks_a_request_just_computed_are_not_stored_again_by_a_racing_check(service):
    side = SchedulerSide(service, PRODUCER, BLOCK, refill=Refill(lambda model, hashes: 0))  # the put not in yet
    try:
        plan = side.build(output([request("p1", block_ids=(BLOCKS,), num_computed_tokens=0)],
                                 scheduled={"p1": len(PROMPT)}))
        assert [s.starts for s in plan.saves] == [[0, CHUNK, 2 * CHUNK]]
        side.build(output([cached_hit("p2")], scheduled={"p2": 1}))
        assert side.refill.idle()
        assert not refills(side.build(decode_step("p2")))
    finally:
        side.close()


def test_answers_expire_and_the_prefix_is_checked_again():
    now, calls = [0.0], []
    refill = Refill(lambda model, hashes: calls.append(1) or 0, answer_ttl_s=5.0, saved_ttl_s=20.0,
                    clock=lambda: now[0])
    try:
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        assert refill.take(PRODUCER, HASHES[:2]) == [0, 1]
        now[0] = 6.0  # the answer is stale: asked again; the chunks handed out stay within their window
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        assert refill.take(PRODUCER, HASHES[:2]) == [] and len(calls) == 2
        now[0] = 30.0  # past both windows: the store still lacks them (a put that failed), so once more
        assert refill.take(PRODUCER, HASHES[:2]) is None and refill.idle()
        assert refill.take(PRODUCER, HASHES[:2]) == [0, 1]
    finally:
        refill.close()


def test_stored_refills_are_counted_by_space():
    stats = StoreStats()
    submitted = []

    def submit_put(model, hashes, states, done=None, nbytes=0):
        submitted.append(done)
        if done is not None:
            done(len(hashes))
        return True

    binding = SimpleNamespace(space=SimpleNamespace(space_id="tiny-space"))
    worker = WorkerSide(SimpleNamespace(submit_put=submit_put, put_fits=lambda chunks, nbytes: True,
                                        binding=lambda model: binding, count=stats.inc))
    worker.caches = [torch.zeros(8, 1, BLOCK, 2)]  # one layer's paged cache
    block = slots_of([1], BLOCK, 0, BLOCK)
    worker._save_one(ChunkSave("p1", PRODUCER, [HASHES[0]], [0], [block], refill=False))
    worker._save_one(ChunkSave("p1", PRODUCER, HASHES[:2], [0, CHUNK], [block, block], refill=True))
    assert submitted[0] is None
    assert stats.value("refilled_chunks", space="tiny-space") == 2 and stats.value("refilled_chunks") == 2


def test_close_reports_a_check_still_inside_the_store():
    import threading

    entered, release = threading.Event(), threading.Event()

    def stuck(model, hashes):
        entered.set()
        release.wait(10)
        return 0

    refill = Refill(stuck)
    try:
        assert refill.take(PRODUCER, HASHES[:2]) is None
        assert entered.wait(5)
        assert refill.close(timeout=0.1) is False  # the check is still in its store call
    finally:
        release.set()
    assert refill.close(timeout=5) is True
    assert Refill(lambda model, hashes: 0).close() is True  # never started
