"""Raw-KV reuse through vLLM, the baseline scd-store's codes are measured against.

:class:`RawReuseConnector` is scd-store's vLLM connector with its service swapped for
:class:`RawKVDirectory`: the producer's chunks are kept as raw fp16 KV (no codes, no decoder) in
a directory shared by the servers, and any consumer model loads the producer's KV as it is, the
way a plain KV store would serve a fine-tune. Same chunking, same scheduling, same load path as
the codes; only the payload differs. For ``make demo`` and ``scd-store bench serve``, not for
serving: a fine-tune fed its base model's raw KV drifts (which is what the benchmarks show).
Settings (``kv_connector_extra_config``): ``raw_dir`` (a directory) or ``raw_tiers`` (scd-store tier
settings: Redis, a peer tier), ``producer`` (the model whose requests are stored), ``chunk_size``
(default 256), ``timeout_s`` (bound on a tier call, default 120). A request with
``kv_transfer_params: {"raw_skip_load": true}`` does not load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from scd_store.adapters.vllm.connector import ScdConnector
from scd_store.bench.raw_blobs import DirectoryBlobs, RawBlobs, TierBlobs
from scd_store.codecs.baselines import RawCodec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.paged import scatter_eager
from scd_store.codecs.tensor_pack import PayloadError
from scd_store.service.results import Lookup
from scd_store.store.log_once import Incidents
from scd_store.store.stats import StoreStats


class RawKVDirectory:
    """The part of :class:`~scd_store.service.KVService` the vLLM connector calls, over raw fp16 KV blobs kept
    in a directory (``directory``) or in scd-store tiers (``tiers``: tier settings, e.g. Redis or a peer
    tier, so raw KV crosses the same link as the codes)."""

    def __init__(self, directory: str | Path | None, producer: str, chunk_size: int = 256, *,
                 tiers: Sequence[dict[str, Any]] = (), timeout_s: float = 120.0) -> None:
        if (directory is None) == (not tiers):
            raise ValueError("the raw baseline keeps its blobs in raw_dir or raw_tiers (exactly one)")
        self.blobs: RawBlobs = DirectoryBlobs(directory) if directory is not None else TierBlobs(tiers, timeout_s)
        self.producer = producer
        self.chunk_size = chunk_size
        self.stats = StoreStats()
        self.codec = RawCodec(torch.float16)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raw-kv")
        self._lock = threading.Lock()
        self.bytes_read = 0

    def count(self, counter: str, n: int = 1, **labels: str) -> None:
        self.stats.inc(counter, n, **labels)

    def observe(self, op: str, seconds: float, **labels: str) -> None:
        self.stats.observe(op, seconds, **labels)

    def incidents(self, logger: logging.Logger) -> Incidents:
        return Incidents(self.stats, logger)

    def binding(self, model: str) -> SimpleNamespace:
        return SimpleNamespace(role="producer" if model == self.producer else "consumer")

    def models(self) -> dict[str, str]:
        return {self.producer: "producer", "(any other model)": "consumer"}

    def count_requested(self, model: str, tokens: int) -> None:
        return  # the baseline keeps no hit statistics

    def note_served(self, model: str) -> None:
        return  # nor names what its process serves

    def check_hashing(self, model: str, canary: Any) -> None:
        return  # one process layout and scd-store's own chain: nothing to compare

    def contains(self, model: str, hashes: Sequence[bytes], tokens: int | None = None) -> int:
        count = 0
        for held in self.blobs.contains_many(list(hashes)) if hashes else ():
            if not held:
                break
            count += 1
        return count

    def put_fits(self, chunks: int, nbytes: int) -> bool:
        """Writes go to the baseline's own worker: always room."""
        return True

    def lookup(self, model: str, hashes: Sequence[bytes], tokens: int | None = None) -> Lookup:
        """:meth:`contains`; in tiers every chunk is remote (its get waits on the network)."""
        found = self.contains(model, hashes, tokens)
        return Lookup(found, found if self.blobs.remote else 0)

    def readable_by_others(self, model: str, hashes: Sequence[bytes]) -> int:
        """The blobs are every process's (the producer's refill asks this)."""
        return self.contains(model, hashes)

    def get(self, model: str, hashes: Sequence[bytes], *, into: Callable | None = None, **_: Any) -> list[KVState]:
        states: list[KVState] = []
        for i, payload in enumerate(self.blobs.get_many(list(hashes)) if hashes else ()):
            try:
                if payload is None:
                    break
                state = self.codec.decode(payload)
            except PayloadError:
                break
            with self._lock:
                self.bytes_read += len(payload)
            buffers = into(i, state.num_tokens) if into is not None else None
            if into is not None and buffers is None:
                break
            if buffers is not None:
                buffers[0].copy_(state.keys)
                buffers[1].copy_(state.values)
            states.append(state)
        return states

    def get_paged(self, model: str, hashes: Sequence[bytes], into: Any) -> int:
        """:meth:`get` scattered into an engine's paged cache (``into``: a ``PagedTargets``); chunks written."""
        written = 0
        for i, state in enumerate(self.get(model, hashes)):
            slots = into.slots(i, state.num_tokens)
            if slots is None:
                break
            device = into.caches.device
            scatter_eager(state.keys.to(device), state.values.to(device), into.caches, slots)
            written += 1
        return written

    def submit_put(self, model: str, hashes: Sequence[bytes], states: Callable[[], Sequence[KVState] | None],
                   **_: Any) -> bool:
        def write() -> None:
            items = list(zip(hashes, states() or (), strict=False))
            held = self.blobs.contains_many([h for h, _ in items]) if items else []
            self.blobs.put_many([(h, self.codec.encode(state)) for (h, state), have in zip(items, held, strict=True)
                                 if not have])

        self._pool.submit(write)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.blobs.close()


class RawReuseConnector(ScdConnector):
    """The vLLM connector serving the producer's raw KV to every other model (the raw-reuse baseline)."""

    skip_param = "raw_skip_load"

    def _open_service(self, extra_config: dict[str, Any]) -> RawKVDirectory:
        unknown = sorted(set(extra_config) - {"raw_dir", "raw_tiers", "timeout_s", "producer", "chunk_size"})
        if unknown or ("raw_dir" in extra_config) == ("raw_tiers" in extra_config) or "producer" not in extra_config:
            raise ValueError(f"RawReuseConnector needs producer and raw_dir or raw_tiers (and optionally chunk_size, "
                             f"timeout_s); got {sorted(extra_config)}")
        return RawKVDirectory(extra_config.get("raw_dir"), extra_config["producer"],
                              int(extra_config.get("chunk_size", 256)), tiers=extra_config.get("raw_tiers", ()),
                              timeout_s=float(extra_config.get("timeout_s", 120.0)))

    def _close_service(self, service: Any) -> None:
        service.close()
