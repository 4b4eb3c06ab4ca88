"""The engine-neutral face of scd-store: :class:`KVService`, engine model names and chunk hashes in, KV out.

Engine adapters (vLLM, LMCache, SGLang) see only this: a producer model's chunks are encoded into its
code space and put under the engine's own chunk hashes; a registered consumer asking for the same
hashes gets the producer's codes decoded into *its* KV. A model that is neither a space's producer
nor a registered consumer is a clean miss. Bundles (see ``scd-store calibrate``) are registered in the
store's registry when the service starts (:mod:`scd_store.service.bundles`). The service also offers
what adapters need of the store: its chunk size and key chain, its counters and latency histograms,
and the put queue's pending chunks.

Where the work is done: the put path (encode and store) in :mod:`scd_store.service.put_path`, the
get's decode loop in :mod:`scd_store.service.decode_loop`, the hashing canary in
:mod:`scd_store.service.hash_agreement`, revocation and engine-safe store calls in
:mod:`scd_store.service.store_access`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.kv_state import KVState
from scd_store.service.bindings import Binding, Bindings, Role
from scd_store.service.bundles import bind_bundle
from scd_store.service.decode_loop import Buffers, DecodeLoop, PagedTargets
from scd_store.service.defaults import DISCOVERY_INTERVAL_S, MAX_POSITIONS, PUT_QUEUE_BYTES, PUT_QUEUE_CHUNKS
from scd_store.service.discovery import PairDiscovery
from scd_store.service.hash_agreement import HashAgreement, HashCanary
from scd_store.service.hashing import chunk_hashes
from scd_store.service.put_path import PutPath
from scd_store.service.put_queue import PutJob, PutQueue
from scd_store.service.results import Lookup
from scd_store.service.store_access import StoreAccess
from scd_store.store.log_once import Incidents
from scd_store.store.tiered import TieredStore
from scd_store.store.views import ConsumerView, ProducerView

__all__ = ["Buffers", "KVService", "PagedTargets"]

log = logging.getLogger("scd_store.service")


class KVService:
    """Producer puts and consumer gets by engine chunk hash, over one :class:`TieredStore`.

    ``bundles`` are calibration bundle directories. ``aliases`` maps an engine's model name (e.g. a served-model
    name or checkpoint path) to the name the bundle knows the model by. ``replace_registrations`` lets the
    bundles overwrite different registry records (for a registry the caller owns, e.g. the demo's). Engines hand
    puts over with :meth:`submit_put` (at most ``put_queue_chunks`` chunks and ``put_queue_bytes`` bytes queued,
    off their thread); a get stops decoding once ``get_deadline_s`` has passed (the chunks decoded so far are
    the hit; None: no deadline). ``models``: load only these models' decoders from ``bundles`` (default: every
    pair's). A model asked for without a binding is looked up in the registry every ``discovery_interval_s`` (0:
    never) and bound once a pair or space names it (``scd-store register``; :mod:`scd_store.service.discovery`).
    ``register_bundles=False`` (least privilege: engines that may only read the registry) binds only what the
    registry already holds as the bundles have it. A space or pair revoked in the registry is a miss from the
    store's next registry refresh on (``revoked_requests``). ``max_positions``: the engine's context length; a
    stored chunk reaching past it is refused before anything is allocated for it.
    """

    def __init__(self, store: TieredStore, bundles: Sequence[str | Path], *,
                 aliases: Mapping[str, str] | None = None, replace_registrations: bool = False,
                 put_queue_chunks: int = PUT_QUEUE_CHUNKS, put_queue_bytes: int = PUT_QUEUE_BYTES,
                 get_deadline_s: float | None = None,
                 models: Sequence[str] | None = None, discovery_interval_s: float = DISCOVERY_INTERVAL_S,
                 register_bundles: bool = True, max_positions: int = MAX_POSITIONS) -> None:
        if get_deadline_s is not None and get_deadline_s <= 0:
            raise ValueError(f"get_deadline_s must be positive, got {get_deadline_s}")
        self.store = store
        self.get_deadline_s = get_deadline_s
        self.bindings = Bindings(aliases, max_positions)
        for bundle in bundles:
            for binding in bind_bundle(Path(bundle), store.registry, chunk_size=store.chunk_size,
                                       replace=replace_registrations, models=models, register=register_bundles):
                self.bindings.add(binding)
        store.forget_registry_cache()
        self._serving: dict[str, str] = {}  # models this process's engine has asked for, by role (for stats)
        store.stats.describe_process(lambda: dict(self._serving))
        self._incidents = Incidents(store.stats, log)
        self._access = StoreAccess(store, self._incidents)
        self._writer = PutPath(self._access, store.stats, self._incidents, self._producer_binding)
        self._decoder = DecodeLoop(store.stats, self._incidents, get_deadline_s)
        self.puts = PutQueue(self._writer.run, store.stats, max_chunks=put_queue_chunks,
                             max_bytes=put_queue_bytes)
        self.hashing = HashAgreement(store.registry, store.stats)
        self.discovery = PairDiscovery(store.registry, self.bindings, store.stats, discovery_interval_s)

    # ----------------------------------------------------------------- what adapters need of the store
    @property
    def aliases(self) -> dict[str, str]:
        """Engine model names to the names the bundles know the models by."""
        return self.bindings.aliases

    @property
    def chunk_size(self) -> int:
        """Tokens per stored chunk (an engine's chunk or page size must agree with it)."""
        return self.store.chunk_size

    def chunk_hashes(self, tokens: Sequence[int], chunk_size: int | None = None) -> list[bytes]:
        """The store's chained hashes of every whole chunk of ``tokens`` (default: this service's chunk size)."""
        return chunk_hashes(tokens, self.chunk_size if chunk_size is None else chunk_size)

    def count(self, counter: str, n: int = 1, *, tier: str = "", space: str = "", pair: str = "") -> None:
        """Add ``n`` to one of the store's counters (:data:`scd_store.store.stats.COUNTERS`), e.g. a miss's reason."""
        self.store.stats.inc(counter, n, tier=tier, space=space, pair=pair)

    def incidents(self, logger: logging.Logger) -> Incidents:
        """Count an incident in this service's counters and log its first occurrence to ``logger``."""
        return Incidents(self.store.stats, logger)

    def observe(self, op: str, seconds: float, *, tier: str = "", pair: str = "") -> None:
        """Record ``seconds`` of ``op`` in the store's latency histogram."""
        self.store.stats.observe(op, seconds, tier=tier, pair=pair)

    def stat(self, name: str, *, tier: str | None = None, space: str | None = None, pair: str | None = None) -> int:
        """A counter's value in this process (summed over the labels not given)."""
        return self.store.stats.value(name, tier=tier, space=space, pair=pair)

    def stats_snapshot(self) -> dict[str, Any]:
        """This process's counters and histograms, as ``scd-store stats`` reads them."""
        return self.store.stats.snapshot()

    def pending_put(self, chunk_hash: bytes) -> bool:
        """Whether a chunk with this hash is queued or being stored."""
        return self.puts.pending(chunk_hash)

    def queued_chunks(self) -> int:
        """Chunks handed over with :meth:`submit_put` and not yet stored."""
        return self.puts.queued_chunks()

    def put_fits(self, chunks: int, nbytes: int) -> bool:
        """Whether a job of ``chunks`` holding ``nbytes`` would be queued now (check before copying them)."""
        return self.puts.fits(chunks, nbytes)

    # ----------------------------------------------------------------- lookups
    def binding(self, model: str) -> Binding | None:
        """The binding of an engine model name (after aliases), or None for a model scd-store does not serve
        (yet: the name is handed to discovery, which binds it once the registry names it)."""
        binding = self.bindings.get(model)
        if binding is None:
            self.discovery.want(self.aliases.get(model, model))
        return binding

    def note_served(self, model: str) -> None:
        """Say that this process's engine serves ``model`` (its stats records name it with its role, as they
        name every model it stores or looks up); an unbound model is not named."""
        binding = self.binding(model)
        if binding is not None:
            self._serving[model] = binding.role

    def models(self) -> dict[str, str]:
        """Every bound model name and its role."""
        return self.bindings.roles()

    def can_sign(self) -> bool:
        """Whether this process's store holds a private key (it could sign codes others accept)."""
        keyring = self.store.keyring
        return keyring is not None and keyring.can_sign

    def _producer_binding(self, model: str, chunks: int) -> Binding | None:
        """``model``'s binding when it produces a space; else None, counted and logged (consumers never write)."""
        binding = self.binding(model)
        if binding is None or binding.role != Role.PRODUCER:
            self.store.stats.inc("refused_requests")
            log.info("scd-store: %r is not a registered producer; not storing %d chunks", model, chunks)
            return None
        self._serving[model] = binding.role
        return binding

    def check_hashing(self, model: str, canary: HashCanary) -> None:
        """An engine's hashing canary: recorded for a producer, compared for a consumer (raises
        :class:`~scd_store.service.hash_agreement.HashMismatch` when it differs from its producer's)."""
        binding = self.binding(model)
        if binding is not None:
            self.hashing.check(binding, canary)

    # ----------------------------------------------------------------- lifecycle
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted put is stored in every tier (or failed); False when ``timeout``
        passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.puts.drain(timeout):
            return False
        try:
            self.store.flush(None if deadline is None else max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Store what is queued (up to ``timeout``, default the store's ``put_timeout_s``), then close the store."""
        self.discovery.close()
        try:
            self.puts.close(self.store.put_timeout_s if timeout is None else timeout)
        finally:
            self.store.close()

    # ----------------------------------------------------------------- operations
    def submit_put(self, model: str, hashes: Sequence[bytes], states: Callable[[], Sequence[KVState] | None], *,
                   release: Callable[[], None] | None = None, done: Callable[[int], None] | None = None,
                   nbytes: int = 0) -> bool:
        """Hand a producer's chunks over without waiting: ``states()`` runs on the put worker (None: store
        nothing), then ``release()`` and ``done(chunks stored)``; ``nbytes``: the memory the job holds until
        then. False (and ``release()`` at once) when ``model`` is no producer or the queue is full
        (``dropped_puts``)."""
        job = PutJob(model, list(hashes), states, release or (lambda: None), done, nbytes)
        if self._producer_binding(model, len(hashes)) is None:
            job.release()
            return False
        return self.puts.submit(job)

    def put(self, model: str, hashes: Sequence[bytes], states: Sequence[KVState]) -> int:
        """Encode a producer's chunks (one state per hash, at its absolute start) and store them.

        Returns the chunks stored: 0 when ``model`` produces no space (consumers never write). KV the space
        cannot code raises :class:`~scd_store.service.put_path.UncodableChunks` (a ``ValueError``)."""
        return self._writer.put(model, hashes, states)

    def contains(self, model: str, hashes: Sequence[bytes], tokens: int | None = None) -> int:
        """Chunks of the leading run of ``hashes`` that ``model`` can get (0 for an unknown model).

        ``tokens``, the tokens the hashes cover as the engine counts them, is a consumer's request:
        it is counted as ``requested_tokens`` (the denominator of the hit rate)."""
        return self.lookup(model, hashes, tokens).chunks

    def lookup(self, model: str, hashes: Sequence[bytes], tokens: int | None = None) -> Lookup:
        """:meth:`contains`, and how many of those chunks only a remote tier holds (an engine that can load
        asynchronously loads those off its step)."""
        binding = self.binding(model)
        if binding is None:
            return Lookup(0, 0)
        view: ProducerView | ConsumerView | None
        if binding.role == Role.PRODUCER:
            view = self._access.producer(binding)
        else:
            self._serving[model] = binding.role
            if not self.hashing.ok(binding):
                return Lookup(0, 0)
            if tokens:
                self.count_requested(model, tokens)
            view = self._access.consumer(binding)
        if view is None:
            return Lookup(0, 0)
        hit = self._access.call("contains", lambda: view.lookup(hashes), None)
        return Lookup(hit.hit_chunks, hit.remote_chunks, hit.tiers) if hit is not None else Lookup(0, 0)

    def readable_by_others(self, model: str, hashes: Sequence[bytes]) -> int:
        """For a producer: chunks of the leading run of ``hashes`` the tiers other processes read (Redis, peers)
        hold, not counted as a lookup; a producer's own copies do not count, so a shared tier that lost them is
        seen (0 for anyone else). Blocking: call it off the engine's thread."""
        binding = self.binding(model)
        if binding is None or binding.role != Role.PRODUCER:
            return 0
        producer = self._access.producer(binding)
        if producer is None:
            return 0
        return self._access.call("readable_by_others", lambda: producer.readable_by_others(hashes), len(hashes))

    def count_requested(self, model: str, tokens: int) -> None:
        """Count a consumer's lookup of ``tokens`` tokens (``requested_tokens``, the hit rate's denominator) in
        this process: for engines that look up in one process and load in another (vLLM), so each
        process's hit rate is its own."""
        binding = self.binding(model)
        if binding is not None and binding.role == Role.CONSUMER and tokens > 0:
            self._serving[model] = binding.role
            self.store.stats.inc("requested_tokens", tokens, space=binding.space.space_id, pair=binding.pair_id)

    def stored_bytes(self, model: str, hashes: Sequence[bytes]) -> int:
        """Bytes of the codes a consumer's get of ``hashes`` fetches (the leading run stored; nothing is
        decoded); 0 for anyone else. For benches that weigh a hit."""
        binding = self.binding(model)
        consumer = self._access.consumer(binding) if binding is not None and binding.role == Role.CONSUMER else None
        if consumer is None:
            return 0
        return self._access.call("get", lambda: sum(len(chunk.payload) for chunk in consumer.get(hashes)), 0)

    def get(self, model: str, hashes: Sequence[bytes], *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, into: Buffers | None = None,
            heads: HeadShare | None = None) -> list[KVState]:
        """A consumer's KV for the leading run of ``hashes`` held in the store, one state per chunk.

        Unknown models and producers (whose own cache is raw) get ``[]``; a chunk whose payload the
        codec refuses ends the run (it is counted, never decoded into garbage). ``into(i, tokens)``,
        when given, returns the engine's ``(keys, values)`` buffers ``[layers, kv_heads, tokens,
        head_dim]`` for chunk ``i`` (their device and dtype win over ``device`` / ``dtype``), or None to
        end the run there: chunks decode straight into them (``Codec.decode_into``). Past the service's
        ``get_deadline_s`` no further chunk is decoded (``deadline_chunks``). ``heads``: the buffers hold
        this share of the model's KV heads (a tensor-parallel rank's; the codes cover every head)."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available here; use device='cpu'")
        found = self._consumer_chunks(model, hashes)
        if found is None:
            return []
        binding, chunks, deadline = found
        return self._decoder.run(binding, chunks, deadline=deadline, device=device, dtype=dtype, into=into,
                                 heads=heads)

    def get_paged(self, model: str, hashes: Sequence[bytes], into: PagedTargets,
                  heads: HeadShare | None = None) -> int:
        """:meth:`get` written straight into an engine's paged cache: chunk ``i`` of the leading run held in the
        store is decoded on the caches' device into the slots ``into.slots(i, tokens)`` names
        (``Codec.decode_paged``); returns how many chunks were written. Misses, refusals and the deadline
        end the run as in :meth:`get` (a refused chunk's slots may be partly written: the caller recomputes
        from it on). ``heads``: the caches hold this share of the KV heads."""
        found = self._consumer_chunks(model, hashes)
        if found is None:
            return 0
        binding, chunks, deadline = found
        return self._decoder.run_paged(binding, chunks, deadline=deadline, into=into, heads=heads)

    def _consumer_chunks(self, model: str, hashes: Sequence[bytes]) -> tuple[Binding, list, float] | None:
        """A registered consumer's binding, the leading run of ``hashes`` its store view holds and the get's
        deadline; None (counted) for anyone else."""
        binding = self.binding(model)
        if binding is None or binding.role != Role.CONSUMER:
            self.store.stats.inc("refused_requests")
            log.info("scd-store: %r is not a registered consumer; miss", model)
            return None
        if not self.hashing.ok(binding):
            return None
        deadline = self._decoder.deadline(time.perf_counter())
        consumer = self._access.consumer(binding)
        if consumer is None:
            return None
        return binding, self._access.call("get", lambda: consumer.get(hashes), []), deadline
