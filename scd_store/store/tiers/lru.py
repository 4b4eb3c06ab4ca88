"""A byte-bounded, thread-safe LRU map used by the in-memory tiers."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Keeps at most ``max_bytes`` of values (sized by ``size_of``); evicts least recently used first.

    A value larger than ``max_bytes`` is refused (``put`` returns False) rather than flushing everything.
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int],
                 on_evict: Callable[[str, int], None] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._on_evict = on_evict
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def get(self, key: str) -> V | None:
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            return entry[0]

    def get_many(self, keys: Sequence[str]) -> list[V | None]:
        out: list[V | None] = []
        with self._lock:
            items = self._items
            for key in keys:
                entry = items.get(key)
                if entry is None:
                    out.append(None)
                else:
                    items.move_to_end(key)
                    out.append(entry[0])
        return out

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        items = self._items
        return [k in items for k in keys]

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, value: V) -> bool:
        size = self._size_of(value)
        if size > self.max_bytes:
            return False
        evicted: list[tuple[str, int]] = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._bytes + size > self.max_bytes and self._items:
                victim, (_, victim_size) = self._items.popitem(last=False)
                self._bytes -= victim_size
                evicted.append((victim, victim_size))
            self._items[key] = (value, size)
            self._bytes += size
        if self._on_evict is not None:
            for victim, victim_size in evicted:
                self._on_evict(victim, victim_size)
        return True

    def pop(self, key: str) -> V | None:
        with self._lock:
            entry = self._items.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            return entry[0]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
