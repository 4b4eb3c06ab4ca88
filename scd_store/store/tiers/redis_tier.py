"""The Redis tier: shared, remote blobs through redis-py asyncio (hiredis parser when installed).

Each blob is written with ONE ``SET`` (optionally with a TTL), which Redis applies atomically: a
reader sees the whole old value, the whole new value or nothing. Readers may neither delete, expire
nor write anything in this instance (their ACL user has no command that could): they publish their
reports to the space's producer (:mod:`~scd_store.store.tiers.redis_reports`: verified hits, whose TTL
the producer may refresh, and keys they found bad, which it verifies itself and repairs), and Redis
stores none of it. The producer's tier subscribes (:meth:`RedisTier.watch_reports`), keeps the reports
in a bounded inbox until the repair round takes them, and counts evictions of its blobs
(``evicted_blobs``, with ``notify-keyspace-events Ee`` on the server). Values above ``max_value_bytes``
are refused (counted in ``rejected``). A total byte budget is the server's job: ``maxmemory`` with
``maxmemory-policy volatile-lru``, which evicts only keys with a TTL (blobs), never the registry
(docs/store.md). The tier changes no server setting unless ``server_maxmemory`` asks it to
(``CONFIG SET`` needs an admin user).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scd_store.store.redis_url import make_async_client, make_sync_client, parse_redis_url
from scd_store.store.tiers.base import Tier, TierUsage
from scd_store.store.tiers.redis_reports import ReportInbox, channel_of, report_messages

T = TypeVar("T")
LIFETIME_TTLS = 8  # the default longest life of a blob whose TTL its producer refreshes, in TTLs


class RedisTier(Tier):
    """Blobs in Redis (standalone, TLS, Sentinel or Cluster, chosen by the URL)."""

    kind = "redis"
    shared = True

    def __init__(self, url: str, *, ttl_s: float | None = None, max_value_bytes: int = 512 << 20,
                 server_maxmemory: int | None = None, maxmemory_policy: str = "volatile-lru",
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, name: str | None = None,
                 max_lifetime_s: float | None = None) -> None:
        super().__init__(name)
        self.target = parse_redis_url(url)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"redis tier ttl_s must be > 0 or None, got {ttl_s}")
        if max_lifetime_s is not None and (ttl_s is None or max_lifetime_s < ttl_s):
            raise ValueError(f"redis tier max_lifetime_s ({max_lifetime_s}) needs a ttl_s no longer than it")
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.expires = self.ttl_ms is not None
        lifetime = max_lifetime_s if max_lifetime_s is not None else None if ttl_s is None else LIFETIME_TTLS * ttl_s
        self.max_lifetime_ms = None if lifetime is None else int(lifetime * 1000)
        self.max_value_bytes: int | None = max_value_bytes
        self.server_maxmemory = server_maxmemory
        self.maxmemory_policy = maxmemory_policy
        self._timeouts = (socket_timeout, connect_timeout)
        self._client: Any = None
        self.rejected = 0
        self.bytes_written = 0
        self.inbox: ReportInbox | None = None  # the producer's subscription, from its first watch_reports()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_async_client(self.target.url, socket_timeout=self._timeouts[0],
                                             connect_timeout=self._timeouts[1])
        return self._client

    @property
    def is_cluster(self) -> bool:
        return self.target.mode == "cluster"

    async def start(self) -> None:
        _ = self.client
        if self.server_maxmemory is not None:
            await self.client.config_set("maxmemory", str(self.server_maxmemory))
            await self.client.config_set("maxmemory-policy", self.maxmemory_policy)

    async def close(self) -> None:
        if self.inbox is not None:
            await asyncio.to_thread(self.inbox.close)
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def _run(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(client)``; on a connection failure drop the whole client (its pooled connections may
        all be stale after a server restart) so the next call starts from fresh connections."""
        client = self.client
        try:
            return await fn(client)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if self._client is client:
                self._client = None
                with contextlib.suppress(Exception):
                    await client.aclose()
            raise

    async def get(self, key: str) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, each read with ``GETRANGE 0 max_value_bytes``: a value another writer made
        larger than the tier's bound comes back cut one byte past it (a blob that fails verification), never
        whole into this process's memory (``EXISTS`` in the same pipeline tells a missing key from an empty value,
        which is damage to report)."""
        if not keys:
            return []
        if self.max_value_bytes is None:
            if self.is_cluster:
                return list(await self._run(lambda c: c.mget_nonatomic(list(keys))))
            return list(await self._run(lambda c: c.mget(list(keys))))
        end = int(self.max_value_bytes)

        async def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
                pipe.getrange(key, 0, end)
            return await pipe.execute()

        replies = await self._run(read)
        return [value if exists else None for exists, value in zip(replies[::2], replies[1::2], strict=True)]

    def _accept(self, value: bytes) -> bool:
        if len(value) > self.max_value_bytes:
            self.rejected += 1
            return False
        return True

    async def put(self, key: str, value: bytes) -> None:
        if self._accept(value):
            await self._run(lambda c: c.set(key, value, px=self.ttl_ms))
            self.bytes_written += len(value)

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        accepted = [(k, v) for k, v in items if self._accept(v)]
        if not accepted:
            return
        if len(accepted) == 1:
            await self.put(*accepted[0])
            return
        async def write(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for key, value in accepted:
                pipe.set(key, value, px=self.ttl_ms)
            await pipe.execute()

        await self._run(write)
        self.bytes_written += sum(len(v) for _, v in accepted)

    async def contains(self, key: str) -> bool:
        return bool(await self._run(lambda c: c.exists(key)))

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        async def check(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return await pipe.execute()

        return [bool(n) for n in await self._run(check)]

    async def delete(self, key: str) -> bool:
        return bool(await self._run(lambda c: c.delete(key)))

    async def delete_many(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        return int(await self._run(lambda c: c.delete(*keys)))  # the cluster client splits it by slot

    async def touch_many(self, keys: Sequence[str], ttls_ms: Sequence[int] | None = None) -> int:
        if self.ttl_ms is None or not keys:
            return 0
        ttls = list(ttls_ms) if ttls_ms is not None else [self.ttl_ms] * len(keys)

        async def touch(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key, ttl in zip(keys, ttls, strict=True):
                pipe.pexpire(key, max(1, min(int(ttl), self.ttl_ms)))  # positive; a key that is gone stays gone
            return await pipe.execute()

        return sum(bool(n) for n in await self._run(touch))

    async def _report(self, kind: str, scope: str, keys: Sequence[str]) -> None:
        """Publish ``keys`` to ``scope``'s producer (stored nowhere in Redis)."""
        if not keys:
            return
        channel = channel_of(scope)
        messages = report_messages(kind, keys)

        async def publish(client: Any) -> None:
            for message in messages:
                await client.publish(channel, message)

        await self._run(publish)

    async def report_hits(self, scope: str, keys: Sequence[str]) -> None:
        await self._report("hits", scope, keys)

    async def report_suspects(self, scope: str, keys: Sequence[str]) -> None:
        await self._report("suspects", scope, keys)

    def watch_reports(self, scope: str) -> None:
        """The producer's subscription to ``scope``'s reports (and its blobs' evictions) starts now."""
        if self.inbox is None:
            url, timeouts = self.target.url, self._timeouts
            self.inbox = ReportInbox(lambda: make_sync_client(url, socket_timeout=max(5.0, timeouts[0]),
                                                              connect_timeout=timeouts[1], retry=False),
                                     self.target.db, lambda name, n, space="": self._count(name, n, space=space),
                                     hits=self.expires)
        self.inbox.watch(scope)

    async def reports(self, kind: str, scope: str, limit: int) -> list[str]:
        self.watch_reports(scope)
        assert self.inbox is not None
        return self.inbox.take(kind, scope, limit)

    async def clear_reports(self, kind: str, scope: str, keys: Sequence[str]) -> None:
        if self.inbox is not None:
            self.inbox.clear(kind, scope, keys)

    def usage(self) -> TierUsage:
        return TierUsage(0, self.bytes_written, self.server_maxmemory)
