"""The store's cache of the registry's answers, and the watch that re-reads them.

:class:`RegistryCache` grants the store's faces: a producer's space generation
(``authorize_write``) and a consumer's pair (``resolve``), each read once and cached. The registry's
version is checked every ``refresh_s`` on a thread of its own (no tier's I/O can hold revocation up);
when it changes every cached answer is read again, so a revoked record becomes a refusal
(:class:`~scd_store.store.records.NotRegistered`) within that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from scd_store.store.records import NotRegistered, Pair, RegistryError, Space
from scd_store.store.registry import Registry
from scd_store.store.stats import StoreStats

log = logging.getLogger("scd_store.store")
T = TypeVar("T")
Ask = tuple[str, str, str]  # what a face was asked with: (space or pair id, model id, fingerprint)


class RegistryCache:
    """The registry's answers to this store's faces, cached and re-read whenever its version changes."""

    def __init__(self, registry: Registry, stats: StoreStats, refresh_s: float) -> None:
        self.registry = registry
        self.stats = stats
        self.refresh_s = refresh_s
        self.spaces: dict[Ask, Space | None] = {}  # None: revoked
        self.pairs: dict[Ask, tuple[Pair, Space] | None] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scd-store-registry")
        self._task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- answers
    def space(self, space_id: str, producer_model_id: str, fingerprint: str) -> Space:
        """The space generation a producer writes; :class:`NotRegistered` once revoked (and the registry's
        own refusal the first time)."""
        key = (space_id, producer_model_id, fingerprint)
        if key not in self.spaces:
            self.spaces[key] = self.registry.authorize_write(*key)
        space = self.spaces[key]
        if space is None:
            raise NotRegistered(f"code space {space_id!r} (fingerprint {fingerprint}) was revoked")
        return space

    def pair(self, pair_id: str, consumer_model_id: str, space_fingerprint: str) -> tuple[Pair, Space]:
        """A consumer's pair and its space generation; :class:`NotRegistered` otherwise (or once revoked)."""
        key = (pair_id, consumer_model_id, space_fingerprint)
        if key not in self.pairs:
            self.pairs[key] = self.registry.resolve(*key)
        resolved = self.pairs[key]
        if resolved is None:
            raise NotRegistered(f"pair {pair_id!r} (space fingerprint {space_fingerprint}) was revoked")
        return resolved

    def written(self) -> list[Space]:
        """The space generations this store's producers were granted (and still are)."""
        return [s for s in list(self.spaces.values()) if s is not None]

    def forget(self) -> None:
        """Ask the registry afresh on the next :meth:`space` / :meth:`pair`."""
        self.spaces.clear()
        self.pairs.clear()

    def refresh(self) -> None:
        """Re-read every cached answer (a revoked record becomes a refusal). Blocking."""
        spaces = {k: _answer(self.registry.authorize_write, k) for k in list(self.spaces)}
        pairs = {k: _answer(self.registry.resolve, k) for k in list(self.pairs)}
        self.spaces.update(spaces)
        self.pairs.update(pairs)

    # ----------------------------------------------------------------- the watch (on the store's loop)
    async def start(self) -> None:
        """Start watching the registry's version (``refresh_s`` > 0), read once now: before any answer is
        cached, so a change from here on is seen."""
        if self.refresh_s <= 0:
            return
        try:
            seen: int | None = await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                                self.registry.version)
        except Exception:  # noqa: BLE001 - an unreachable registry: the first successful read sets it
            seen = None
        self._task = asyncio.ensure_future(self._watch(seen))

    async def stop(self) -> None:
        """Stop the watch."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def shutdown(self) -> None:
        """Release the watch's thread (after the store's loop stopped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _watch(self, seen: int | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                version = await loop.run_in_executor(self._executor, self.registry.version)
                if version != seen:  # None: the registry was unreachable at start, its answers are re-read
                    await loop.run_in_executor(self._executor, self.refresh)
                    self.stats.inc("registry_refreshes")
                seen = version
            except Exception as exc:  # noqa: BLE001 - an unreachable registry keeps the answers it gave
                log.debug("registry version check failed: %s", exc)


def _answer(ask: Callable[..., T], key: Ask) -> T | None:
    """A registry answer, or None once it is refused."""
    try:
        return ask(*key)
    except RegistryError:
        return None
