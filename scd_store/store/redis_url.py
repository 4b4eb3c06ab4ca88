"""Redis clients from one URL: standalone, TLS, Cluster and Sentinel; credentials from the URL.

Accepted forms::

    redis://[user[:password]@]host:port[/db][?opt=...]            standalone
    rediss://...                                                  standalone over TLS
    redis+cluster://[user[:password]@]host:port[,host:port...]   Cluster (seed nodes); rediss+cluster for TLS
    redis+sentinel://[user[:password]@]host:port[,host:port...]/service_name[/db]   Sentinel; rediss+sentinel

A ``?cluster=true`` query on a ``redis://`` / ``rediss://`` URL also selects Cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


class RedisURLError(ValueError):
    """A Redis URL that cannot be understood."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL."""

    mode: str  # "standalone" | "cluster" | "sentinel"
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    db: int
    service_name: str | None
    url: str

    def redacted(self) -> str:
        """The URL with the password hidden (for logs)."""
        return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", self.url, count=1)


def parse_redis_url(url: str) -> RedisTarget:
    if not isinstance(url, str) or "://" not in url:
        raise RedisURLError(f"not a Redis URL: {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise RedisURLError(f"unsupported Redis URL scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    parts = urlsplit("x://" + rest)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if _ else None
        if password is None and username is not None:  # redis://secret@host means a password
            username, password = None, username
    hosts: list[tuple[str, int]] = []
    for hostport in filter(None, netloc.split(",")):
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, "6379"
        try:
            hosts.append((host.strip("[]"), int(port)))
        except ValueError as exc:
            raise RedisURLError(f"bad port in Redis URL host {hostport!r}") from exc
    if not hosts:
        raise RedisURLError(f"Redis URL has no host: {url!r}")
    query = parse_qs(parts.query)
    mode = "standalone"
    if scheme.endswith("+cluster") or query.get("cluster", ["false"])[0].lower() in ("1", "true", "yes"):
        mode = "cluster"
    elif scheme.endswith("+sentinel"):
        mode = "sentinel"
    path = [p for p in parts.path.split("/") if p]
    service_name = None
    if mode == "sentinel":
        if not path:
            raise RedisURLError("a Sentinel URL needs the master's service name: redis+sentinel://host:port/NAME")
        service_name, path = path[0], path[1:]
    try:
        db = int(path[0]) if path else int(query.get("db", ["0"])[0])
    except ValueError as exc:
        raise RedisURLError(f"bad database number in {url!r}") from exc
    if mode == "standalone" and len(hosts) > 1:
        raise RedisURLError("a standalone Redis URL takes one host; use redis+cluster:// or redis+sentinel://")
    if mode == "cluster" and db != 0:
        raise RedisURLError("Redis Cluster has only database 0")
    return RedisTarget(mode, scheme.startswith("rediss"), tuple(hosts), username, password, db, service_name, url)


def _common(target: RedisTarget, socket_timeout: float | None, connect_timeout: float | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout}
    if target.username is not None:
        kwargs["username"] = target.username
    if target.password is not None:
        kwargs["password"] = target.password
    if target.tls:
        kwargs["ssl"] = True
    return kwargs


def make_async_client(url: str, *, socket_timeout: float | None = 2.0, connect_timeout: float | None = 1.0,
                      max_connections: int = 32) -> Any:
    """An asyncio client (``redis.asyncio``) for ``url``; nothing is connected until first use."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff

    target = parse_redis_url(url)
    kwargs = _common(target, socket_timeout, connect_timeout)
    if target.mode == "cluster":
        nodes = [ClusterNode(h, p) for h, p in target.hosts]
        return RedisCluster(startup_nodes=nodes, max_connections=max_connections, **kwargs)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=_common(target, socket_timeout, connect_timeout),
                            **kwargs)
        return sentinel.master_for(target.service_name, db=target.db)
    host, port = target.hosts[0]
    return Redis(host=host, port=port, db=target.db, max_connections=max_connections, **kwargs)


def make_sync_client(url: str, *, socket_timeout: float | None = 2.0, connect_timeout: float | None = 1.0) -> Any:
    """A blocking client for ``url`` (registry, stats readers)."""
    from redis import Redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.sentinel import Sentinel

    target = parse_redis_url(url)
    kwargs = _common(target, socket_timeout, connect_timeout)
    if target.mode == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **kwargs)
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=_common(target, socket_timeout, connect_timeout),
                            **kwargs)
        return sentinel.master_for(target.service_name, db=target.db)
    host, port = target.hosts[0]
    return Redis(host=host, port=port, db=target.db, **kwargs)
