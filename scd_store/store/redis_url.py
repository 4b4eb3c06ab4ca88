"""Redis clients from one URL: standalone, TLS, Cluster and Sentinel; credentials from the URL.

Accepted forms::

    redis://[user[:password]@]host:port[/db][?opt=...]            standalone
    rediss://...                                                  standalone over TLS
    redis+cluster://[user[:password]@]host:port[,host:port...]   Cluster (seed nodes); rediss+cluster for TLS
    redis+sentinel://[user[:password]@]host:port[,host:port...]/service_name[/db]   Sentinel; rediss+sentinel

A ``?cluster=true`` query on a ``redis://`` / ``rediss://`` URL also selects Cluster. TLS options
(``rediss`` schemes) go in the query: ``ssl_ca_certs`` (CA bundle path, e.g. for a self-signed
server certificate), ``ssl_certfile`` / ``ssl_keyfile`` (client certificate), ``ssl_cert_reqs``
(``required`` (default), ``optional``, ``none``) and ``ssl_check_hostname`` (``true`` / ``false``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from scd_store.errors import ScdStoreError

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


class RedisURLError(ScdStoreError, ValueError):
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
    tls_options: tuple[tuple[str, Any], ...] = ()

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
    tls = scheme.startswith("rediss")
    return RedisTarget(mode, tls, tuple(hosts), username, password, db, service_name, url, _tls_options(query, tls))


TLS_KEYS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def _tls_options(query: dict[str, list[str]], tls: bool) -> tuple[tuple[str, Any], ...]:
    given = {k: v[-1] for k, v in query.items() if k.startswith("ssl_")}
    if not given:
        return ()
    if not tls:
        raise RedisURLError(f"TLS options {sorted(given)} need a rediss:// URL")
    unknown = sorted(set(given) - set(TLS_KEYS))
    if unknown:
        raise RedisURLError(f"unknown TLS options {unknown}; known: {', '.join(TLS_KEYS)}")
    options: dict[str, Any] = {k: given[k] for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if k in given}
    if "ssl_cert_reqs" in given:
        if given["ssl_cert_reqs"] not in ("none", "optional", "required"):
            raise RedisURLError(f"ssl_cert_reqs must be none, optional or required, got {given['ssl_cert_reqs']!r}")
        options["ssl_cert_reqs"] = given["ssl_cert_reqs"]
    if "ssl_check_hostname" in given:
        flag = given["ssl_check_hostname"].lower()
        if flag not in ("true", "false", "1", "0", "yes", "no"):
            raise RedisURLError(f"ssl_check_hostname must be true or false, got {flag!r}")
        options["ssl_check_hostname"] = flag in ("true", "1", "yes")
    if ("ssl_certfile" in options) != ("ssl_keyfile" in options):
        raise RedisURLError("a client certificate needs both ssl_certfile and ssl_keyfile")
    return tuple(sorted(options.items()))


def _common(target: RedisTarget, socket_timeout: float | None, connect_timeout: float | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout}
    if target.username is not None:
        kwargs["username"] = target.username
    if target.password is not None:
        kwargs["password"] = target.password
    if target.tls:
        kwargs["ssl"] = True
        kwargs.update(dict(target.tls_options))
    return kwargs


def make_async_client(url: str, *, socket_timeout: float | None = 2.0, connect_timeout: float | None = 1.0,
                      max_connections: int = 32) -> Any:
    """An asyncio client (``redis.asyncio``) for ``url``; nothing is connected until first use."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    target = parse_redis_url(url)
    kwargs = _common(target, socket_timeout, connect_timeout)
    if target.mode == "cluster":
        nodes = [ClusterNode(h, p) for h, p in target.hosts]
        return RedisCluster(startup_nodes=nodes, max_connections=max_connections, **kwargs)
    # one immediate retry on a dropped connection: after a server restart every pooled connection is stale, and
    # the first command on each would otherwise fail (a miss, or a lost put); a timeout is never retried
    kwargs["retry"] = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=_common(target, socket_timeout, connect_timeout),
                            **kwargs)
        return sentinel.master_for(target.service_name, db=target.db)
    host, port = target.hosts[0]
    return Redis(host=host, port=port, db=target.db, max_connections=max_connections, **kwargs)


def make_sync_client(url: str, *, socket_timeout: float | None = 2.0, connect_timeout: float | None = 1.0,
                     retry: bool = True) -> Any:
    """A blocking client for ``url`` (registry, stats readers); ``retry=False``: a lost connection raises at once
    instead of being made again behind the caller's back (a subscriber that must know it missed messages)."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    target = parse_redis_url(url)
    kwargs = _common(target, socket_timeout, connect_timeout)
    if not retry:
        kwargs["retry"] = Retry(NoBackoff(), 0)
    if target.mode == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **kwargs)
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=_common(target, socket_timeout, connect_timeout),
                            **kwargs)
        return sentinel.master_for(target.service_name, db=target.db)
    host, port = target.hosts[0]
    return Redis(host=host, port=port, db=target.db, **kwargs)
