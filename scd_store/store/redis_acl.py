"""Least-privilege Redis ACL users for each role of a deployment (the recipe docs/reliability.md prints).

- ``operator`` (``scd-store register`` / ``pairs`` / ``revoke``): reads and writes the registry only.
- ``producer`` of one space: writes and deletes (quarantine) that space's blobs, reads the registry,
  records its hashing canary, takes the bad keys readers reported, adds to the counters.
- ``consumer``: reads blobs and the registry (``PEXPIRE`` refreshes a verified hit's TTL: the only
  write it may make to a blob), reports bad keys and adds to the counters (``scd:__stats__*``). It
  cannot write or delete a blob, nor touch the registry.

Keys: blobs ``scd:{space}:v{format}.{generation}:{hash}``; registry ``scd:__registry__:*``; counters
``scd:__stats__*`` (:mod:`scd_store.store.keys`, :mod:`scd_store.store.registry`,
:mod:`scd_store.store.stats_sinks`).
"""

from __future__ import annotations

import shlex

from scd_store.store.keys import validate_space_id

ROLES = ("operator", "producer", "consumer")
_REGISTRY = "scd:__registry__:*"
_STATS = "scd:__stats__*"
_CONNECT = "+ping +select"
_STATS_CMDS = "+hincrby +expire +hset"


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
        return [*base, f"~scd:{space}:*", f"%R~{_REGISTRY}", f"%W~{_REGISTRY[:-1]}canaries", f"~{_STATS}",
                "+get", "+pexpire", "+mget", "+set", "+exists", "+del", "+hget", "+hgetall", "+hkeys", "+hdel",
                *_STATS_CMDS.split()]
    return [*base, "%R~scd:*", f"~{_STATS}", "+get", "+mget", "+exists", "+hget", "+hgetall", *_STATS_CMDS.split(),
            "(~scd:*:v*.*:* +pexpire)"]  # a selector: PEXPIRE (a hit refreshing its TTL) on blob keys only


def recipe(space_id: str = "SPACE", passwords: dict[str, str] | None = None) -> str:
    """The three users as ``redis-cli`` lines (``scd-operator``, ``scd-producer-<space>``, ``scd-consumer``)."""
    pw = {"operator": "OPERATOR_PASSWORD", "producer": "PRODUCER_PASSWORD", "consumer": "CONSUMER_PASSWORD",
          **(passwords or {})}
    lines = [acl_setuser("operator", "scd-operator", pw["operator"]),
             acl_setuser("producer", f"scd-producer-{space_id}", pw["producer"], space_id),
             acl_setuser("consumer", "scd-consumer", pw["consumer"])]
    return "\n".join("redis-cli " + " ".join(shlex.quote(arg) for arg in line) for line in lines)
