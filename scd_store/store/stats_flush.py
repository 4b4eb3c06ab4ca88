"""The stats sink's schedule: a process's counters handed to its sink every ``every_s`` off the store's loop,
and once more when the store closes (:class:`StatsFlusher`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from scd_store.store.stats import StoreStats
from scd_store.store.stats_sinks import StatsSink

log = logging.getLogger("scd_store.store")


class StatsFlusher:
    """Flushes ``stats`` to ``sink`` (None: nowhere) every ``every_s`` seconds once started."""

    def __init__(self, sink: StatsSink | None, stats: StoreStats, every_s: float) -> None:
        self.sink = sink
        self.stats = stats
        self.every_s = every_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the periodic flush (on the store's loop)."""
        if self.sink is not None:
            self._task = asyncio.ensure_future(self._run(self.sink))

    async def stop(self) -> None:
        """Stop the periodic flush."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def flush(self) -> None:
        """Hand the counters to the sink now."""
        if self.sink is not None:
            self.sink.flush(self.stats)

    def close(self) -> None:
        """A last flush, then close the sink; neither may fail a store's close."""
        if self.sink is not None:
            with contextlib.suppress(Exception):
                self.sink.flush(self.stats)
            with contextlib.suppress(Exception):
                self.sink.close()

    async def _run(self, sink: StatsSink) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await loop.run_in_executor(None, sink.flush, self.stats)
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("store stats sink %s failed (%s); will keep retrying", type(sink).__name__, exc)
                failing = True
