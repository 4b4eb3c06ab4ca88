"""The benchmark's shaped link delays each response and paces what the server sends back."""

from __future__ import annotations

import socket
import threading
import time

from scd_store.bench.slow_link import SlowLink


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data * 100)  # a small ask, a large answer (as a Redis GET)
    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _round_trip(port: int, message: bytes, expect: int) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        started = time.perf_counter()
        s.sendall(message)
        got = 0
        while got < expect:
            got += len(s.recv(65536))
        return time.perf_counter() - started


def test_responses_wait_the_latency_and_the_bandwidth():
    server, port = _echo_server()
    with SlowLink("127.0.0.1", port, latency_s=0.2, bytes_per_s=200_000) as link:
        took = _round_trip(link.port, b"x" * 1000, 100_000)  # 100 kB at 200 kB/s: 0.5 s, plus 0.2 s
    server.close()
    assert 0.65 < took < 3.0


def test_an_unshaped_link_passes_bytes_at_once():
    server, port = _echo_server()
    with SlowLink("127.0.0.1", port) as link:
        took = _round_trip(link.port, b"y" * 100, 10_000)
    server.close()
    assert took < 0.5
