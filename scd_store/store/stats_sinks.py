"""Where a process's counters go, so that ``scd-store stats`` shows every process of a deployment.

- :class:`RedisStatsMirror` (when Redis is configured): every flush adds the process's deltas to the
  deployment-wide hash ``scd:__stats__`` and to the process's own ``scd:__stats__:proc:<host>-<pid>``
  (``HINCRBY``; kept 7 days after its last flush), and records the process in ``scd:__stats__:procs``.
- :class:`SnapshotFiles` (the embedded default, one host): each process writes its snapshot to
  ``<dir>/<host>-<pid>.json`` every flush and on close; readers add the files up.

Both read back as one *deployment view*: the totals (``counters``, ``latency``) and ``processes``,
each with its ``process`` record and its own counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scd_store.store.pids import pid_alive
from scd_store.store.stats import REDIS_STATS_KEY, StoreStats, merge_snapshots, snapshot_from_fields

PROCESS_TTL_S = 7 * 24 * 3600


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

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.id, "updated": time.time()}


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
        """HINCRBY every pending delta; on failure the deltas are kept for the next flush."""
        pending = stats.take_pending()
        if not pending:
            return
        own = f"{REDIS_STATS_KEY}:proc:{self.process.id}"
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, amount in pending.items():
                pipe.hincrby(REDIS_STATS_KEY, name, amount)
                pipe.hincrby(own, name, amount)
            pipe.expire(own, PROCESS_TTL_S)
            pipe.hset(f"{REDIS_STATS_KEY}:procs", self.process.id, json.dumps(self.process.record()))
            pipe.execute()
        except Exception:
            stats.restore_pending(pending)
            raise

    def read(self) -> dict[str, Any]:
        """The deployment view: totals and every process seen in the last 7 days."""
        view = snapshot_from_fields(_ints(self.client.hgetall(REDIS_STATS_KEY)))
        processes = []
        for pid, record in sorted(self.client.hgetall(f"{REDIS_STATS_KEY}:procs").items()):
            pid = pid.decode() if isinstance(pid, bytes) else pid
            own = self.client.hgetall(f"{REDIS_STATS_KEY}:proc:{pid}")
            if own:
                processes.append({"process": json.loads(record), **snapshot_from_fields(_ints(own))})
        return {**view, "processes": processes}

    def close(self) -> None:
        self.client.close()


def _ints(raw: dict) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


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
            json.dump({"process": self.process.record(), **stats.snapshot()}, f)
        os.replace(tmp, self.path)


def read_redis_stats(url: str) -> dict[str, Any]:
    """The deployment view kept in Redis at ``url``."""
    mirror = RedisStatsMirror(url)
    try:
        return mirror.read()
    finally:
        mirror.close()


def read_snapshot_files(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The deployment view of one host's per-process snapshot files (unreadable files are skipped)."""
    processes = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "counters" in data:
            processes.append(data)
    total = merge_snapshots(processes)
    return {**total, "processes": processes}
