"""The connector's small daemon thread pools (fetch threads, lookup threads): started together, joined under one
deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def start_threads(target: Callable[[], None], name: str, workers: int) -> list[threading.Thread]:
    """``workers`` daemon threads named ``name-0``, ``name-1``, ... running ``target``, started."""
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    return threads


def join_all(threads: list[threading.Thread], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds in all for ``threads``; True when every one of them has left."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)
