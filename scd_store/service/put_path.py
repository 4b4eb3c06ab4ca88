"""A producer's put: :class:`PutPath` encodes chunks into the producer's code space and stores them.

:meth:`PutPath.put` is the synchronous put; :meth:`PutPath.run` runs one job of the put queue
(:mod:`scd_store.service.put_queue`) on its worker. KV the space cannot code (its shape, NaN or inf
values, positions past the model's) is :class:`UncodableChunks`: a queued job of it stores nothing
and is counted (``uncodable_chunks``, logged once per model). Anything else a put raises (a caller's
bug, such as a hash count that differs from the state count, or a store failure) is the put worker's
to report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.errors import ScdStoreError
from scd_store.service.bindings import Binding
from scd_store.service.put_queue import PutJob
from scd_store.service.store_access import StoreAccess
from scd_store.store.log_once import Incidents
from scd_store.store.stats import StoreStats

ProducerBinding = Callable[[str, int], Binding | None]  # (model, chunks) -> its producer binding, or None


class UncodableChunks(ScdStoreError, ValueError):  # noqa: N818 - the name says what they are
    """KV the code space cannot code: nothing of the put is stored."""


def encode_chunks(codec: Codec, states: Sequence[KVState]) -> list[bytes]:
    """One payload per state; a state the codec refuses (its ``ValueError``) is :class:`UncodableChunks`."""
    try:
        return [codec.encode(state) for state in states]
    except UncodableChunks:
        raise
    except ValueError as exc:
        raise UncodableChunks(str(exc)) from exc


class PutPath:
    """Encode and store a producer's chunks through ``access``; ``producer_binding`` says who produces."""

    def __init__(self, access: StoreAccess, stats: StoreStats, incidents: Incidents,
                 producer_binding: ProducerBinding) -> None:
        self.access = access
        self.stats = stats
        self.incidents = incidents
        self.producer_binding = producer_binding

    def put(self, model: str, hashes: Sequence[bytes], states: Sequence[KVState]) -> int:
        """Encode ``model``'s chunks (one state per hash) and store them; the chunks stored (0 for no producer)."""
        binding = self.producer_binding(model, len(hashes))
        if binding is None:
            return 0
        if len(hashes) != len(states):
            raise ValueError(f"{len(hashes)} hashes for {len(states)} states")
        t0 = time.perf_counter()
        view = self.access.producer(binding)
        if view is None:
            return 0
        payloads = encode_chunks(binding.codec, states)
        self.stats.observe("encode", time.perf_counter() - t0)
        return len(view.put(hashes, payloads, [s.num_tokens for s in states], codec_id=binding.codec.codec_id))

    def run(self, job: PutJob) -> int:
        """The put queue's job: build its states on the worker, then :meth:`put` them (uncodable: counted)."""
        states = job.states()
        if states is None:
            return 0
        try:
            return self.put(job.model, job.hashes, states)
        except UncodableChunks as exc:  # KV the space cannot code: nothing is stored, the engine goes on
            self.incidents.count("uncodable_chunks", "scd-store: not storing chunks of %r the space cannot code "
                                 "(counted as uncodable_chunks; logged once): %s", job.model, exc,
                                 n=len(job.hashes), once=f"uncodable:{job.model}")
            return 0
