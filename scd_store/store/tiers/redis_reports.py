"""Readers' reports to a space's producer over Redis pub/sub, and the producer's watch on evictions.

Readers never write a key in the blobs' Redis: they ``PUBLISH`` their reports (verified hits, keys they
found bad) on the space generation's channel ``scd:__reports__:{space}:{generation}``. Redis stores no
published message, so no reader can fill the instance's memory with reports and make it evict codes (a
subscriber's pending messages are bounded by the server's ``client-output-buffer-limit pubsub``). A message
is one JSON object ``{"kind": "hits" | "suspects", "keys": [...]}`` of at most :data:`MAX_REPORT_BYTES`
bytes and :data:`MAX_REPORT_KEYS` keys.

The producer's :class:`ReportInbox` subscribes to the channels of the space generations it writes and to
Redis's eviction events (``__keyevent@{db}__:evicted``: sent when the server runs with
``notify-keyspace-events`` holding ``E`` and ``e``). It keeps at most :data:`MAX_PENDING` reported keys per
kind and space generation (more are dropped: ``dropped_reports``; a malformed message is
``refused_reports``), until the repair round takes them (:class:`~scd_store.store.repair.ProducerRepair`).
Evictions of its own space generations' blobs are counted (``evicted_blobs``). Delivery is at most once:
reports published while no producer listens are lost (a reader reports a bad blob again each time it
reads it; a hit not reported leaves a TTL unrefreshed). A lost connection is re-made, with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
    """The producer's subscription: reports by (kind, space generation), evictions counted.

    ``make_pubsub()`` gives a fresh redis-py asyncio ``PubSub``; ``db`` names the eviction channel;
    ``count(counter, n, space=...)`` adds to the store's counters."""

    def __init__(self, make_pubsub: Callable[[], Any], db: int, count: Count) -> None:
        self._make_pubsub = make_pubsub
        self.evicted_channel = f"__keyevent@{db}__:evicted"
        self._count = count
        self._scopes: set[str] = set()
        self._subscribed: set[str] = set()
        self._pending: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- the repair round's side (the store's loop)
    def watch(self, scope: str) -> None:
        """Listen for ``scope``'s reports (and its evictions) from now on."""
        self._scopes.add(scope)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def subscribed(self, scope: str) -> bool:
        """Whether ``scope``'s channel is subscribed now (reports published from here on are received)."""
        return channel_of(scope) in self._subscribed

    def take(self, kind: str, scope: str, limit: int) -> list[str]:
        """Up to ``limit`` reported keys of ``kind`` in ``scope``, left in place until :meth:`clear`."""
        pending = self._pending.get((kind, scope))
        return list(pending)[:max(0, limit)] if pending else []

    def clear(self, kind: str, scope: str, keys: Sequence[str]) -> None:
        pending = self._pending.get((kind, scope))
        if pending is not None:
            for key in keys:
                pending.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    # ----------------------------------------------------------------- the listener
    async def _run(self) -> None:
        delay = RETRY_MIN_S
        while True:
            pubsub = self._make_pubsub()
            try:
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost connection: re-made with backoff
                log.debug("report subscription lost (%s); resubscribing in %.1f s", exc, delay)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    async def _listen(self, pubsub: Any) -> None:
        await pubsub.subscribe(self.evicted_channel)
        while True:
            wanted = {channel_of(s) for s in self._scopes} - self._subscribed
            if wanted:
                await pubsub.subscribe(*sorted(wanted))
                self._subscribed |= wanted
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None and message.get("type") == "message":
                self._receive(_text(message.get("channel")), message.get("data"))

    def _receive(self, channel: str, data: Any) -> None:
        if channel == self.evicted_channel:
            self._evicted(_text(data))
            return
        scope = channel[len(CHANNEL) + 1:] if channel.startswith(CHANNEL + ":") else ""
        if scope not in self._scopes:
            return
        report = parse_report(data)
        space = scope.split(":", 1)[0]
        if report is None:
            self._count("refused_reports", 1, space=space)
            return
        kind, keys = report
        pending = self._pending.setdefault((kind, scope), OrderedDict())
        dropped = 0
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
        if f"{parts.space_id}:{parts.generation}" in self._scopes:
            self._count("evicted_blobs", 1, space=parts.space_id)


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value or "")
