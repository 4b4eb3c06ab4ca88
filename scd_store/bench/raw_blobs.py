"""Where the raw-KV baseline keeps its blobs: a directory every server reads (one host), or scd-store's own
tiers (Redis, the NIXL peer tier) so raw KV crosses the same link, over the same transport, as the codes.

Blobs are keyed by chunk hash; in a tier under the space ``raw-fp16`` (keys as scd-store's own, so the
tiers' bounds apply). The tiers here hold no keyring: the baseline's blobs are unsigned, and the raw
codec's own checks (a versioned, checked tensor pack) turn a bad blob into a miss.
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scd_store.store.build import build_tier
from scd_store.store.config import TierConfig
from scd_store.store.keys import generation_of, make_key
from scd_store.store.loop import LoopThread
from scd_store.store.tiers.base import Tier

RAW_SPACE = "raw-fp16"
RAW_GENERATION = generation_of("raw-fp16-baseline")


class RawBlobs(ABC):
    """Bytes by chunk hash; batched. ``remote``: a read waits on the network."""

    remote = False

    @abstractmethod
    def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]: ...

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    @abstractmethod
    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]: ...

    def close(self) -> None:
        return None


class DirectoryBlobs(RawBlobs):
    """One file per chunk in ``directory`` (written whole, then renamed)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, chunk_hash: bytes) -> Path:
        return self.directory / f"{chunk_hash.hex()}.kv"

    def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for chunk_hash in hashes:
            try:
                out.append(self.path(chunk_hash).read_bytes())
            except OSError:
                out.append(None)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for chunk_hash, blob in items:
            target = self.path(chunk_hash)
            if target.exists():
                continue
            tmp = target.with_suffix(f".{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, target)

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        return [self.path(h).is_file() for h in hashes]


class TierBlobs(RawBlobs):
    """scd-store tiers built from tier settings (as in a store config): writes go to every tier, a read
    takes each blob from the first tier that holds it. Every call is bounded by ``timeout_s``."""

    def __init__(self, tiers: Sequence[Mapping[str, Any]], timeout_s: float = 120.0) -> None:
        if not tiers:
            raise ValueError("raw_tiers needs at least one tier")
        built = [build_tier(TierConfig(**dict(t))) for t in tiers]
        self.tiers: list[Tier] = [t for t in built if t is not None]
        self.timeout_s = timeout_s
        self.remote = any(t.shared for t in self.tiers)
        self._loop = LoopThread("scd-store-raw-blobs")
        for tier in self.tiers:
            tier.attach(keyring=None, count=None)
        for tier in self.tiers:
            self._loop.run(tier.start(), timeout=timeout_s)

    @staticmethod
    def keys(hashes: Sequence[bytes]) -> list[str]:
        return [make_key(RAW_SPACE, RAW_GENERATION, h) for h in hashes]

    def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        keys = self.keys(hashes)
        out: list[bytes | None] = [None] * len(keys)
        for tier in self.tiers:
            wanted = [i for i, blob in enumerate(out) if blob is None]
            if not wanted:
                break
            got = self._loop.run(tier.get_many([keys[i] for i in wanted]), timeout=self.timeout_s)
            for i, blob in zip(wanted, got, strict=True):
                out[i] = blob
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        pairs = list(zip(self.keys([h for h, _ in items]), (b for _, b in items), strict=True))
        for tier in self.tiers:
            self._loop.run(tier.put_many(pairs), timeout=self.timeout_s)

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        keys = self.keys(hashes)
        out = [False] * len(keys)
        for tier in self.tiers:
            for i, held in enumerate(self._loop.run(tier.contains_many(keys), timeout=self.timeout_s)):
                out[i] = out[i] or held
        return out

    def close(self) -> None:
        for tier in self.tiers:
            self._loop.run(tier.close(), timeout=10.0)
        self._loop.stop()
