"""Lookups off vLLM's scheduler thread: :class:`Lookups`, the presence checks of new consumer requests on a small
pool of threads.

A consumer request's lookup asks every tier whether it holds the prompt's chunks; for Redis or a peer that
is a network round trip, and vLLM's scheduler thread would wait for it once per new request. vLLM 0.32
lets ``get_num_new_matched_tokens`` answer None ("not determined yet"): the scheduler skips the request
this step and asks again in the next one (``Scheduler.schedule``: ``if ext_tokens is None:
skip_request``). So the first ask of a request starts its lookup on a lookup thread and waits for it a
moment (``inline_s``, at most ``step_inline_s`` per step for all requests: a lookup the local tiers
answer is in before that, and costs no step); a lookup still out then answers None until it is in.

Bounded: one lookup per request in flight (later asks wait for it), ``max_pending`` in all (a request
asked while they are taken waits its turn), and ``deadline_s`` from a request's first ask, after which
its answer is 0 hits (the engine computes it): never a guess. With ``incidents`` (the connector's), each
request answered 0 at its deadline is counted as ``lookup_deadlines`` and each lookup that raised as
``lookup_errors``, the first of each logged. A request's answer holds until it is
forgotten (its blocks were allocated, or it finished), so a request waiting for blocks is asked no
second round trip.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scd_store.adapters.vllm.threads import join_all, start_threads
from scd_store.service import Lookup
from scd_store.service.log_once import Incidents, LogOnce

log = logging.getLogger("scd_store.adapters.vllm")
MISS = Lookup(0, 0)


@dataclass(slots=True, eq=False)
class _Ask:
    """One request's lookup: asked at ``asked`` (monotonic seconds), answered once ``done`` is set."""

    model: str
    hashes: list[bytes]
    asked: float
    started: bool = False
    forgotten: bool = False
    found: Lookup | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Lookups:
    """``lookup(model, hashes) -> Lookup`` on ``workers`` threads; :meth:`answer` is None until it is in."""

    def __init__(self, lookup: Callable[[str, Sequence[bytes]], Lookup], *, workers: int = 2,
                 max_pending: int = 64, deadline_s: float = 2.0, inline_s: float = 0.002,
                 step_inline_s: float = 0.01, name: str = "scd-store-lookup",
                 incidents: Incidents | None = None) -> None:
        if workers < 1 or max_pending < 1 or deadline_s <= 0:
            raise ValueError("background lookups need a thread, room for one lookup and a positive deadline")
        self._lookup = lookup
        self._max_pending = max_pending
        self._deadline_s = deadline_s
        self._inline_s = inline_s
        self._step_inline_s = step_inline_s
        self._budget = step_inline_s
        self._asks: dict[str, _Ask] = {}  # the scheduler thread's own (no lock): the requests asked about
        self._cond = threading.Condition()
        self._queued: collections.deque[_Ask] = collections.deque()
        self._pending = 0  # lookups queued or running
        self._closing = False
        self._once = LogOnce(log)
        self._incidents = incidents
        self._threads = start_threads(self._work, name, workers)

    def answer(self, req_id: str, model: str, hashes: list[bytes]) -> Lookup | None:
        """The request's lookup, or None while it is out (ask again next step); 0 hits past its deadline."""
        now = time.monotonic()
        ask = self._asks.get(req_id)
        if ask is None:
            ask = self._asks[req_id] = _Ask(model, list(hashes), now)
        if not ask.started and self._start(ask):
            self._wait_inline(ask)
        with self._cond:
            if ask.found is None and now - ask.asked >= self._deadline_s:
                ask.found = MISS  # a late answer is dropped: the request computes its prompt
                ask.done.set()
                self._incident("lookup_deadlines", "scd-store: a lookup took longer than %.1f s (lookup_deadline_s); "
                               "the request computes its prompt itself (counted as lookup_deadlines; logged once)",
                               self._deadline_s)
            return ask.found

    def forget(self, req_id: str) -> None:
        """Drop a request's answer (its blocks were allocated, or it finished); a queued lookup is not run."""
        ask = self._asks.pop(req_id, None)
        if ask is not None:
            with self._cond:
                ask.forgotten = True

    def new_step(self) -> None:
        """A scheduler step ended: the inline wait's budget is whole again."""
        self._budget = self._step_inline_s

    def close(self, timeout: float = 5.0) -> bool:
        """Drop queued lookups and wait up to ``timeout`` seconds for the threads; True when every one has left."""
        with self._cond:
            self._closing = True
            self._queued.clear()
            self._cond.notify_all()
        return join_all(self._threads, timeout)

    def _incident(self, counter: str, message: str, *args: object, once: str | None = None) -> None:
        if self._incidents is not None:
            self._incidents.count(counter, message, *args, once=once)
        else:
            self._once.warn(once or counter, message, *args)

    def _start(self, ask: _Ask) -> bool:
        """Queue ``ask`` when there is room; False while ``max_pending`` lookups are out (or closing)."""
        with self._cond:
            if self._closing or self._pending >= self._max_pending:
                return False
            ask.started = True
            self._pending += 1
            self._queued.append(ask)
            self._cond.notify()
            return True

    def _wait_inline(self, ask: _Ask) -> None:
        if self._budget <= 0 or self._inline_s <= 0:
            return
        started = time.perf_counter()
        ask.done.wait(min(self._inline_s, self._budget))
        self._budget -= time.perf_counter() - started

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                ask = self._queued.popleft()
                skip = ask.forgotten or ask.found is not None  # finished, or past its deadline, while queued
            found = MISS
            if not skip:
                try:
                    found = self._lookup(ask.model, ask.hashes)
                except Exception as exc:  # noqa: BLE001 - a lookup that fails is a miss, never a guess
                    self._incident("lookup_errors", "scd-store: a lookup failed; the request computes its prompt "
                                   "itself (counted as lookup_errors; logged once per kind): %s: %s",
                                   type(exc).__name__, exc, once=f"lookup:{type(exc).__name__}")
            with self._cond:
                self._pending -= 1
                if ask.found is None:
                    ask.found = found
                ask.done.set()
