"""vLLM 0.32's own scheduler over the connector (no model run): an aborted request's asynchronous load is
cancelled and reported once, so vLLM frees its blocks; a lookup still out answers None, vLLM asks again."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from vllm.v1.request import RequestStatus  # noqa: E402

from scd_store.service import Lookup  # noqa: E402
from tests.adapters.vllm.vllm_scheduler import CHUNK, PROMPT, engine  # noqa: E402


def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


@pytest.mark.slow
def test_vllm_frees_an_aborted_requests_blocks_once_its_cancelled_load_is_reported(tmp_path):
    inside, written = threading.Event(), []

    def load_one(load, stopped=None):  # a remote fetch that only a cancellation ends
        inside.set()
        assert _until(stopped, timeout=30)
        written.append(load.req_id)
        return 0

    eng = engine(tmp_path, lambda model, hashes: Lookup(3, 3), load_one)
    eng.add("r")
    plan = eng.step().kv_connector_metadata
    assert [(x.req_id, x.asynchronous) for x in plan.loads] == [("r", True)]
    assert eng.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and inside.wait(10)
    held = eng.blocks_in_use()
    assert held > 0
    eng.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert "r" in eng.scheduler.requests and eng.blocks_in_use() == held  # vLLM waits for the load's report
    assert eng.step().kv_connector_metadata.cancelled == ["r"]
    assert _until(lambda: eng.step() and eng.reported == ["r"])
    assert "r" not in eng.scheduler.requests and eng.blocks_in_use() == 0  # freed by vLLM on the report
    for _ in range(3):
        eng.step()
    assert eng.reported == ["r"] and written == ["r"]  # reported once; the load stopped where it was
    assert eng.worker._worker.close(5.0)


def test_a_lookup_still_out_leaves_the_request_waiting_and_vllm_asks_again(tmp_path):
    gate, asked = threading.Event(), []

    def lookup(model, hashes):  # a Redis round trip on a slow link
        asked.append(threading.current_thread().name)
        gate.wait(30)
        return Lookup(3, 0)

    eng = engine(tmp_path, lookup, lambda load, stopped=None: 3 * CHUNK, lookups={"inline_s": 0.0})
    request = eng.add("r")
    started = time.monotonic()
    out = eng.step()
    assert time.monotonic() - started < 5  # the scheduler's thread did not wait for the link
    assert out.num_scheduled_tokens == {} and request.status == RequestStatus.WAITING and eng.blocks_in_use() == 0
    assert eng.step().num_scheduled_tokens == {}  # asked again: the same lookup, still out
    gate.set()
    assert _until(lambda: eng.side.lookups.answer("r", "consumer-a", []) is not None)
    out = eng.step()
    assert out.num_scheduled_tokens == {"r": len(PROMPT) - 3 * CHUNK}  # the hit is loaded, not computed
    assert [(x.req_id, x.asynchronous) for x in out.kv_connector_metadata.loads] == [("r", False)]
    assert asked == ["scd-store-lookup-0"] or asked == ["scd-store-lookup-1"]  # one round trip, off the thread
    assert eng.side.close(5.0)


def test_a_lookup_past_its_deadline_is_a_miss_and_the_request_computes_its_prompt(tmp_path):
    gate = threading.Event()

    def lookup(model, hashes):
        gate.wait(30)
        return Lookup(3, 3)  # too late: never used

    eng = engine(tmp_path, lookup, lambda load, stopped=None: 0, lookups={"inline_s": 0.0, "deadline_s": 0.2})
    eng.add("r")
    assert eng.step().num_scheduled_tokens == {}
    time.sleep(0.3)
    out = eng.step()
    assert out.num_scheduled_tokens == {"r": len(PROMPT)} and out.kv_connector_metadata.loads == []
    gate.set()
    assert eng.side.close(5.0)
