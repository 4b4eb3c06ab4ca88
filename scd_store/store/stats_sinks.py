"""Where a process's counters go, so that ``scd-store stats`` shows every process of a deployment.

- :class:`RedisStatsMirror` (when Redis is configured): every flush adds the process's deltas to the
  deployment-wide hash ``scd:__stats__`` and to the process's own ``scd:__stats__:proc:<host>-<pid>``
  (``HINCRBY``), records the process in ``scd:__stats__:procs`` and gives all three a TTL of 7 days
  (refreshed by every flush: under ``volatile-lru`` they are evictable, like blobs). Every process may
  write them, consumers too, so the reader trusts nothing it reads: ``HSCAN`` up to
  :data:`MAX_FIELDS` fields in all, only fields of the schema (:func:`~scd_store.store.stats.accepted_fields`),
  at most :data:`MAX_PROCESSES` process records, each a bounded JSON object whose fields are checked.
- :class:`SnapshotFiles` (the embedded default, one host): each process writes its snapshot to
  ``<dir>/<host>-<pid>.json`` every flush and on close; readers add the files up.

Both read back as one *deployment view*: the totals (``counters``, ``latency``) and ``processes``,
each with its ``process`` record and its own counters.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scd_store.store.pids import pid_alive
from scd_store.store.stats import (
    INT64_MAX,
    REDIS_STATS_KEY,
    StoreStats,
    accepted_fields,
    merge_snapshots,
    snapshot_fields,
    snapshot_from_fields,
    valid_label,
)

PROCESS_TTL_S = 7 * 24 * 3600  # every stats key's TTL, refreshed by each flush
log = logging.getLogger("scd_store.store")
MAX_FIELDS = 200_000  # hash fields one read takes, the totals and every process's together
MAX_PROCESSES = 256  # process rows one read shows (the most recently updated)
MAX_RECORD_BYTES = 4096  # a process record longer than this is skipped
MAX_SERVES = 16  # models a process record names
ROLES = ("producer", "consumer")
SCAN_COUNT = 1000


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """Who is counting: host, pid, program name and start time."""

    host: str
    pid: int
    name: str
    started: float = field(default_factory=time.time)

    @property
    def id(self) -> str:
        return f"{self.host}-{self.pid}"

    @classmethod
    def current(cls, name: str | None = None) -> ProcessInfo:
        program = name or os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python") or "python"
        return cls(socket.gethostname(), os.getpid(), program)

    def record(self, serves: Mapping[str, str] | None = None) -> dict[str, Any]:
        """This process as its stats records name it; ``serves`` (model -> role) as far as it fits
        ``MAX_RECORD_BYTES``."""
        base = {**asdict(self), "id": self.id, "updated": time.time()}
        kept: dict[str, str] = {}
        for model, role in sorted((serves or {}).items())[:MAX_SERVES]:
            if len(json.dumps({**base, "serves": {**kept, model: role}})) > MAX_RECORD_BYTES:
                break
            kept[model] = role
        return {**base, "serves": kept} if kept else base


class StatsSink(ABC):
    """Receives a process's counters periodically (``flush``) and when its store closes."""

    @abstractmethod
    def flush(self, stats: StoreStats) -> None: ...

    def close(self) -> None:
        return None


class NoSink(StatsSink):
    """Keeps a process's counters to itself (a tool reading a deployment's store, not serving from it)."""

    def flush(self, stats: StoreStats) -> None:
        return None


class RedisStatsMirror(StatsSink):
    """Adds a :class:`StoreStats`' deltas to the deployment-wide and the per-process Redis hashes."""

    def __init__(self, url: str, client: Any = None, process: ProcessInfo | None = None) -> None:
        from scd_store.store.redis_url import make_sync_client

        self.client = client if client is not None else make_sync_client(url)
        self.process = process or ProcessInfo.current()

    def flush(self, stats: StoreStats) -> None:
        """HINCRBY every pending delta; when the round trip fails the deltas are kept for the next flush. A field
        another writer spoiled (a non-integer, an overflow) refuses its own HINCRBY only: that delta is dropped
        there, never re-added to the fields that took it."""
        pending = stats.take_pending()
        if not pending:
            return
        own = f"{REDIS_STATS_KEY}:proc:{self.process.id}"
        procs = f"{REDIS_STATS_KEY}:procs"
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, amount in pending.items():
                pipe.hincrby(REDIS_STATS_KEY, name, amount)
                pipe.hincrby(own, name, amount)
            pipe.hset(procs, self.process.id, json.dumps(self.process.record(stats.serves())))
            for key in (REDIS_STATS_KEY, own, procs):
                pipe.expire(key, PROCESS_TTL_S)
            results = pipe.execute(raise_on_error=False)
        except Exception:
            stats.restore_pending(pending)
            raise
        refused = sum(isinstance(r, Exception) for r in results)
        if refused:
            log.debug("stats flush: %d fields refused their increments (spoiled by another writer)", refused)

    def _scan(self, name: str, cap: int) -> dict[Any, Any]:
        """Up to ``cap`` fields of hash ``name`` (``HSCAN``: never the whole of an unbounded hash at once)."""
        return dict(itertools.islice(self.client.hscan_iter(name, count=SCAN_COUNT), max(0, cap)))

    def read(self) -> dict[str, Any]:
        """The deployment view: totals and the processes seen in the last 7 days (at most ``MAX_PROCESSES``, the
        most recently updated), read within ``MAX_FIELDS`` fields; fields and records not of the schema are
        skipped."""
        totals = self._scan(REDIS_STATS_KEY, MAX_FIELDS)
        budget = MAX_FIELDS - len(totals)
        records = []
        for pid, raw in self._scan(f"{REDIS_STATS_KEY}:procs", 4 * MAX_PROCESSES).items():
            pid = pid.decode("ascii", "replace") if isinstance(pid, bytes) else pid
            record = process_record(raw)
            if record is not None and valid_label(pid) and pid:
                records.append((record.get("updated", 0.0), pid, {**record, "id": pid}))  # the key names it
        newest = sorted(records, key=lambda r: r[0], reverse=True)[:MAX_PROCESSES]
        processes = []
        for _, pid, record in sorted(newest, key=lambda r: r[1]):
            own = self._scan(f"{REDIS_STATS_KEY}:proc:{pid}", budget)
            budget -= len(own)
            fields = accepted_fields(own)
            if fields:
                processes.append({"process": record, **snapshot_from_fields(fields)})
        return {**snapshot_from_fields(accepted_fields(totals)), "processes": processes}

    def close(self) -> None:
        self.client.close()


def process_record(raw: Any) -> dict[str, Any] | None:
    """A process record as read back (JSON of :meth:`ProcessInfo.record`), its fields checked; None when it
    is no JSON object of at most ``MAX_RECORD_BYTES`` bytes."""
    if isinstance(raw, (bytes, str)) and len(raw) <= MAX_RECORD_BYTES:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    else:
        obj = raw
    if not isinstance(obj, dict):
        return None
    record: dict[str, Any] = {k: obj[k] for k in ("host", "name", "id") if valid_label(obj.get(k))}
    pid = obj.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid <= INT64_MAX:
        record["pid"] = pid
    for key in ("started", "updated"):
        value = obj.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            record[key] = float(value)
    serves = obj.get("serves")
    if isinstance(serves, dict) and len(serves) <= MAX_SERVES:
        kept = {model: role for model, role in serves.items() if valid_label(model) and role in ROLES}
        if kept:
            record["serves"] = kept
    return record


def clean_snapshot(data: Any) -> dict[str, Any] | None:
    """A snapshot (file) as read back, its counters and histograms checked like the Redis fields, its process
    record like :func:`process_record`; None when it is no snapshot at all."""
    if not isinstance(data, dict) or not isinstance(data.get("counters"), list):
        return None
    clean = snapshot_from_fields(snapshot_fields(data))
    if "process" in data:
        clean["process"] = process_record(data["process"]) or {}
    return clean


class SnapshotFiles(StatsSink):
    """Writes the process's whole snapshot to ``<directory>/<host>-<pid>.json`` (atomically). On
    start it removes this host's files of processes that are gone and were last written over 7 days
    ago (the Redis records' lifetime)."""

    def __init__(self, directory: str | os.PathLike[str], process: ProcessInfo | None = None) -> None:
        self.directory = Path(directory)
        self.process = process or ProcessInfo.current()
        self._prune()

    def _prune(self) -> None:
        now = time.time()
        for path in self.directory.glob(f"{self.process.host}-*.json"):
            pid = path.stem[len(self.process.host) + 1:]
            try:
                old = now - path.stat().st_mtime > PROCESS_TTL_S
            except OSError:
                continue
            if old and pid.isdigit() and not pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    path.unlink()

    @property
    def path(self) -> Path:
        return self.directory / f"{self.process.id}.json"

    def flush(self, stats: StoreStats) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        stats.take_pending()  # files carry whole snapshots, not deltas
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.process.id}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"process": self.process.record(stats.serves()), **stats.snapshot()}, f)
        os.replace(tmp, self.path)


def read_redis_stats(url: str) -> dict[str, Any]:
    """The deployment view kept in Redis at ``url``."""
    mirror = RedisStatsMirror(url)
    try:
        return mirror.read()
    finally:
        mirror.close()


def read_snapshot_files(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The deployment view of one host's per-process snapshot files (unreadable or malformed files are skipped;
    at most ``MAX_PROCESSES`` files)."""
    processes = []
    for path in itertools.islice(sorted(Path(directory).glob("*.json")), MAX_PROCESSES):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        clean = clean_snapshot(data)
        if clean is not None:
            processes.append(clean)
    total = merge_snapshots(processes)
    return {**total, "processes": processes}
