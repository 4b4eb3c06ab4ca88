"""Lookups off vLLM's scheduler thread: None until the answer is in, one lookup per request, a bounded number
in all, 0 hits past the deadline, and a close that says whether a lookup thread is still inside the store."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.lookups import MISS, Lookups  # noqa: E402
from scd_store.adapters.vllm.scheduler_side import SchedulerSide  # noqa: E402
from scd_store.service import Lookup  # noqa: E402
from scd_store.service.log_once import Incidents  # noqa: E402
from scd_store.store.stats import StoreStats  # noqa: E402
from tests.adapters.vllm.test_scheduler_side import BLOCK, CHUNK, request  # noqa: E402

HASHES = [b"\x01" * 16, b"\x02" * 16]


def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


class Link:
    """A tier behind a link the test opens: each lookup waits for ``gate``."""

    def __init__(self, found: Lookup | None = None):
        self.gate, self.found, self.calls = threading.Event(), found or Lookup(2, 2), []

    def __call__(self, model, hashes):
        self.calls.append(list(hashes))
        assert self.gate.wait(30)
        return self.found


def test_the_answer_is_none_until_the_lookup_is_in_and_a_request_has_one_lookup_at_a_time():
    link = Link()
    lookups = Lookups(link, inline_s=0.0)
    assert lookups.answer("r", "m", HASHES) is None
    assert lookups.answer("r", "m", HASHES) is None  # asked again while it is out: no second round trip
    link.gate.set()
    assert _until(lambda: lookups.answer("r", "m", HASHES) is not None)
    assert lookups.answer("r", "m", HASHES) == Lookup(2, 2) and link.calls == [HASHES]  # held until forgotten
    lookups.forget("r")
    assert _until(lambda: lookups.answer("r", "m", HASHES) is not None)  # a later ask looks up afresh
    assert len(link.calls) == 2
    assert lookups.close()


def test_a_fast_lookup_is_answered_within_the_first_ask():
    lookups = Lookups(lambda model, hashes: Lookup(1, 0), inline_s=5.0, step_inline_s=5.0)
    assert lookups.answer("r", "m", HASHES) == Lookup(1, 0)  # no step lost for a hit the local tiers hold
    assert lookups.close()


def test_lookups_in_flight_are_bounded_and_a_request_waits_its_turn_until_its_deadline():
    link, stats = Link(), StoreStats()
    lookups = Lookups(link, workers=1, max_pending=1, inline_s=0.0, deadline_s=0.3,
                      incidents=Incidents(stats, logging.getLogger("test")))
    assert lookups.answer("a", "m", HASHES) is None
    assert lookups.answer("b", "m", HASHES) is None  # no room: not started
    assert _until(lambda: len(link.calls) == 1) and link.calls == [HASHES]
    time.sleep(0.35)
    assert lookups.answer("b", "m", HASHES) == MISS  # its deadline passed: 0 hits, never a guess
    assert lookups.answer("a", "m", HASHES) == MISS
    link.gate.set()
    time.sleep(0.1)
    assert lookups.answer("a", "m", HASHES) == MISS  # the late answer is dropped
    assert stats.value("lookup_deadlines") == 2  # each request answered 0 at its deadline, counted once
    assert lookups.close()


def test_a_finished_requests_queued_lookup_is_not_run_and_a_failing_one_is_a_miss():
    link = Link()
    lookups = Lookups(link, workers=1, inline_s=0.0)
    lookups.answer("a", "m", HASHES)
    lookups.answer("gone", "m", [b"\x09" * 16])
    assert _until(lambda: len(link.calls) == 1)
    lookups.forget("gone")
    link.gate.set()
    assert _until(lambda: lookups.answer("a", "m", HASHES) is not None)
    time.sleep(0.1)
    assert link.calls == [HASHES]  # the finished request's lookup never went out

    def broken(model, hashes):
        raise ConnectionError("redis went away")

    stats = StoreStats()
    failing = Lookups(broken, inline_s=0.0, incidents=Incidents(stats, logging.getLogger("test")))
    failing.answer("r", "m", HASHES)
    assert _until(lambda: failing.answer("r", "m", HASHES) == MISS)
    assert stats.value("lookup_errors") == 1
    assert lookups.close() and failing.close()


def test_close_says_so_while_a_lookup_thread_is_inside_the_store():
    link = Link()
    lookups = Lookups(link, inline_s=0.0)
    lookups.answer("r", "m", HASHES)
    assert _until(lambda: link.calls)
    assert lookups.close(timeout=0.1) is False
    link.gate.set()
    assert lookups.close(timeout=10) is True


def test_the_scheduler_side_answers_none_while_the_lookup_is_out():
    link = Link(Lookup(3, 1))
    service = types.SimpleNamespace(chunk_size=CHUNK, lookup=link, readable_by_others=lambda *a: 0,
                                    binding=lambda model: types.SimpleNamespace(role="consumer"),
                                    incidents=lambda log: None)
    side = SchedulerSide(service, "consumer-a", BLOCK, lookups=Lookups(link, inline_s=0.0))
    assert side.match(request("r"), 0) == (None, False)
    link.gate.set()
    assert _until(lambda: side.match(request("r"), 0) == (3 * CHUNK, True))
    side.after_alloc(request("r"), list(range(8)), 3 * CHUNK)
    assert side.match(request("r"), 0) == (0, False)  # its load was planned: no second one
    assert len(link.calls) == 1 and side.close(5.0)
