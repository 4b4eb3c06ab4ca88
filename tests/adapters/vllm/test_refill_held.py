"""vLLM 0.32's own scheduler over the connector (no model run): a one-token producer request served by vLLM's
prefix cache finishes in the step it is scheduled, before its refill check's answer is in. Its blocks are
held (``delay_free_blocks``), vLLM keeps stepping, the refill is planned from the held blocks once the answer
is in, and the request is reported once as ``finished_sending``, when vLLM frees its blocks."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from vllm.v1.request import RequestStatus  # noqa: E402

from scd_store.adapters.vllm.plan import slots_of  # noqa: E402
from scd_store.adapters.vllm.refill import Refill  # noqa: E402
from scd_store.service import Lookup  # noqa: E402
from scd_store.service.hashing import chunk_hashes  # noqa: E402
from tests.adapters.vllm.vllm_scheduler import BLOCK, CHUNK, PROMPT, engine  # noqa: E402

CACHED = 96  # vLLM's prefix cache: 6 whole blocks of the 100-token prompt (the last token is always computed)


def _producer(tmp_path, present, **side):
    """A producer engine whose first request computes the prompt (filling vLLM's prefix cache); the refill's
    clock is moved past the window in which chunks a request computed are not stored again."""
    now, saves, counted = [0.0], [], []
    refill = Refill(present, clock=lambda: now[0])
    eng = engine(tmp_path, lambda model, hashes: Lookup(0, 0), lambda load, gate=None: 0, role="producer",
                 save_one=saves.append, counted=counted, refill=refill, **side)
    eng.add("warm", max_tokens=1)
    assert eng.step().num_scheduled_tokens == {"warm": len(PROMPT)}
    assert [s.starts for s in saves] == [[0, CHUNK, 2 * CHUNK]] and eng.blocks_in_use() == 0 and not eng.sent
    now[0] = 100.0  # then the shared tier lost the chunks (a Redis restart)
    saves.clear()
    return eng, refill, saves, counted


def test_a_one_token_request_that_finishes_before_the_answer_is_held_refilled_and_released_once(tmp_path):
    answer, asked = threading.Event(), []

    def present(model, hashes):  # the shared tier's answer: it lost them all (slow to come)
        asked.append(len(hashes))
        answer.wait(30)
        return 0

    eng, refill, saves, _ = _producer(tmp_path, present)
    eng.add("p", max_tokens=1)
    out = eng.step()
    assert out.num_scheduled_tokens == {"p": len(PROMPT) - CACHED}  # served by vLLM's own prefix cache
    assert "p" in eng.scheduler.requests and eng.scheduler.requests["p"].is_finished()  # done, its blocks kept
    held = eng.blocks_in_use()
    assert eng.side.held() == {"p"} and held == len(PROMPT) // BLOCK + 1
    blocks = eng.scheduler.kv_cache_manager.get_block_ids("p")[0]
    assert eng.scheduler.has_requests()  # vLLM keeps stepping (no forward) while it is held
    for _ in range(3):
        assert eng.step().kv_connector_metadata.released == [] and not saves and eng.blocks_in_use() == held
    answer.set()
    assert refill.idle()
    plan = eng.step().kv_connector_metadata
    assert plan.released == ["p"] and eng.sent == ["p"]
    (save,) = saves  # copied from the held blocks in the step that released them
    assert save.refill and save.req_id == "p" and save.hashes == chunk_hashes(PROMPT[:CACHED], CHUNK)
    assert save.slots == [slots_of(list(blocks), BLOCK, i * CHUNK, (i + 1) * CHUNK) for i in range(3)]
    assert "p" not in eng.scheduler.requests and eng.blocks_in_use() == 0  # vLLM freed them on the report
    assert not eng.scheduler.has_requests()
    for _ in range(3):
        eng.step()
    assert eng.sent == ["p"] and len(saves) == 1 and asked == [3]  # reported once, checked once


def test_a_held_request_is_released_without_a_refill_when_no_answer_comes_in_time(tmp_path):
    answer, clock = threading.Event(), [0.0]
    eng, refill, saves, counted = _producer(tmp_path, lambda model, hashes: answer.wait(30) and 0,
                                            refill_hold_s=10.0, clock=lambda: clock[0])
    eng.add("p", max_tokens=1)
    eng.step()
    assert eng.side.held() == {"p"} and eng.blocks_in_use() > 0
    clock[0] = 9.0
    assert eng.step().kv_connector_metadata.released == []
    clock[0] = 10.5  # past the hold: released, nothing stored, counted
    assert eng.step().kv_connector_metadata.released == ["p"]
    assert eng.sent == ["p"] and not saves and eng.blocks_in_use() == 0 and "p" not in eng.scheduler.requests
    assert counted == [("refill_timeouts", 1)]
    answer.set()
    assert refill.idle()  # the late answer (chunks missing) waits for the next request of the prefix
    eng.add("q", max_tokens=1)
    eng.step()
    (save,) = saves
    assert save.req_id == "q" and save.refill and eng.side.held() == set()  # stored at once: nothing held
    assert eng.blocks_in_use() == 0 and eng.sent == ["p"]
    assert eng.side.close(5.0)


def test_an_aborted_request_whose_check_is_out_is_held_too_and_a_request_with_an_answer_is_not(tmp_path):
    answer = threading.Event()
    eng, refill, saves, _ = _producer(tmp_path, lambda model, hashes: answer.wait(30) and 0)
    eng.add("p", max_tokens=8)  # still running when it is aborted
    eng.step()
    eng.scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert eng.side.held() == {"p"} and "p" in eng.scheduler.requests
    answer.set()
    assert refill.idle()
    assert eng.step().kv_connector_metadata.released == ["p"] and eng.sent == ["p"] and len(saves) == 1
    eng.add("q", max_tokens=1)  # the answer is in (and taken): nothing to hold
    eng.step()
    assert eng.side.held() == set() and eng.sent == ["p"] and eng.blocks_in_use() == 0
    assert eng.side.close(5.0)


def test_a_request_preempted_before_it_finished_is_never_held_its_blocks_are_gone(tmp_path):
    """A preemption frees the request's blocks (vLLM may give them to another request at once): a refill from
    them would store another request's KV under this prefix's keys. Such a request is not held, and nothing
    is stored from the blocks its check was planned from."""
    answer = threading.Event()
    eng, refill, saves, _ = _producer(tmp_path, lambda model, hashes: answer.wait(30) and 0)
    request = eng.add("p", max_tokens=8)
    eng.step()
    eng.scheduler.running.remove(request)
    eng.scheduler._preempt_request(request, 0.0)  # as the scheduler does when it runs out of blocks
    assert eng.blocks_in_use() == 0
    eng.scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert eng.side.held() == set() and "p" not in eng.scheduler.requests
    answer.set()
    assert refill.idle()
    for _ in range(2):
        assert eng.step().kv_connector_metadata.released == []
    assert not saves and eng.sent == [] and eng.blocks_in_use() == 0
    assert eng.side.close(5.0)
