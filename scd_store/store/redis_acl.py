"""Least-privilege Redis ACL users for each role of a deployment (the recipe docs/reliability.md prints).

- ``operator`` (``scd-store register`` / ``pairs`` / ``revoke``): reads and writes the registry only.
- ``producer`` of one space: writes, deletes (quarantine) and refreshes the TTL of (``PEXPIRE``: the hits readers
  reported) that space's blobs only, reads the registry, writes only its own space's hashing canary
  (``scd:__registry__:canaries:{space}``), reads its space's reports with ``HSCAN`` and removes the ones
  it processed (``HDEL``: its own space's report hashes only), adds to the counters.
- ``consumer``: reads blobs and the registry; reports verified hits and bad keys and adds to the
  counters (``HSET`` / ``HINCRBY`` / ``EXPIRE`` under ``scd:__stats__*``). No command it may run deletes,
  expires or writes a blob, nor touches the registry.

The counters (and the reports) stay writable by every process: they are informational, a consumer
can forge them within their schema; the producer trusts no report (it verifies every reported key).

Keys: blobs ``scd:{space}:v{format}.{generation}:{hash}``; registry ``scd:__registry__:*``; counters and
reports ``scd:__stats__*`` (:mod:`scd_store.store.keys`, :mod:`scd_store.store.registry`,
:mod:`scd_store.store.stats_sinks`, :mod:`scd_store.store.tiers.redis_tier`). A space id cannot start
with ``_`` nor hold ``:`` or a glob character, so ``scd:{space}:*`` matches that space's blobs only.
"""

from __future__ import annotations

import shlex

from scd_store.store.keys import validate_space_id

ROLES = ("operator", "producer", "consumer")
_REGISTRY = "scd:__registry__:*"
_CANARIES = "scd:__registry__:canaries"  # + ":{space}" (scd_store.store.registry.REDIS_CANARIES)
_STATS = "scd:__stats__*"
_REPORTS = ("scd:__stats__:suspects", "scd:__stats__:hits")  # + ":{space}:{generation}" (redis_tier)
_CONNECT = "+ping +select"
_READ_STATS = "+hget +hgetall +hscan"
_WRITE_STATS = "+hincrby +hset +expire"


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
        own = [f"~scd:{space}:*", f"%R~{_REGISTRY}", f"~{_CANARIES}:{space}", *(f"~{r}:{space}:*" for r in _REPORTS)]
        stats = f"(~{_STATS} {_READ_STATS} {_WRITE_STATS})"  # a selector: counters and reports, of every space
        return [*base, *own, "+get", "+mget", "+getrange", "+exists", "+set", "+del", "+pexpire", *_READ_STATS.split(),
                "+hdel", *_WRITE_STATS.split(), stats]
    return [*base, "%R~scd:*", f"~{_STATS}", "+get", "+mget", "+getrange", "+exists", *_READ_STATS.split(),
            *_WRITE_STATS.split()]


def recipe(space_id: str = "SPACE", passwords: dict[str, str] | None = None) -> str:
    """The three users as ``redis-cli`` lines (``scd-operator``, ``scd-producer-<space>``, ``scd-consumer``)."""
    pw = {"operator": "OPERATOR_PASSWORD", "producer": "PRODUCER_PASSWORD", "consumer": "CONSUMER_PASSWORD",
          **(passwords or {})}
    lines = [acl_setuser("operator", "scd-operator", pw["operator"]),
             acl_setuser("producer", f"scd-producer-{space_id}", pw["producer"], space_id),
             acl_setuser("consumer", "scd-consumer", pw["consumer"])]
    return "\n".join("redis-cli " + " ".join(shlex.quote(arg) for arg in line) for line in lines)
