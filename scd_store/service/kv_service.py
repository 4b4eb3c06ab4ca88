"""The engine-neutral face of scd-store: engine model names and chunk hashes in, KV states out.

Engine adapters (LMCache, SGLang) see only this: a producer model's chunks are encoded into its
code space and put under the engine's own chunk hashes; a registered consumer asking for the
same hashes gets the producer's codes decoded into *its* KV. A model that is neither a space's
producer nor a registered consumer is a clean miss. Bundles (see ``scd-store calibrate``) are
registered in the store's registry when the service starts (:mod:`scd_store.service.bundles`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from scd_store.codecs.kv_state import KVState
from scd_store.codecs.tensor_pack import PayloadError
from scd_store.service.bindings import Binding, Bindings
from scd_store.service.bundles import bind_bundle
from scd_store.service.discovery import PairDiscovery
from scd_store.service.hash_agreement import HashAgreement, HashCanary
from scd_store.service.log_once import LogOnce
from scd_store.service.put_queue import PutJob, PutQueue
from scd_store.store.records import NotRegistered
from scd_store.store.tiered import TieredStore
from scd_store.store.views import ConsumerView, ProducerView

# an engine's (keys, values) buffers for chunk i of n tokens, or None: see KVService.get
Buffers = Callable[[int, int], tuple[torch.Tensor, torch.Tensor] | None]

log = logging.getLogger("scd_store.service")


class KVService:
    """Producer puts and consumer gets by engine chunk hash, over one :class:`TieredStore`.

    ``bundles`` are calibration bundle directories. ``aliases`` maps an engine's model name (e.g.
    a served-model name or checkpoint path) to the name the bundle knows the model by.
    ``replace_registrations`` lets the bundles overwrite different registry records (for a registry
    the caller owns, e.g. the demo's). Engines hand puts over with :meth:`submit_put` (at most
    ``put_queue_chunks`` queued, off their thread); a get stops decoding once ``get_deadline_s``
    has passed (the chunks decoded so far are the hit). ``models``: load only these models' decoders from
    ``bundles`` (default: every pair's). A model asked for without a binding is looked up in the registry
    every ``discovery_interval_s`` (0: never) and bound once a pair or space names it (``scd-store
    register``; :mod:`scd_store.service.discovery`). ``register_bundles=False`` (least privilege:
    engines that may only read the registry) binds only what the registry already holds as the
    bundles have it. A space or pair revoked in the registry is a miss from the store's next
    registry refresh on (``revoked_requests``). ``max_positions``: the engine's context length; a stored
    chunk reaching past it is refused before anything is allocated for it.
    """

    def __init__(self, store: TieredStore, bundles: Sequence[str | Path], *,
                 aliases: Mapping[str, str] | None = None, replace_registrations: bool = False,
                 put_queue_chunks: int = 256, get_deadline_s: float | None = None,
                 models: Sequence[str] | None = None, discovery_interval_s: float = 2.0,
                 register_bundles: bool = True, max_positions: int = 32768) -> None:
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
        self.puts = PutQueue(self._run_put, store.stats, max_chunks=put_queue_chunks)
        self.hashing = HashAgreement(store.registry, store.stats)
        self.discovery = PairDiscovery(store.registry, self.bindings, store.stats, discovery_interval_s)
        self._once = LogOnce(log)

    @property
    def aliases(self) -> dict[str, str]:
        return self.bindings.aliases

    # ----------------------------------------------------------------- lookups
    def binding(self, model: str) -> Binding | None:
        """The binding of an engine model name (after aliases), or None for a model scd-store does not serve
        (yet: the name is handed to discovery, which binds it once the registry names it)."""
        binding = self.bindings.get(model)
        if binding is None:
            self.discovery.want(self.aliases.get(model, model))
        return binding

    def models(self) -> dict[str, str]:
        """Every bound model name and its role."""
        return self.bindings.roles()

    def _producer(self, binding: Binding) -> ProducerView | None:
        """The store's write face for a producer (the store caches the registry's answer); None once revoked."""
        try:
            return self.store.producer(binding.space.space_id, binding.model, binding.space.fingerprint)
        except NotRegistered as exc:
            return self._revoked(binding, exc)

    def _consumer(self, binding: Binding) -> ConsumerView | None:
        """The store's read face for a consumer; None once its pair is revoked (a miss)."""
        try:
            return self.store.consumer(binding.pair_id, binding.model, binding.space.fingerprint)
        except NotRegistered as exc:
            return self._revoked(binding, exc)

    def _store_call(self, what: str, call: Callable[[], Any], default: Any) -> Any:
        """A store call from an engine's thread: whatever goes wrong below (a tier walk past its deadline, the
        store's loop gone) is a miss, counted as ``store_errors`` and logged once, never an exception in the
        engine."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - an engine's step must not fail on the store
            self.store.stats.inc("store_errors")
            self._once.warn(f"store:{what}", "scd-store: a store %s failed (a miss; counted as store_errors; logged "
                            "once): %s: %s", what, type(exc).__name__, exc)
            return default

    def _revoked(self, binding: Binding, exc: Exception) -> None:
        self.store.stats.inc("revoked_requests", space=binding.space.space_id, pair=binding.pair_id)
        self._once.warn(f"revoked:{binding.model}", "scd-store: %r is not (or no longer) registered: its requests "
                        "miss (counted as revoked_requests; logged once): %s", binding.model, exc)
        return None

    def _producer_binding(self, model: str, chunks: int) -> Binding | None:
        """``model``'s binding when it produces a space; else None, counted and logged (consumers never write)."""
        binding = self.binding(model)
        if binding is None or binding.role != "producer":
            self.store.stats.inc("refused_requests")
            log.info("scd-store: %r is not a registered producer; not storing %d chunks", model, chunks)
            return None
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
                   release: Callable[[], None] | None = None, done: Callable[[int], None] | None = None) -> bool:
        """Hand a producer's chunks over without waiting: ``states()`` runs on the put worker (None: store
        nothing), then ``release()`` and ``done(chunks stored)``. False (and ``release()`` at once) when
        ``model`` is no producer or the queue is full (``dropped_puts``)."""
        job = PutJob(model, list(hashes), states, release or (lambda: None), done)
        if self._producer_binding(model, len(hashes)) is None:
            job.release()
            return False
        return self.puts.submit(job)

    def _run_put(self, job: PutJob) -> int:
        states = job.states()
        if states is None:
            return 0
        try:
            return self.put(job.model, job.hashes, states)
        except ValueError as exc:  # KV the space cannot code: nothing is stored, the engine goes on
            self.store.stats.inc("uncodable_chunks", len(job.hashes))
            self._once.warn(f"uncodable:{job.model}", "scd-store: not storing chunks of %r the space cannot code "
                            "(counted as uncodable_chunks; logged once): %s", job.model, exc)
            return 0

    def put(self, model: str, hashes: Sequence[bytes], states: Sequence[KVState]) -> int:
        """Encode a producer's chunks (one state per hash, at its absolute start) and store them.

        Returns the chunks stored: 0 when ``model`` produces no space (consumers never write)."""
        binding = self._producer_binding(model, len(hashes))
        if binding is None:
            return 0
        if len(hashes) != len(states):
            raise ValueError(f"{len(hashes)} hashes for {len(states)} states")
        t0 = time.perf_counter()
        view = self._producer(binding)
        if view is None:
            return 0
        payloads = [binding.codec.encode(state) for state in states]
        self.store.stats.observe("encode", time.perf_counter() - t0)
        return len(view.put(hashes, payloads, [s.num_tokens for s in states], codec_id=binding.codec.codec_id))

    def contains(self, model: str, hashes: Sequence[bytes], tokens: int | None = None) -> int:
        """Chunks of the leading run of ``hashes`` that ``model`` can get (0 for an unknown model).

        ``tokens``, the tokens the hashes cover as the engine counts them, is a consumer's request:
        it is counted as ``requested_tokens`` (the denominator of the hit rate)."""
        binding = self.binding(model)
        if binding is None:
            return 0
        if binding.role == "producer":
            producer = self._producer(binding)
            return self._store_call("contains", lambda: producer.contains(hashes), 0) if producer is not None else 0
        if not self.hashing.ok(binding):
            return 0
        if tokens:
            self.count_requested(model, tokens)
        consumer = self._consumer(binding)
        return self._store_call("contains", lambda: consumer.contains(hashes), 0) if consumer is not None else 0

    def readable_by_others(self, model: str, hashes: Sequence[bytes]) -> int:
        """For a producer: chunks of the leading run of ``hashes`` the tiers other processes read (Redis, peers)
        hold, not counted as a lookup; a producer's own copies do not count, so a shared tier that lost them is
        seen (0 for anyone else). Blocking: call it off the engine's thread."""
        binding = self.binding(model)
        if binding is None or binding.role != "producer":
            return 0
        producer = self._producer(binding)
        if producer is None:
            return 0
        return self._store_call("readable_by_others", lambda: producer.readable_by_others(hashes), len(hashes))

    def count_requested(self, model: str, tokens: int) -> None:
        """Count a consumer's lookup of ``tokens`` tokens (``requested_tokens``, the hit rate's denominator) in
        this process: for engines that look up in one process and load in another (vLLM), so each
        process's hit rate is its own."""
        binding = self.binding(model)
        if binding is not None and binding.role == "consumer" and tokens > 0:
            self.store.stats.inc("requested_tokens", tokens, space=binding.space.space_id, pair=binding.pair_id)

    def get(self, model: str, hashes: Sequence[bytes], *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, into: Buffers | None = None) -> list[KVState]:
        """A consumer's KV for the leading run of ``hashes`` held in the store, one state per chunk.

        Unknown models and producers (whose own cache is raw) get ``[]``; a chunk whose payload the
        codec refuses ends the run (it is counted, never decoded into garbage). ``into(i, tokens)``,
        when given, returns the engine's ``(keys, values)`` buffers ``[layers, kv_heads, tokens,
        head_dim]`` for chunk ``i`` (their device and dtype win over ``device`` / ``dtype``), or None to
        end the run there: chunks decode straight into them (``Codec.decode_into``). Past the service's
        ``get_deadline_s`` no further chunk is decoded (``deadline_chunks``)."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available here; use device='cpu'")
        binding = self.binding(model)
        if binding is None or binding.role != "consumer":
            self.store.stats.inc("refused_requests")
            log.info("scd-store: %r is not a registered consumer; miss", model)
            return []
        if not self.hashing.ok(binding):
            return []
        started = time.perf_counter()
        deadline = started + self.get_deadline_s if self.get_deadline_s is not None else float("inf")
        consumer = self._consumer(binding)
        if consumer is None:
            return []
        chunks = self._store_call("get", lambda: consumer.get(hashes), [])
        t0 = time.perf_counter()
        states: list[KVState] = []
        for i, chunk in enumerate(chunks):
            if time.perf_counter() > deadline:
                self.store.stats.inc("deadline_chunks", len(chunks) - i, space=binding.space.space_id,
                                     pair=binding.pair_id)
                self._once.warn("deadline", "scd-store: a get passed its %.2f s deadline; the chunks decoded so far "
                                "are the hit (counted as deadline_chunks; logged once)", self.get_deadline_s)
                break
            buffers = into(i, chunk.token_count) if into is not None else None
            if into is not None and buffers is None:
                break
            try:  # the blob header's token count (bounded by the store) bounds the decode before it allocates
                if buffers is None:  # no copy: unpack takes views
                    state = binding.codec.decode(chunk.payload, device=device, dtype=dtype,
                                                 expect_tokens=chunk.token_count)
                else:
                    state = binding.codec.decode_into(chunk.payload, *buffers, expect_tokens=chunk.token_count)
                if state.num_tokens != chunk.token_count:  # a second line of defence
                    raise PayloadError(f"it decodes to {state.num_tokens} tokens; its header says {chunk.token_count}")
            except PayloadError as exc:
                self.store.stats.inc("refused_chunks", tier=chunk.tier, space=binding.space.space_id,
                                     pair=binding.pair_id)
                log.warning("scd-store: chunk %s refused (a miss from here on): %s", chunk.key, exc)
                break
            states.append(state)
        if chunks:
            self.store.stats.observe("decode", time.perf_counter() - t0, pair=binding.pair_id)
        return states
