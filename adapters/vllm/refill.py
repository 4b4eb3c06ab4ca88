"""Storing again what the store lost while the producer's engine still holds it in its own prefix cache.

A producer request whose leading chunks come from vLLM's own prefix cache computes nothing for
them, so the connector has nothing new to store; if a shared tier lost them meanwhile (a Redis
restart, a failover, an eviction) every consumer misses for as long as the producer's cache keeps
the prefix. :class:`Refill` asks the store whether such a prefix is still there, on a thread of its
own (the engine's thread only reads answers that are already in), and says which chunks to store
again. Checks of one prefix are de-duplicated: an answer that the store holds the whole prefix is
reused for ``answer_ttl_s``; an answer that chunks are missing stays until a request takes it (or
``missing_ttl_s``, or ``max_entries`` newer answers, drop it), so the next request for the prefix
stores them at once, however short it is and however long after; a chunk handed out to be stored (or
stored by a request that computed it) is not handed out again for ``saved_ttl_s``. The check is the
caller's ``lookup(model, hashes)``: the leading run of ``hashes`` the store holds for the producer
``model`` (a shared tier that cannot answer counts as holding them: never store again on a guess).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scd_store.service.log_once import LogOnce

log = logging.getLogger("scd_store.adapters.vllm")

Lookup = Callable[[str, list[bytes]], int]  # (producer model, chunk hashes) -> leading run the store holds
MISSING_TTL_S = 300.0  # how long an answer that chunks are missing waits for a request to store them


@dataclass(slots=True)
class _Answer:
    present: int  # the leading run the store held when asked (or the chunks handed out since)
    total: int
    at: float


class Refill:
    """Presence checks of prefixes off the engine's thread, and the chunks to store again.

    ``max_pending`` checks wait at most (a check that does not fit is asked again by the next
    :meth:`take`); ``max_entries`` answers and as many saved chunks are remembered (oldest dropped).
    """

    def __init__(self, lookup: Lookup, *, answer_ttl_s: float = 5.0, missing_ttl_s: float = MISSING_TTL_S,
                 saved_ttl_s: float = 20.0, max_pending: int = 64, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self.answer_ttl_s = answer_ttl_s
        self.missing_ttl_s = missing_ttl_s
        self.saved_ttl_s = saved_ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple[str, bytes], _Answer] = OrderedDict()
        self._saved: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._inflight: set[tuple[str, bytes]] = set()
        self._queue: queue.Queue[tuple[tuple[str, bytes], str, list[bytes]] | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.checks = 0  # lookups run (for tests and logs)
        self._once = LogOnce(log)

    # ------------------------------------------------------------ the engine's thread (never waits on I/O)
    def take(self, model: str, hashes: Sequence[bytes]) -> list[int] | None:
        """Indices of ``hashes`` (a prefix's chunks, from its first) to store again now, or None while the
        store's answer is not in (the check is queued, unless one is in flight). Chunks handed out are
        not handed out again within ``saved_ttl_s``."""
        if not hashes:
            return []
        key = (model, hashes[-1])  # a chain hash names its whole prefix
        now = self._clock()
        with self._lock:
            answer = self._answers.get(key)
            if answer is None or now - answer.at > self._ttl(answer):
                self._ask(key, model, list(hashes))
                return None
            out = [i for i in range(answer.present, answer.total) if not self._recent((model, hashes[i]), now)]
            for i in out:
                self._mark((model, hashes[i]), now)
            answer.present = answer.total  # handed out: the next request for this prefix stores nothing
            return out

    def _ttl(self, answer: _Answer) -> float:
        """How long ``answer`` holds: chunks missing that no request took yet, until one does (bounded)."""
        return self.missing_ttl_s if answer.present < answer.total else self.answer_ttl_s

    def saved(self, model: str, hashes: Sequence[bytes]) -> None:
        """Chunks a request computed and handed to the store: not to be stored again within the window."""
        now = self._clock()
        with self._lock:
            for h in hashes:
                self._mark((model, h), now)

    def _recent(self, chunk: tuple[str, bytes], now: float) -> bool:
        at = self._saved.get(chunk)
        return at is not None and now - at <= self.saved_ttl_s

    def _mark(self, chunk: tuple[str, bytes], now: float) -> None:
        self._saved[chunk] = now
        self._saved.move_to_end(chunk)
        while len(self._saved) > self.max_entries:
            self._saved.popitem(last=False)

    def _ask(self, key: tuple[str, bytes], model: str, hashes: list[bytes]) -> None:
        """Queue one check of ``key`` (the lock is held); never blocks."""
        if key in self._inflight or self._closed:
            return
        try:
            self._queue.put_nowait((key, model, hashes))
        except queue.Full:  # asked again by the next take()
            return
        self._inflight.add(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scd-store-refill", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ the refill thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, model, hashes = item
            try:
                present: int | None = max(0, min(int(self._lookup(model, hashes)), len(hashes)))
            except Exception as exc:  # noqa: BLE001 - a failed check is no answer: asked again later
                self._once.warn("refill-lookup", "scd-store: a refill check failed (asked again later; logged "
                                "once): %s", exc)
                present = None
            with self._lock:
                self.checks += 1
                self._inflight.discard(key)
                if present is not None:
                    self._answers[key] = _Answer(present, len(hashes), self._clock())
                    self._answers.move_to_end(key)
                    while len(self._answers) > self.max_entries:
                        self._answers.popitem(last=False)

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued check has been answered (for tests); False when ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the refill thread (checks still queued are dropped); False when it is still inside a check
        (a store call) after ``timeout`` seconds."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return True
        while True:  # make room for the stop mark
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()
