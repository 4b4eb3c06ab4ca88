"""The Redis tier: shared, remote blobs through redis-py asyncio (hiredis parser when installed).

Each blob is written with ONE ``SET`` (optionally with a TTL), which Redis applies atomically: a
reader sees the whole old value, the whole new value or nothing. With a TTL every verified hit
refreshes it (``PEXPIRE`` after the read path checked the blob: a bad blob is never kept alive), so
blobs in use stay and the rest expire. Readers may not delete: they report bad keys in
``scd:__stats__:suspects:{space}:{generation}`` (a hash readers may write), where the space's
producer takes them, verifies them itself and deletes or repairs them. Values above
``max_value_bytes`` are refused (counted in ``rejected``). A total byte budget is the server's job:
``maxmemory`` with ``maxmemory-policy volatile-lru``, which evicts only keys with a TTL (blobs),
never the registry or the counters (docs/store.md). The tier changes no server setting unless
``server_maxmemory`` asks it to (``CONFIG SET`` needs an admin user).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scd_store.store.redis_url import make_async_client, parse_redis_url
from scd_store.store.tiers.base import Tier, TierUsage

T = TypeVar("T")
SUSPECTS = "scd:__stats__:suspects"  # + ":{space_id}:{generation}": keys readers found bad (key -> unix time)


class RedisTier(Tier):
    """Blobs in Redis (standalone, TLS, Sentinel or Cluster, chosen by the URL)."""

    kind = "redis"
    shared = True

    def __init__(self, url: str, *, ttl_s: float | None = None, max_value_bytes: int = 512 << 20,
                 server_maxmemory: int | None = None, maxmemory_policy: str = "volatile-lru",
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, name: str | None = None) -> None:
        super().__init__(name)
        self.target = parse_redis_url(url)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"redis tier ttl_s must be > 0 or None, got {ttl_s}")
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.expires = self.ttl_ms is not None
        self.max_value_bytes: int | None = max_value_bytes
        self.server_maxmemory = server_maxmemory
        self.maxmemory_policy = maxmemory_policy
        self._timeouts = (socket_timeout, connect_timeout)
        self._client: Any = None
        self.rejected = 0
        self.bytes_written = 0

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
        return await self._run(lambda c: c.get(key))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        if self.is_cluster:
            return list(await self._run(lambda c: c.mget_nonatomic(list(keys))))
        return list(await self._run(lambda c: c.mget(list(keys))))

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

    async def touch_many(self, keys: Sequence[str]) -> None:
        if self.ttl_ms is None or not keys:
            return
        async def touch(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()

        await self._run(touch)

    async def report_suspects(self, scope: str, keys: Sequence[str]) -> None:
        if keys:
            stamp = str(int(time.time()))
            await self._run(lambda c: c.hset(f"{SUSPECTS}:{scope}", mapping=dict.fromkeys(keys, stamp)))

    async def take_suspects(self, scope: str, limit: int) -> list[str]:
        found = await self._run(lambda c: c.hkeys(f"{SUSPECTS}:{scope}"))
        keys = [k.decode() if isinstance(k, bytes) else k for k in found[:limit]]
        if keys:
            await self._run(lambda c: c.hdel(f"{SUSPECTS}:{scope}", *keys))
        return keys

    def usage(self) -> TierUsage:
        return TierUsage(0, self.bytes_written, self.server_maxmemory)
