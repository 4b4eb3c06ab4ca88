"""Readers' reports to a space's producer over Redis pub/sub, and the producer's watch on evictions.

Readers never write a key in the blobs' Redis: they ``PUBLISH`` their reports (verified hits, keys they
found bad) on the space generation's channel ``scd:__reports__:{space}:{generation}``. Redis stores no
published message, so no reader can fill the instance's memory with reports and make it evict codes (a
subscriber's pending messages are bounded by the server's ``client-output-buffer-limit pubsub``). A message
is one JSON object ``{"kind": "hits" | "suspects", "keys": [...]}`` of at most :data:`MAX_REPORT_BYTES`
bytes and :data:`MAX_REPORT_KEYS` keys.

The producer's :class:`ReportInbox` subscribes, on a thread and a connection of its own, to the channels
of the space generations it writes and to Redis's eviction events (``__keyevent@{db}__:evicted``: sent when
the server runs with ``notify-keyspace-events`` holding ``E`` and ``e``; in Cluster mode only the node its
connection reaches sends them, so ``evicted_blobs`` counts that node's). It keeps at most
:data:`MAX_PENDING` reported keys per kind and space generation (more are dropped: ``dropped_reports``; a
malformed message is ``refused_reports``), until the repair round takes them
(:class:`~scd_store.store.repair.ProducerRepair`). Evictions of its own space generations' blobs are counted
(``evicted_blobs``). Delivery is at most once: reports published while no producer listens are lost (a
reader reports a bad blob again each time it reads it; a hit not reported leaves a TTL unrefreshed). A
channel Redis refuses, or a lost connection (Redis cuts a subscriber whose unread messages pass its
``client-output-buffer-limit pubsub``), is logged once and counted (``subscription_errors``), and made
again with backoff.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from scd_store.store import strict_json
from scd_store.store.keys import KeyError_, parse_key

CHANNEL = "scd:__reports__"  # + ":{space_id}:{generation}"
KINDS = ("hits", "suspects")
MAX_REPORT_BYTES = 64 << 10  # one published message, as read: larger ones are refused unparsed
MAX_REPORT_KEYS = 512  # keys per message
MAX_KEY_CHARS = 512
MAX_PENDING = 8192  # reported keys a producer keeps per kind and space generation until its repair takes them
RETRY_MIN_S, RETRY_MAX_S = 0.1, 5.0
log = logging.getLogger("scd_store.store")
Count = Callable[..., None]  # (counter, amount, space=...)


def channel_of(scope: str) -> str:
    """The report channel of a space generation (``{space_id}:{generation}``)."""
    return f"{CHANNEL}:{scope}"


def report_messages(kind: str, keys: Sequence[str]) -> list[bytes]:
    """``keys`` as messages of ``kind``, each within the bounds (a key too long for one is left out)."""
    if kind not in KINDS:
        raise ValueError(f"report kind must be one of {KINDS}, got {kind!r}")
    messages: list[bytes] = []
    batch: list[str] = []
    size = 0
    for key in (k for k in keys if len(k) <= MAX_KEY_CHARS):
        if batch and (len(batch) == MAX_REPORT_KEYS or size + len(key) + 3 > MAX_REPORT_BYTES - 64):
            messages.append(json.dumps({"kind": kind, "keys": batch}).encode())
            batch, size = [], 0
        batch.append(key)
        size += len(key) + 3
    if batch:
        messages.append(json.dumps({"kind": kind, "keys": batch}).encode())
    return messages


def parse_report(data: Any) -> tuple[str, list[str]] | None:
    """``(kind, keys)`` of a published message, or None when it is no report within the bounds."""
    if not isinstance(data, (bytes, str)) or len(data) > MAX_REPORT_BYTES:
        return None
    try:
        obj = strict_json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"kind", "keys"} or obj["kind"] not in KINDS:
        return None
    keys = obj["keys"]
    if not isinstance(keys, list) or len(keys) > MAX_REPORT_KEYS or \
            not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys):
        return None
    return obj["kind"], keys


class ReportInbox:
    """The producer's subscription, on a thread and a connection of its own (nothing it reads or parses runs on
    the store's loop): reports by (kind, space generation), evictions counted.

    ``make_client()`` gives a fresh blocking redis-py client for the tier's URL; ``db`` names the eviction
    channel; ``count(counter, n, space=...)`` adds to the store's counters. A channel Redis refuses (the user's
    ACL) or a lost connection is logged once, counted (``subscription_errors``) and tried again with backoff."""

    def __init__(self, make_client: Callable[[], Any], db: int, count: Count, *, hits: bool = True) -> None:
        self._make_client = make_client
        self.evicted_channel = f"__keyevent@{db}__:evicted"
        self._count = count
        self._hits = hits  # whether hits are kept (a tier without a TTL has none to refresh)
        self._lock = threading.Lock()
        self._scopes: set[str] = set()
        self._subscribed: set[str] = set()
        self._refused: dict[str, float] = {}  # channel -> when Redis refused it (tried again after RETRY_MAX_S)
        self._pending: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- the repair round's side (any thread)
    def watch(self, scope: str) -> None:
        """Listen for ``scope``'s reports (and its evictions) from now on."""
        with self._lock:
            self._scopes.add(scope)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="scd-store-reports", daemon=True)
                self._thread.start()

    def subscribed(self, scope: str) -> bool:
        """Whether ``scope``'s channel is subscribed now (reports published from here on are received)."""
        with self._lock:
            return channel_of(scope) in self._subscribed

    def take(self, kind: str, scope: str, limit: int) -> list[str]:
        """Up to ``limit`` reported keys of ``kind`` in ``scope``, left in place until :meth:`clear`."""
        with self._lock:
            pending = self._pending.get((kind, scope))
            return list(pending)[:max(0, limit)] if pending else []

    def clear(self, kind: str, scope: str, keys: Sequence[str]) -> None:
        with self._lock:
            pending = self._pending.get((kind, scope))
            if pending is not None:
                for key in keys:
                    pending.pop(key, None)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ----------------------------------------------------------------- the listener's thread
    def _run(self) -> None:
        delay = RETRY_MIN_S
        while not self._stop.is_set():
            client = pubsub = None
            started = time.monotonic()
            try:
                client = self._make_client()
                pubsub = client.pubsub()
                self._listen(pubsub)
            except Exception as exc:  # noqa: BLE001 - a lost connection: counted, re-made with backoff
                self._error("connection", f"the producer's report subscription was lost ({exc}); reports and "
                            "evictions are not heard until it is made again (counted as subscription_errors)")
            finally:
                with self._lock:
                    self._subscribed.clear()
                for part in (pubsub, client):
                    with contextlib.suppress(Exception):
                        part.close()
            if time.monotonic() - started > 10 * RETRY_MAX_S:
                delay = RETRY_MIN_S  # it was up a good while: a fresh failure starts the backoff again
            self._stop.wait(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    def _listen(self, pubsub: Any) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                wanted = [channel_of(s) for s in sorted(self._scopes)] + [self.evicted_channel]
                wanted = [c for c in wanted if c not in self._subscribed
                          and now - self._refused.get(c, -RETRY_MAX_S * 12) >= RETRY_MAX_S * 12]
            for channel in wanted:
                self._subscribe(pubsub, channel)
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None:
                self._handle(message)

    def _subscribe(self, pubsub: Any, channel: str) -> None:
        """Subscribe ``channel`` and wait (briefly) for Redis's answer, handling what arrives meanwhile."""
        from redis.exceptions import NoPermissionError

        try:
            pubsub.subscribe(channel)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=0.2)
                if message is None:
                    continue
                if message.get("type") == "subscribe" and _text(message.get("channel")) == channel:
                    with self._lock:
                        self._subscribed.add(channel)
                    return
                self._handle(message)
        except NoPermissionError:
            with self._lock:
                self._refused[channel] = time.monotonic()
            what = "evictions (its blobs' evictions are not counted)" if channel == self.evicted_channel else \
                "its readers' reports (bad blobs are not repaired, hits not refreshed)"
            self._error(channel, f"Redis refuses the producer's subscription to {channel}: it hears no {what}; "
                        "grant its user the channel (docs/reliability.md's recipe; counted as subscription_errors)")

    def _handle(self, message: Any) -> None:
        if message.get("type") == "message":
            self._receive(_text(message.get("channel")), message.get("data"))

    def _error(self, what: str, text: str) -> None:
        self._count("subscription_errors", 1)
        if what not in self._warned:
            self._warned.add(what)
            log.warning("scd-store: %s", text)

    def _receive(self, channel: str, data: Any) -> None:
        if channel == self.evicted_channel:
            self._evicted(_text(data))
            return
        scope = channel[len(CHANNEL) + 1:] if channel.startswith(CHANNEL + ":") else ""
        with self._lock:
            if scope not in self._scopes:
                return
        report = parse_report(data)
        space = scope.split(":", 1)[0]
        if report is None:
            self._count("refused_reports", 1, space=space)
            return
        kind, keys = report
        if kind == "hits" and not self._hits:
            return
        dropped = 0
        with self._lock:
            pending = self._pending.setdefault((kind, scope), OrderedDict())
            for key in keys:
                if key in pending:
                    continue
                if len(pending) >= MAX_PENDING:
                    dropped += 1
                    continue
                pending[key] = None
        if dropped:
            self._count("dropped_reports", dropped, space=space)

    def _evicted(self, key: str) -> None:
        try:
            parts = parse_key(key)
        except KeyError_:
            return
        with self._lock:
            ours = f"{parts.space_id}:{parts.generation}" in self._scopes
        if ours:
            self._count("evicted_blobs", 1, space=parts.space_id)


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value or "")
