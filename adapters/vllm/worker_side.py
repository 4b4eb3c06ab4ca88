"""The connector's worker half, :class:`WorkerSide`: decode hits into the request's blocks, hand producers'
chunks over.

Loads run before the step's forward (``start_load_kv``): the consumer's codes are decoded on the
cache's device. Where the backend's op is checked to write ``[K | V]`` as vLLM's CUDA backends do
(:func:`~scd_store.adapters.vllm.paged_layout.paged_target`), they are decoded straight into the
request's blocks through a slot table (:meth:`KVService.get_paged`: every layer in one kernel launch
for the SCD codec); elsewhere (vLLM-CPU's packed keys) into one ``[layers, kv_heads, chunk, head_dim]``
buffer pair there (:meth:`KVService.get`) written into the blocks with the backend's own cache op. Tokens of chunks that
could not be decoded, for whatever reason, are reported as failed blocks, so vLLM recomputes them
(the connector sets ``kv_load_failure_policy: recompute``); a load never fails the step. Saves run
after the forward (``wait_for_save``): the engine's thread gathers the producer's new chunks' blocks
as they lie (a block copy, so the blocks may be reused at once) and, on a GPU, starts their copy to
pinned host memory without waiting for it (:mod:`~scd_store.adapters.vllm.host_copy`); un-packing
them through the layout map, encoding and storing run on scd-store's put worker, off the engine's
thread. Chunks stored again because the store had lost them
(a save's ``refill``) are counted as ``refilled_chunks`` once stored; a finished producer request whose
blocks were held for such a refill is reported released (``finished_sending``) once the step that
planned its refill has copied them. Every write of a load into a request's blocks runs inside its
asynchronous load's gate (:class:`~scd_store.adapters.vllm.async_loads.Gate`), so none happens once the
load was reported (done, cancelled or past ``load_deadline_s``).

Under tensor parallelism each rank's worker holds its share of the KV heads (:class:`HeadShare`): a
load decodes the codes (which cover every head) and keeps its rank's heads; a save from a share is
refused (a producer runs at tensor-parallel size 1: a code space is fitted on every head).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from scd_store.adapters.vllm.async_loads import AsyncLoads, Gate, OpenGate
from scd_store.adapters.vllm.engine_check import check_layers
from scd_store.adapters.vllm.host_copy import copy_blocks, written_event
from scd_store.adapters.vllm.paged_layout import (
    BlockMap,
    LayoutError,
    layer_maps,
    paged_target,
    read_tokens,
    write_tokens,
)
from scd_store.adapters.vllm.plan import ChunkLoad, ChunkSave, StepPlan
from scd_store.codecs.head_share import HeadShare
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.paged import PagedCaches
from scd_store.service import KVService, PagedTargets
from scd_store.service.log_once import Incidents, LogOnce

log = logging.getLogger("scd_store.adapters.vllm")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names: list[str]) -> list[str]:
    """Attention layer names in model order (by the layer index in ``model.layers.<i>.``)."""
    def index(name: str) -> int:
        found = _LAYER_INDEX.search(name)
        if found is None:
            raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
        return int(found.group(1))
    return sorted(names, key=index)


class WorkerSide:
    """The engine's KV cache tensors and the loads and saves of each step."""

    def __init__(self, service: KVService, load_workers: int = 2, load_deadline_s: float | None = None) -> None:
        self.service = service
        self.load_workers = load_workers  # the fetch threads (asynchronous loads)
        self.load_deadline_s = load_deadline_s  # how long an asynchronous load may take (None: no deadline)
        self._sent: set[str] = set()  # finished producer requests whose held blocks the step released
        self.names: list[str] = []
        self.caches: list[torch.Tensor] = []
        self.layers: list[Any] = []
        self._maps: list[BlockMap] | None = None
        self._maps_error: LayoutError | None = None
        self._written: Any = None  # on a GPU: the event of the forward's last KV write this step
        self._paged: tuple[PagedCaches | None] | None = None  # decided once, on the first load
        self.heads: HeadShare | None = None  # this rank's share of the KV heads (None: all of them)
        self._failed: set[int] = set()
        self._async: AsyncLoads | None = None
        self._incidents: Incidents | None = None
        self._once = LogOnce(log)

    def register(self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any],
                 heads: HeadShare | None = None) -> None:
        """The engine's per-layer caches, the attention layers that own them (their backend's op) and, under
        tensor parallelism, the rank's share of the KV heads the caches hold."""
        self.names = layer_order(list(kv_caches))
        self.caches = [kv_caches[name] for name in self.names]
        self.layers = [layers[name] for name in self.names]
        check_layers(self.names, self.layers, self.caches)
        for name, cache in zip(self.names, self.caches, strict=True):
            if cache.dim() != 4:
                raise LayoutError(f"KV cache {name!r} has shape {tuple(cache.shape)}: scd-store's vLLM connector "
                                  "reads vLLM's [blocks, kv_heads, block_size, 2*head_dim] cache views")
            if heads is not None and cache.shape[1] != heads.count:
                raise LayoutError(f"KV cache {name!r} holds {cache.shape[1]} heads; this rank's share is heads "
                                  f"{heads.first}..{heads.first + heads.count - 1} of {heads.total}")
        self.heads = heads if heads is not None and not heads.is_whole else None
        self._probe()

    def _probe(self) -> None:
        """Derive the layers' gather maps and the paged target from the backend's op now, on the engine's thread at
        registration, never later on a put or fetch thread mid-serving (the probes launch the backend's kernels);
        a layout the maps cannot explain is kept as the error saves report."""
        self._maps, self._maps_error = None, None
        try:
            self._maps = layer_maps(self.layers, self.caches)
        except LayoutError as exc:
            self._maps_error = exc
        self._paged = (paged_target(self.layers, self.caches),)

    def maps(self) -> list[BlockMap]:
        """Each layer's gather map (derived at registration); :class:`LayoutError` when it could not be."""
        if self._maps is None:
            raise self._maps_error or LayoutError("no KV caches are registered")
        return self._maps

    def paged(self) -> PagedCaches | None:
        """The caches as one slot-table target where loads decode straight into them, else None (decided at
        registration, from the backend's own op)."""
        return self._paged[0] if self._paged is not None else None

    # ------------------------------------------------------------ loads
    def count_lookups(self, plan: StepPlan) -> None:
        for model, tokens in plan.lookups:
            self.service.count_requested(model, tokens)

    def load(self, plan: StepPlan) -> None:
        """The step's loads: synchronous ones on the engine's thread before its forward, asynchronous ones
        (hits held remotely) handed to the fetch threads (``vllm_load`` in the latency histogram: fetch,
        decode and write); then the asynchronous loads of requests that finished before their load did
        are cancelled (after the submits: a load planned and cancelled in one step is still reported)."""
        for load in plan.loads:
            if load.asynchronous:
                self._fetcher().submit(load)
            else:
                self._failed |= self._load_and_time(load)
        if plan.cancelled and self._async is not None:
            self._async.cancel(plan.cancelled)

    def _load_and_time(self, load: ChunkLoad, gate: Gate | None = None) -> set[int]:
        """Load one hit; returns the blocks it could not fill (recomputed by vLLM). Timed as ``vllm_load``
        (on the engine's thread) or ``vllm_async_load`` (on a fetch thread, whose ``gate`` may stop it)."""
        started = time.perf_counter()
        try:
            loaded = self._load_one(load, gate)
        except Exception as exc:  # noqa: BLE001 - a load that fails is recomputed, never a failed step
            self._once.warn(f"load:{load.model}:{type(exc).__name__}", "scd-store: cannot load %r's codes into "
                            "vLLM's cache (recomputed; logged once per error): %s: %s", load.model,
                            type(exc).__name__, exc)
            loaded = 0
        self.service.observe("vllm_async_load" if load.asynchronous else "vllm_load", time.perf_counter() - started)
        return load.blocks_from(loaded) if loaded < len(load.hashes) * load.chunk_size else set()

    def _fetcher(self) -> AsyncLoads:
        if self._async is None:
            self._async = AsyncLoads(self._load_and_time, self.caches[0].device if self.caches else None,
                                     workers=self.load_workers, deadline_s=self.load_deadline_s,
                                     on_expired=self._expired)
        return self._async

    def _expired(self, n: int) -> None:
        """Count asynchronous loads reported at their deadline (``load_deadlines``; the first one logged)."""
        if self._incidents is None:
            self._incidents = self.service.incidents(log)
        self._incidents.count(
            "load_deadlines", "scd-store: an asynchronous load took longer than %.1f s (load_deadline_s); the "
            "blocks it had not filled are recomputed by the engine (counted as load_deadlines; logged once)",
            self.load_deadline_s, n=n)

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads completed, or passed their deadline, since the last call; the blocks
        they could not fill are reported by the next :meth:`failed_blocks` (vLLM asks for both in the same
        step)."""
        if self._async is None:
            return set()
        done, failed = self._async.finished()
        self._failed |= failed
        return done

    def close(self, timeout: float = 5.0) -> bool:
        """Cancel the asynchronous loads and wait for the fetch threads; False when one is still inside a load
        after ``timeout`` seconds (then the service it uses must stay open)."""
        return self._async.close(timeout) if self._async is not None else True

    def _load_one(self, load: ChunkLoad, gate: Gate | None = None) -> int:
        """Decode and write one request's hit; returns the tokens of the prompt now in its blocks. Chunks
        wholly below ``first_token`` (in the engine's own prefix cache) are neither fetched nor decoded.
        Every write into the blocks runs between ``gate.begin_write()`` and ``gate.end_write()``; once
        ``gate()`` (an asynchronous load cancelled or past its deadline) no further chunk is decoded, and once
        ``begin_write()`` refuses none is written."""
        halt = gate if gate is not None else OpenGate()
        if halt():
            return 0
        caches = self.paged()
        if caches is not None:
            return self._load_paged(load, caches, halt)
        _, heads, _, width = self.caches[0].shape
        shape = (len(self.caches), heads, load.chunk_size, width // 2)
        dtype, device = self.caches[0].dtype, self.caches[0].device
        skipped = load.first_token // load.chunk_size
        slots = device_index(load.slots, device)
        pair: list[tuple[torch.Tensor, torch.Tensor]] = []  # one buffer pair, reused chunk after chunk
        written = 0

        def write(i: int) -> None:  # chunk i (of those fetched) from the buffers into the request's blocks
            keys, values = pair[0]
            start = (skipped + i) * load.chunk_size
            first = max(start, load.first_token)
            where = slots[first - load.first_token:start + load.chunk_size - load.first_token]
            for layer, cache, k, v in zip(self.layers, self.caches, keys, values, strict=True):
                write_tokens(layer, cache, k[:, first - start:].transpose(0, 1), v[:, first - start:].transpose(0, 1),
                             where)

        def written_through(i: int) -> bool:  # chunk i from the buffers into the blocks, if the gate lets it
            nonlocal written
            if not halt.begin_write():
                return False
            try:
                write(i)
                written = i + 1
            finally:
                halt.end_write((skipped + written) * load.chunk_size)
            return True

        def into(i: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            if tokens != load.chunk_size or halt():  # stopped: chunk i - 1 is not written either
                return None
            if pair:  # chunk i - 1 is decoded (the service asks for chunk i only then): write it first
                if not written_through(i - 1) or halt():
                    return None
            else:
                pair.append((torch.empty(shape, dtype=dtype, device=device),
                             torch.empty(shape, dtype=dtype, device=device)))
            return pair[0]

        states = self.service.get(load.model, load.hashes[skipped:], into=into, **self._share())
        if len(states) > written and not halt():  # the last chunk decoded is still in the buffers
            written_through(len(states) - 1)
        return (skipped + written) * load.chunk_size

    def _load_paged(self, load: ChunkLoad, caches: PagedCaches, gate: Gate) -> int:
        """:meth:`_load_one` straight into the paged cache: chunk ``i``'s slot table is its tokens' slots, -1
        for tokens below ``first_token`` (the engine's own prefix cache: not written). Chunk ``i`` is being
        written from the moment its table is handed out until chunk ``i + 1``'s is asked for (the service
        asks only once chunk ``i`` is written) or the get returns."""
        skipped = load.first_token // load.chunk_size
        below = load.first_token - skipped * load.chunk_size
        table = device_index([-1] * below + list(load.slots), caches.device)
        writing: list[int] = []  # the chunk whose table is out, while it is being written

        def slots(i: int, tokens: int) -> torch.Tensor | None:
            if writing:  # chunk i - 1 is written
                writing.clear()
                gate.end_write((skipped + i) * load.chunk_size)
            if tokens != load.chunk_size or gate() or (i + 1) * tokens > table.shape[0] or not gate.begin_write():
                return None
            writing.append(i)
            return table[i * tokens:(i + 1) * tokens]

        written: int | None = None
        try:
            written = self.service.get_paged(load.model, load.hashes[skipped:], PagedTargets(caches, slots),
                                             **self._share())
        finally:
            if writing:  # the last table handed out: written if the get returned (else partly: recomputed)
                gate.end_write((skipped + (writing[0] if written is None else written)) * load.chunk_size)
        return (skipped + written) * load.chunk_size

    def _share(self) -> dict[str, HeadShare]:
        """The get's ``heads`` argument on a rank holding a share of the heads (none otherwise)."""
        return {"heads": self.heads} if self.heads is not None else {}

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed = self._failed, set()
        return failed

    # ------------------------------------------------------------ saves
    def layer_written(self) -> None:
        """The engine's forward wrote a layer's KV (vLLM's ``save_kv_layer``): the step's save copy is ordered after
        it on a GPU (:func:`~scd_store.adapters.vllm.host_copy.copy_blocks`)."""
        if self.caches:
            self._written = written_event(self.caches[0].device)

    def release(self, req_ids: list[str]) -> None:
        """Finished producer requests whose blocks were held for a refill check, released by this step's plan
        (after its saves copied them): reported once by the next :meth:`finished_saves`."""
        self._sent.update(req_ids)

    def finished_saves(self) -> set[str]:
        """The held requests released since the last call (vLLM's ``finished_sending``: it frees their blocks)."""
        sent, self._sent = self._sent, set()
        return sent

    def save(self, plan: StepPlan) -> None:
        """Copy the step's producer chunks' blocks out of the paged cache (the engine's thread waits for this
        copy only: ``vllm_save_copy`` in the latency histogram) and hand them to the put worker."""
        if plan.saves and self.heads is not None:
            self._once.warn("save-share", "scd-store: a tensor-parallel rank holds heads %d..%d of %d; a code space "
                            "is fitted on every head, so producers run at tensor-parallel size 1: not storing "
                            "(logged once)", self.heads.first, self.heads.first + self.heads.count - 1,
                            self.heads.total)
            return
        after, self._written = self._written, None
        for save in plan.saves:
            started = time.perf_counter()
            try:
                self._save_one(save, after)
            except LayoutError as exc:
                self._once.warn("save-layout", "scd-store: cannot read vLLM's cache; not storing (logged once): %s",
                                exc)
            self.service.observe("vllm_save_copy", time.perf_counter() - started)

    def _save_one(self, save: ChunkSave, after: Any = None) -> None:
        """The engine's thread copies the chunks' whole blocks as they lie (one ``index_select`` per layer,
        then, on a GPU, a non-blocking copy to pinned host memory); the put worker waits for that copy,
        un-packs the blocks through the layer maps and encodes."""
        block, layers = self.caches[0].shape[2], len(self.caches)
        blocks = [whole_blocks(slots, block) for slots in save.slots]
        nbytes = sum(len(b) for b in blocks) * sum(c[0].numel() * c.element_size() for c in self.caches)
        if not self.service.put_fits(len(save.hashes), nbytes):  # dropped before anything is copied
            self.service.count("dropped_puts", len(save.hashes))
            self._once.warn("put-full", "scd-store: the put queue has no room for a step's %d chunks (%d bytes; "
                            "put_queue_bytes bounds it): not copied, counted as dropped_puts (logged once)",
                            len(save.hashes), nbytes)
            return
        index = device_index([b for chunk in blocks for b in chunk], self.caches[0].device)
        host = copy_blocks(self.caches, index, [len(chunk) for chunk in blocks], after)
        copied = [(host.tensors[i * layers:(i + 1) * layers], start) for i, start in enumerate(save.starts)]

        def states() -> list[KVState] | None:  # on scd-store's put worker
            host.wait()
            try:
                maps = self.maps()
            except LayoutError as exc:
                self._once.warn("save-layout", "scd-store: cannot read vLLM's cache; not storing (logged once): %s",
                                exc)
                return None
            out = []
            for blocks, start in copied:
                local = torch.arange(blocks[0].shape[0] * block, dtype=torch.int64)
                per_layer = [read_tokens(m, b, local) for m, b in zip(maps, blocks, strict=True)]
                keys = torch.stack([k.transpose(0, 1) for k, _ in per_layer])  # [layers, kv_heads, tokens, dim]
                values = torch.stack([v.transpose(0, 1) for _, v in per_layer])
                out.append(KVState(keys.float(), values.float(), start=start))
            return out

        done = self._refilled(save.model) if save.refill else None
        self.service.submit_put(save.model, save.hashes, states, done=done, nbytes=host.nbytes)

    def _refilled(self, model: str) -> Callable[[int], None]:
        """Counts a refill's stored chunks (``refilled_chunks``, by space) once the put worker has stored them."""
        binding = self.service.binding(model)
        space = binding.space.space_id if binding is not None else ""

        def done(stored: int) -> None:
            if stored > 0:
                self.service.count("refilled_chunks", stored, space=space)
        return done


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; on a GPU copied from pinned memory without the calling
    thread waiting for the device (a pageable copy would synchronise the engine's stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def whole_blocks(slots: list[int], block_size: int) -> list[int]:
    """The blocks that ``slots`` fill exactly, in order (a chunk is whole blocks of its request)."""
    if not slots or len(slots) % block_size:
        raise LayoutError(f"a chunk of {len(slots)} slots is not whole {block_size}-token blocks")
    blocks = []
    for i in range(0, len(slots), block_size):
        first = slots[i]
        if first % block_size or slots[i + block_size - 1] != first + block_size - 1 \
                or slots[i:i + block_size] != list(range(first, first + block_size)):
            raise LayoutError("a chunk's slots do not fill whole blocks")
        blocks.append(first // block_size)
    return blocks
