"""A shaped TCP link for benchmarks: :class:`SlowLink`, a loopback proxy that adds a round-trip latency and
caps the bandwidth of what the server sends back (what a consumer on a slow link to Redis sees).

Each response (the first bytes from the server after the client has sent something) waits
``latency_s``; every byte from the server is paced at ``bytes_per_s``. Client-to-server bytes pass at
once. It runs its own event loop on a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class SlowLink:
    """A proxy on ``127.0.0.1:port`` to ``host:upstream_port``; use as a context manager."""

    def __init__(self, host: str, upstream_port: int, *, latency_s: float = 0.0, bytes_per_s: float | None = None
                 ) -> None:
        if latency_s < 0 or (bytes_per_s is not None and bytes_per_s <= 0):
            raise ValueError("latency_s must be >= 0 and bytes_per_s positive")
        self.host, self.upstream_port = host, upstream_port
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: Any = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="scd-store-slow-link", daemon=True)

    def __enter__(self) -> SlowLink:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.close()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        asked = asyncio.Event()

        async def up() -> None:
            while data := await client_r.read(65536):
                asked.set()
                upstream_w.write(data)
                await upstream_w.drain()
            upstream_w.close()

        async def down() -> None:
            while data := await upstream_r.read(65536):
                if asked.is_set():
                    asked.clear()
                    await asyncio.sleep(self.latency_s)
                if self.bytes_per_s:
                    await asyncio.sleep(len(data) / self.bytes_per_s)
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        await asyncio.gather(up(), down(), return_exceptions=True)
