"""The peer tier: code blobs in other processes' registered memory, read over NIXL.

A process whose peer tier has ``publish_bytes`` keeps what it stores in a registered arena (its
:class:`BlobSource`) and records where each blob sits in a :class:`PeerDirectory`: one
:class:`~scd_store.store.transfer.entry.LocationEntry` per blob, bound to the SHA-256 of its source's
info and signed with the blob's space private key. Only the spaces this process produces are published
(what it read of other spaces and promoted is not); a space it holds no private key for is not published
either (``unsigned_puts``). Any process's peer tier looks entries up and, with a keyring,
trusts one only when its signature verifies with that space's public key and the source info the
directory then gives hashes to the signed digest; only then does it connect to that source (NIXL)
and read. Every entry is bounded (``max_value_bytes`` per blob, inside the source's region) and a
batch moves at most ``max_batch_bytes`` per transfer. A refused entry is a miss, counted
(``bad_signatures``: unsigned, forged, moved or naming another source info; ``corrupt_blobs``:
malformed or out of bounds) and logged once. Without a keyring (``allow_unsigned``) unsigned
entries are taken as they are.

A read that fails or times out is a miss; a stale location (the source's arena wrapped, or the
source is gone) reads other bytes or none, which the store's blob verification turns into a miss.
Readers never delete another process's blobs: a delete only drops this process's view of the entry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from scd_store.store.keys import KeyError_, parse_key, space_of
from scd_store.store.signing import SigningKey
from scd_store.store.tiers.base import Tier, TierUsage
from scd_store.store.transfer.base import DEFAULT_MAX_BATCH_BYTES, BlobReader, BlobSource, SourceInfo, TransferError
from scd_store.store.transfer.directory import PeerDirectory
from scd_store.store.transfer.entry import LocationEntry, info_digest
from scd_store.store.transfer.factory import make_reader, make_source

log = logging.getLogger("scd_store.store")
BAD_ENTRY = "refused_locations"  # unsigned, forged, moved, or bound to another source info
MALFORMED_ENTRY = "refused_locations"  # another key's, larger than max_value_bytes, outside the source's region
TRUST_S = 60.0  # a verified entry is verified again after this long (keys may have been removed)
MAX_TRUSTED = 1 << 16
MAX_SOURCES = 1024  # verified source infos kept
Resolved = dict[str, tuple[str, SourceInfo, list[tuple[int, LocationEntry]]]]  # source -> (digest, info, entries)


class PeerTier(Tier):
    """Blobs in peers' registered memory (and, with ``publish_bytes``, in this process's).

    ``max_value_bytes`` bounds every blob read (and written: at most ``publish_bytes`` too);
    ``max_batch_bytes`` (default: 64 MiB, or ``max_value_bytes`` if larger) bounds one transfer."""

    kind = "peer"
    shared = True

    def __init__(self, directory: PeerDirectory, *, publish_bytes: int = 0, transfer: str = "auto",
                 read_timeout_s: float = 1.0, max_value_bytes: int = 64 << 20, max_batch_bytes: int | None = None,
                 name: str | None = None) -> None:
        super().__init__(name)
        if publish_bytes < 0 or read_timeout_s <= 0 or max_value_bytes <= 0:
            raise ValueError("publish_bytes must be >= 0, read_timeout_s and max_value_bytes > 0")
        batch = max(DEFAULT_MAX_BATCH_BYTES, max_value_bytes) if max_batch_bytes is None else max_batch_bytes
        if batch < max_value_bytes:
            raise ValueError(f"max_batch_bytes ({batch}) must hold one blob of max_value_bytes ({max_value_bytes})")
        self.directory = directory
        self.publish_bytes = publish_bytes
        self.read_limit = max_value_bytes
        self.max_value_bytes = min(max_value_bytes, publish_bytes) if publish_bytes else max_value_bytes
        self.max_batch_bytes = batch
        self.transfer = transfer
        self.read_timeout_s = read_timeout_s
        self.source: BlobSource | None = None
        self._reader: BlobReader | None = None  # made on the first read (a process that only looks up needs none)
        self._source_name, self._digest = "", ""
        self._connected: dict[str, str] = {}  # source -> digest of the info it was connected with
        self._lock = threading.Lock()  # the reader's buffers are not for two transfers at once
        self._publish_lock = threading.Lock()  # publish and record in the same order
        self._meta_lock = threading.Lock()
        self._reader_lock = threading.Lock()
        self._infos: OrderedDict[str, tuple[str, SourceInfo]] = OrderedDict()  # verified source infos
        self._trusted: OrderedDict[str, tuple[LocationEntry, float]] = OrderedDict()  # verified entries
        self._once = self._incidents(log, limit=4096)  # one line per kind; kinds name sources: bounded

    async def start(self) -> None:
        if self.publish_bytes:
            self.source = make_source(self.publish_bytes, kind=self.transfer)
            info = self.source.info()
            self._source_name, self._digest = info.name, info_digest(info.to_bytes())
            self.directory.add_source(info)

    async def close(self) -> None:
        for part in (self._reader, self.source):
            if part is not None:
                part.close()
        self.directory.close()

    @property
    def reader(self) -> BlobReader:
        """The transfer's reader, made on first use: a process that only asks what peers hold (presence is
        read from the directory) never opens a transfer agent."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = make_reader(kind=self.transfer, max_batch_bytes=self.max_batch_bytes)
            return self._reader

    def _say(self, what: str, message: str, *args: object) -> None:
        """Log ``message`` once per ``what``."""
        self._once.log.warn(what, "peer tier %s: " + message, self.name, *args)

    def _incident(self, counter: str, what: str, message: str, *args: object, n: int = 1) -> None:
        """Count ``n`` in ``counter``; log ``message`` once per ``what``."""
        self._once.count(counter, "peer tier %s: " + message, self.name, *args, n=n, once=what)

    # ----------------------------------------------------------------- writes
    async def put(self, key: str, value: bytes) -> None:
        await self.put_many([(key, value)])

    async def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if self.source is None or not items:
            return  # a read-only peer tier holds nothing of its own
        await asyncio.to_thread(self._publish, list(items))

    def _signer(self, key: str) -> SigningKey | None:
        assert self.keyring is not None
        try:
            space_id = parse_key(key).space_id
        except KeyError_:
            return None
        return self.keyring.signer(space_id)

    def _publish(self, items: list[tuple[str, bytes]]) -> None:
        assert self.source is not None
        blobs: dict[str, bytes] = {}
        signers: dict[str, SigningKey | None] = {}
        for key, value in items:
            if not self.produces(space_of(key)):
                continue  # another space's blob this process read (a promotion): its producer publishes it
            signer = self._signer(key) if self.keyring is not None else None
            if self.keyring is not None and signer is None:
                self._incident("unsigned_puts", f"unsigned:{space_of(key)}", "no private key for %s's space: its "
                               "blobs are not published", key)
                continue
            blobs[key], signers[key] = value, signer
        if not blobs:
            return
        with self._publish_lock:
            refs = self.source.publish(blobs)
            self.directory.record_entries([LocationEntry.make(r, self._source_name, self._digest, signers[r.key])
                                           for r in refs])

    # ----------------------------------------------------------------- trust
    def _refuse(self, counter: str, entry: LocationEntry, why: str) -> None:
        self._incident(counter, f"{why}:{entry.source}", "refused an entry of source %r (%s): a miss", entry.source,
                       why)

    def _entry_ok(self, key: str, entry: LocationEntry) -> bool:
        """Whether ``entry`` is ``key``'s, within bounds and (with a keyring) validly signed."""
        if entry.key != key:
            self._refuse(MALFORMED_ENTRY, entry, "another key's entry")
            return False
        if entry.length > self.read_limit:
            self._refuse(MALFORMED_ENTRY, entry, f"claims more than max_value_bytes ({self.read_limit})")
            return False
        if self.keyring is None:
            return True
        if not entry.signed:
            self._refuse(BAD_ENTRY, entry, "unsigned")
            return False
        now = time.monotonic()
        with self._meta_lock:
            known = self._trusted.get(key)
        if known is not None and known[0] == entry and now - known[1] < TRUST_S:
            return True
        if not entry.verify(self.keyring):
            self._refuse(BAD_ENTRY, entry, "its signature does not verify: forged, moved, or an unknown key")
            return False
        with self._meta_lock:
            self._trusted.pop(key, None)
            self._trusted[key] = (entry, now)
            while len(self._trusted) > MAX_TRUSTED:
                self._trusted.popitem(last=False)
        return True

    def _source_info(self, source: str, wanted: set[str]) -> tuple[str, SourceInfo | None] | None:
        """``(digest, info)`` of ``source``: the verified one when it has a wanted digest, else the directory's
        (info None: malformed); None when the directory holds none (the source is gone: a miss)."""
        with self._meta_lock:
            known = self._infos.get(source)
        if known is not None and (known[0] in wanted or (self.keyring is None and wanted == {""})):
            return known
        raw = self.directory.source_bytes(source)
        if raw is None:
            return None
        try:
            info: SourceInfo | None = SourceInfo.from_bytes(raw)
        except TransferError:
            info = None
        return info_digest(raw), (info if info is not None and info.name == source else None)

    def _resolve(self, keys: Sequence[str]) -> Resolved:
        """The trusted entries of ``keys`` by source, with each source's verified info (nothing connected)."""
        groups: dict[str, list[tuple[int, LocationEntry]]] = {}
        for i, (key, entry) in enumerate(zip(keys, self.directory.entries(keys), strict=True)):
            if entry is not None and self._entry_ok(key, entry):
                groups.setdefault(entry.source, []).append((i, entry))
        malformed = self.directory.take_malformed()
        if malformed:
            self._incident(MALFORMED_ENTRY, "malformed", "%d directory entries did not parse (malformed or out of "
                           "range): misses", malformed, n=malformed)
        out: Resolved = {}
        for source, items in groups.items():
            found = self._source_info(source, {e.info_digest for _, e in items})
            if found is None:
                continue
            digest, info = found
            ok = []
            for i, entry in items:
                if info is None:
                    self._refuse(MALFORMED_ENTRY, entry, "its source info is malformed")
                elif entry.info_digest != digest and (self.keyring is not None or entry.info_digest):
                    self._refuse(BAD_ENTRY, entry, "the directory's source info is not the one the entry names")
                elif entry.offset + entry.length > info.size:
                    self._refuse(MALFORMED_ENTRY, entry, "outside its source's region")
                else:
                    ok.append((i, entry))
            if ok and info is not None:
                with self._meta_lock:
                    self._infos.pop(source, None)
                    self._infos[source] = (digest, info)
                    while len(self._infos) > MAX_SOURCES:
                        self._infos.popitem(last=False)
                out[source] = (digest, info, ok)
        return out

    # ----------------------------------------------------------------- reads
    async def get(self, key: str) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return await asyncio.to_thread(self._read, list(keys))

    def _read(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        for source, (digest, info, entries) in self._resolve(keys).items():
            with self._lock:
                if self._connected.get(source) != digest:  # only a verified source is ever connected
                    try:
                        self.reader.connect(info)
                    except Exception as exc:  # a peer we cannot reach is a miss
                        self._say(f"connect:{source}", "cannot connect to %s (%s): a miss", source, exc)
                        continue
                    self._connected[source] = digest
                blobs = self.reader.read(source, [e.ref for _, e in entries], timeout_s=self.read_timeout_s)
            for (i, _), blob in zip(entries, blobs, strict=True):
                out[i] = blob
        return out

    async def contains(self, key: str) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)
        for _, _, entries in (await asyncio.to_thread(self._resolve, list(keys))).values():
            for i, _ in entries:
                out[i] = True
        return out

    async def delete(self, key: str) -> bool:
        await self.delete_many([key])
        return True

    async def delete_many(self, keys: Sequence[str]) -> int:
        self.directory.forget(list(keys))
        return len(keys)

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, self.publish_bytes or None)
