"""Least-privilege Redis ACL users for each role of a deployment (the recipe docs/reliability.md prints).

The blobs' instance (the Redis tier, and the registry unless ``registry_url`` names another):

- ``operator`` (``scd-store register`` / ``pairs`` / ``revoke``): reads and writes the registry only.
- ``producer`` of one space: writes, deletes (quarantine) and refreshes the TTL of (``PEXPIRE``) that space's
  blobs only, reads the registry, writes only its own space's hashing canary
  (``scd:__registry__:canaries:{space}``), and subscribes to its space's report channels
  (``scd:__reports__:{space}:*``) and to eviction events (``__keyevent@*__:evicted``).
- ``consumer``: reads blobs and the registry, and publishes reports (``PUBLISH`` on ``scd:__reports__:*``).
  It writes no key at all: no command it may run deletes, expires or writes a blob, touches the registry, or
  stores anything in the instance's memory (a published message is not stored), so no consumer can make the
  instance evict the producers' blobs.

The counters' instance (``stats_redis_url``: an instance of their own, so that counters, which every process
writes and nothing trusts, never share memory with blobs):

- ``stats``: every engine process, and ``scd-store stats``: adds to and reads ``scd:__stats__*`` only.

Keys: blobs ``scd:{space}:v{format}.{generation}:{hash}``; registry ``scd:__registry__:*``; counters
``scd:__stats__*`` (:mod:`scd_store.store.keys`, :mod:`scd_store.store.registry`,
:mod:`scd_store.store.stats_sinks`); report channels :mod:`scd_store.store.tiers.redis_reports`. A space id
cannot start with ``_`` nor hold ``:`` or a glob character, so ``scd:{space}:*`` matches that space's blobs only.
"""

from __future__ import annotations

import shlex

from scd_store.store.keys import validate_space_id
from scd_store.store.tiers.redis_reports import CHANNEL

ROLES = ("operator", "producer", "consumer", "stats")
_REGISTRY = "scd:__registry__:*"
_CANARIES = "scd:__registry__:canaries"  # + ":{space}" (scd_store.store.registry.REDIS_CANARIES)
_STATS = "scd:__stats__*"
_EVICTIONS = "__keyevent@*__:evicted"
_CONNECT = "+ping +select"
_READ = "+get +mget +getrange +exists +hget +hgetall +hscan"
# What the blobs' instance must be told by its administrator (not by scd-store: CONFIG needs an admin user).
# Redis counts every client's buffers toward maxmemory and has no per-user memory limit, so the clients' memory
# is capped together (maxmemory-clients: past it the largest clients are disconnected) and per client (output
# buffers, the largest bulk argument); size maxmemory to hold the blobs plus that cap, and no client can make
# Redis evict a blob.
SERVER_SETTINGS = (("maxmemory-policy", "volatile-lru"), ("notify-keyspace-events", "Ee"),
                   ("maxmemory-clients", "32mb"), ("proto-max-bulk-len", "64mb"),
                   ("client-output-buffer-limit", "normal 16mb 4mb 10 pubsub 8mb 2mb 60"))


def acl_setuser(role: str, user: str, password: str, space_id: str | None = None) -> list[str]:
    """The ``ACL SETUSER`` arguments (one list, as ``redis-cli ACL SETUSER ...`` takes them) for ``user``
    in ``role`` (a producer names its ``space_id``)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if (role == "producer") != (space_id is not None):
        raise ValueError("a producer user names its space id; the other roles none")
    base = ["ACL", "SETUSER", user, "reset", "on", f">{password}", "-@all", *_CONNECT.split()]
    if role == "operator":
        return [*base, f"~{_REGISTRY}", "+hget", "+hgetall", "+hset", "+hsetnx", "+hdel", "+get", "+incrby"]
    if role == "producer":
        space = validate_space_id(space_id or "")
        return [*base, f"~scd:{space}:*", f"%R~{_REGISTRY}", f"~{_CANARIES}:{space}", f"&{CHANNEL}:{space}:*",
                f"&{_EVICTIONS}", *_READ.split(), "+set", "+del", "+pexpire", "+hset", "+subscribe", "+unsubscribe"]
    if role == "consumer":
        return [*base, "%R~scd:*", f"&{CHANNEL}:*", *_READ.split(), "+publish"]
    return [*base, f"~{_STATS}", "+hget", "+hgetall", "+hscan", "+hincrby", "+hset", "+expire"]


def recipe(space_id: str = "SPACE", passwords: dict[str, str] | None = None) -> str:
    """``redis-cli`` lines: the blobs' instance's settings and users (``scd-operator``, ``scd-producer-<space>``,
    ``scd-consumer``), then the counters' instance's user (``scd-stats``)."""
    pw = {"operator": "OPERATOR_PASSWORD", "producer": "PRODUCER_PASSWORD", "consumer": "CONSUMER_PASSWORD",
          "stats": "STATS_PASSWORD", **(passwords or {})}
    blobs = [["CONFIG", "SET", name, value] for name, value in SERVER_SETTINGS]
    blobs += [acl_setuser("operator", "scd-operator", pw["operator"]),
              acl_setuser("producer", f"scd-producer-{space_id}", pw["producer"], space_id),
              acl_setuser("consumer", "scd-consumer", pw["consumer"])]
    lines = ["# the blobs' instance (the Redis tier's url)", *("redis-cli " + shlex.join(line) for line in blobs),
             "# the counters' instance (stats_redis_url): every process's user there",
             "redis-cli -p STATS_PORT " + shlex.join(acl_setuser("stats", "scd-stats", pw["stats"]))]
    return "\n".join(lines)
