"""Loads off the engine's step: :class:`AsyncLoads`, one fetch thread for the hits the store holds remotely.

A consumer hit whose chunks only a remote tier (Redis, a peer) holds would make the whole batch wait
on the network if it were loaded before the step's forward. vLLM lets a connector load such a
request between steps instead: the scheduler parks it (``WAITING_FOR_REMOTE_KVS``, its blocks
reserved for it alone), the worker's fetch thread fetches, decodes and writes its blocks while the
other requests keep running, and the worker reports it through ``get_finished`` once its blocks hold
the KV, with the blocks it could not fill reported as load errors in the same step (vLLM recomputes
them). Every load handed over is reported, failed or not (an aborted request's blocks are freed only
then). On a GPU the thread writes on a stream of its own, synchronised before the load is reported.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from scd_store.adapters.vllm.plan import ChunkLoad

log = logging.getLogger("scd_store.adapters.vllm")


class AsyncLoads:
    """Runs ``run(load) -> blocks that failed`` on a fetch thread; :meth:`finished` collects the outcomes."""

    def __init__(self, run: Callable[[ChunkLoad], set[int]], device: torch.device | None = None,
                 name: str = "scd-store-fetch") -> None:
        self._run = run
        self._device = device if device is not None else torch.device("cpu")
        self._queue: queue.Queue[ChunkLoad | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, load: ChunkLoad) -> None:
        """Start ``load`` off the engine's thread (never blocks)."""
        with self._lock:
            self._in_flight += 1
        self._queue.put(load)

    def finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads completed since the last call, and the blocks those loads could not fill."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _work(self) -> None:
        stream = self._stream()
        while True:
            load = self._queue.get()
            if load is None:
                return
            try:
                failed = self._run_on(stream, load)
            except BaseException as exc:  # noqa: BLE001 - a load that fails is recomputed; the thread goes on
                log.warning("scd-store: an asynchronous load of %r failed (recomputed): %s", load.model, exc)
                failed = load.blocks_from(0)
            with self._lock:
                self._done.add(load.req_id)
                self._failed |= failed
                self._in_flight -= 1

    def _stream(self) -> Any:
        return torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None

    def _run_on(self, stream: Any, load: ChunkLoad) -> set[int]:
        if stream is None:
            return self._run(load)
        try:
            with torch.cuda.stream(stream):
                return self._run(load)
        finally:
            stream.synchronize()  # the blocks hold the KV (or nothing is in flight) before the load is reported
