"""The connector's scheduler half, :class:`SchedulerSide`: hits for consumer requests, store plans for producer
requests.

A request's model is its LoRA adapter's name when it has one, else the server's served model name
(both through the settings' aliases). Chunk hashes are scd-store's own stable chain over the
prompt's token ids (:func:`scd_store.service.hashing.chunk_hashes`), so every process agrees; a chunk's
position is its index in the prompt. Requests whose tokens do not say what they hold (prompt
embeddings, multimodal inputs) or that ask for an isolated cache (a ``cache_salt``) are neither
stored nor served, counted as ``unkeyable_requests``. A request whose ``kv_transfer_params`` set
``skip_param`` (``scd_skip_load: true``) computes its prompt itself (it may still be stored). With
``lookups`` (the connector's, when ``async_loads`` is on) a consumer request's lookup runs on a lookup
thread (:mod:`~scd_store.adapters.vllm.lookups`) and vLLM is answered None until it is in.

A producer request's leading chunks that vLLM's own prefix cache held are not computed again, so
they are not stored as they are computed; instead their presence in the store is checked off the
engine's thread (:class:`~scd_store.adapters.vllm.refill.Refill`) and the chunks the store lost are
stored again from the request's blocks (``refilled_chunks``). A request that finishes before the
check's answer is in (a one-token, prefill-only request finishes in the step it is scheduled) is
*held*: :meth:`SchedulerSide.finished` says so and the connector asks vLLM to keep its blocks
(``request_finished`` returns ``delay_free_blocks``); every later step asks for the answer again (vLLM
keeps stepping while such requests exist, running the connector in steps with nothing to compute),
plans the refill from the held blocks once it is in, and lists the request in the plan's ``released``;
the worker reports it as ``finished_sending`` after that step's block copy, once, and vLLM frees its
blocks. A request held ``refill_hold_s`` without an answer is released without a refill
(``refill_timeouts``); at most ``max_held`` requests are held (past that a request is not held, and
the answer waits for the next request of the prefix). Nothing else is ever held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scd_store.adapters.vllm.hit_sources import token_sources
from scd_store.adapters.vllm.lookups import Lookups
from scd_store.adapters.vllm.plan import ChunkLoad, ChunkSave, StepPlan, slots_of
from scd_store.adapters.vllm.refill import Refill
from scd_store.service import KVService, Role
from scd_store.service.hashing import chunk_hashes

log = logging.getLogger("scd_store.adapters.vllm")
REFILL_HOLD_S = 10.0  # how long a finished producer request's blocks may wait for its refill check's answer
MAX_HELD = 64  # finished producer requests held for a refill check at once


@dataclass(slots=True)
class _Producing:
    """A producer request whose prompt chunks are being stored as they are computed."""

    model: str
    hashes: list[bytes]
    block_ids: list[int]
    next_chunk: int


@dataclass(slots=True)
class _Refilling:
    """A producer request whose leading chunks came from vLLM's own prefix cache: checked, maybe stored again."""

    model: str
    hashes: list[bytes]  # the chunks the engine's prefix cache held
    block_ids: list[int]  # the request's blocks holding them
    preemptions: int = 0  # vLLM's count of the request's preemptions then (a preemption frees its blocks)


@dataclass(slots=True)
class _Held:
    """A finished producer request whose blocks vLLM keeps until its refill check is answered."""

    refilling: _Refilling
    since: float


def request_model(request: Any, served_model: str) -> str:
    """The model a request runs: its LoRA adapter's name, or the server's model."""
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else served_model


def keyable(request: Any) -> bool:
    """Whether the request's token ids alone say what its KV holds, and whom it may be shared with."""
    return (getattr(request, "prompt_embeds", None) is None and not getattr(request, "mm_features", None)
            and not getattr(request, "cache_salt", None))


def skips_load(request: Any, skip_param: str) -> bool:
    """Whether the request asked (``kv_transfer_params``) to compute its prompt itself."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get(skip_param))


class SchedulerSide:
    """Matched tokens, load plans and save plans, one step at a time."""

    def __init__(self, service: KVService, served_model: str, block_size: int,
                 skip_param: str = "scd_skip_load", refill: Refill | None = None, async_loads: bool = True,
                 lookups: Lookups | None = None, refill_hold_s: float = REFILL_HOLD_S, max_held: int = MAX_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.skip_param = skip_param
        self.served_model = served_model
        self.block_size = block_size
        self.chunk_size = service.chunk_size
        self.async_loads = async_loads
        self._hits: dict[str, tuple[str, list[bytes], bool, tuple[str, ...]]] = {}
        self._loads: list[ChunkLoad] = []
        self._lookups: list[tuple[str, int]] = []
        self._producing: dict[str, _Producing] = {}
        self._refilling: dict[str, _Refilling] = {}
        self._held: dict[str, _Held] = {}  # finished requests whose blocks wait for their refill check
        self._started: set[str] = set()  # requests scheduled once: sent again, they were resumed
        self.sources: dict[str, dict[str, int]] = {}  # a load's tokens by source, until vLLM asks
        self.refill_hold_s = refill_hold_s
        self.max_held = max_held
        self._clock = clock
        # what the tiers other processes read hold (the producer's own copies do not count), on the refill's thread
        self.refill = refill if refill is not None else Refill(service.readable_by_others)
        self._counted: set[str] = set()
        self._planned: set[str] = set()  # requests whose load was planned: offered no second one
        self._loading: set[str] = set()  # asynchronous loads handed over that the workers have not reported
        self._cancelled: list[str] = []  # requests that finished while loading: cancelled in the next plan
        self._unkeyed: set[str] = set()
        self._requests: dict[str, Any] = {}  # vLLM's Request objects (what a step's new-request data leaves out)
        self._incidents = service.incidents(log)
        self.lookups = lookups  # None: lookups on the scheduler's thread (the answer is always in at once)

    def added(self, request: Any) -> None:
        """A request entered the scheduler."""
        self._requests[request.request_id] = request

    def _role(self, model: str) -> Role | None:
        binding = self.service.binding(model)
        return None if binding is None else binding.role

    def _unkeyable(self, request: Any) -> bool:
        """Whether the request cannot be keyed by its tokens (counted once per request, logged once)."""
        if keyable(request):
            return False
        req_id = getattr(request, "request_id", None) or request.req_id
        if req_id in self._unkeyed:  # asked again while it waits for blocks
            return True
        self._unkeyed.add(req_id)
        self._incidents.count("unkeyable_requests", "scd-store: requests with prompt embeddings, multimodal inputs "
                              "or a cache_salt are neither stored nor served (counted as unkeyable_requests; logged "
                              "once)")
        return True

    # ------------------------------------------------------------ consumer hits
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` a consumer request can load (0 for anyone else)."""
        return self.match(request, num_computed_tokens)[0]

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` a consumer request can load (0 for anyone else), and whether
        they load asynchronously (some chunk only a remote tier holds; with ``async_loads``). With
        background ``lookups``, None while the request's lookup is out (vLLM asks again next step).

        The last prompt token is always left to the engine (it needs its logits). A request is offered one
        load: asked again once its load was planned (the load failed, or vLLM preempted it), it computes
        its prompt itself, so a tier that answers lookups but not gets cannot make vLLM retry forever."""
        model = request_model(request, self.served_model)
        if self._role(model) != Role.CONSUMER or skips_load(request, self.skip_param) or self._unkeyable(request):
            return 0, False
        if request.request_id in self._planned:  # asked again after its load: it failed or was preempted
            return 0, False  # computed by the engine (one load per request: never a retry storm)
        tokens = list(request.prompt_token_ids or ())
        usable = (len(tokens) - 1) // self.chunk_size
        if usable <= 0:
            return 0, False
        hashes = chunk_hashes(tokens[:usable * self.chunk_size], self.chunk_size)
        if request.request_id not in self._counted:  # asked again while it waits for blocks: one lookup
            self._counted.add(request.request_id)
            self._lookups.append((model, usable * self.chunk_size))
        found = self.service.lookup(model, hashes) if self.lookups is None else \
            self.lookups.answer(request.request_id, model, hashes)
        if found is None:
            return None, False
        matched = found.chunks * self.chunk_size
        if matched <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        asynchronous = self.async_loads and found.remote_chunks > 0
        self._hits[request.request_id] = (model, hashes[:found.chunks], asynchronous, tuple(found.tiers))
        return matched - num_computed_tokens, asynchronous

    def may_load(self, request: Any) -> bool:
        """Whether ``request`` may be offered a hit at all (a registered consumer's keyable request that asks to
        load): what vLLM's ``may_load_async`` is told, without a lookup."""
        model = request_model(request, self.served_model)
        return self._role(model) == Role.CONSUMER and not skips_load(request, self.skip_param) and keyable(request) \
            and request.request_id not in self._planned

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of a hit the scheduler accepted (``num_external_tokens`` of it)."""
        hit = self._hits.pop(request.request_id, None)
        if self.lookups is not None:  # a later ask (after a preemption) looks up afresh
            self.lookups.forget(request.request_id)
        if num_external_tokens <= 0 or hit is None:
            return
        model, hashes, asynchronous, tiers = hit
        self._planned.add(request.request_id)
        if asynchronous:
            self._loading.add(request.request_id)
        end = len(hashes) * self.chunk_size
        first = end - num_external_tokens
        self.sources[request.request_id] = token_sources(tiers, self.chunk_size, first, end)
        self._loads.append(ChunkLoad(request.request_id, model, hashes, self.chunk_size, first, list(block_ids),
                                     self.block_size, asynchronous))

    # ------------------------------------------------------------ producer saves
    def _start_producing(self, new_req: Any) -> None:
        self._started.add(new_req.req_id)
        request = self._requests.get(new_req.req_id, new_req)
        if getattr(request, "lora_request", None) is not None or getattr(new_req, "lora_request", None) is not None:
            return  # only the served base model produces: an adapter named like the producer is its own weights
        model = request_model(new_req, self.served_model)
        if self._role(model) != Role.PRODUCER or self._unkeyable(request):
            return
        tokens = list(new_req.prompt_token_ids or ())
        if len(tokens) < self.chunk_size:
            return
        hashes = chunk_hashes(tokens, self.chunk_size)
        cached = min(new_req.num_computed_tokens // self.chunk_size, len(hashes))
        self._producing[new_req.req_id] = _Producing(model, hashes, list(new_req.block_ids[0]), cached)
        if cached:  # the engine's own prefix cache held them: stored again if the store lost them
            blocks = cached * self.chunk_size // self.block_size
            self._refilling[new_req.req_id] = _Refilling(model, hashes[:cached], list(new_req.block_ids[0][:blocks]),
                                                         getattr(request, "num_preemptions", 0))

    def _saves(self, req_id: str, model: str, hashes: list[bytes], chunks: list[int], block_ids: list[int],
               refill: bool = False) -> ChunkSave:
        return ChunkSave(req_id, model, [hashes[i] for i in chunks], [i * self.chunk_size for i in chunks],
                         [slots_of(block_ids, self.block_size, i * self.chunk_size, (i + 1) * self.chunk_size)
                          for i in chunks], refill=refill)

    def _refill_ready(self, req_id: str, saves: list[ChunkSave]) -> None:
        """Store again the chunks the store said it lost (once its answer is in: it is never waited for)."""
        refilling = self._refilling[req_id]
        chunks = self.refill.take(refilling.model, refilling.hashes)
        if chunks is None:
            return
        del self._refilling[req_id]
        if chunks:
            saves.append(self._saves(req_id, refilling.model, refilling.hashes, chunks, refilling.block_ids,
                                     refill=True))

    def _release_ready(self, req_id: str, plan: StepPlan) -> None:
        """A held request: once its check's answer is in, plan its refill (if any) and release its blocks;
        without an answer after ``refill_hold_s``, release them without one."""
        held = self._held[req_id]
        refilling = held.refilling
        chunks = self.refill.take(refilling.model, refilling.hashes)
        if chunks is None:
            if self._clock() - held.since < self.refill_hold_s:
                return
            self._incidents.count("refill_timeouts", "scd-store: a finished producer request's refill check was "
                                  "not answered within %.0f s; its blocks are released without a refill (counted as "
                                  "refill_timeouts; logged once)", self.refill_hold_s)
        elif chunks:
            plan.saves.append(self._saves(req_id, refilling.model, refilling.hashes, chunks, refilling.block_ids,
                                          refill=True))
        del self._held[req_id]
        plan.released.append(req_id)

    def held(self) -> set[str]:
        """Finished requests whose blocks are held for a refill check."""
        return set(self._held)

    def _save_ready(self, req_id: str, computed: int, saves: list[ChunkSave]) -> None:
        producing = self._producing[req_id]
        ready = min(computed // self.chunk_size, len(producing.hashes))
        if ready <= producing.next_chunk:
            return
        save = self._saves(req_id, producing.model, producing.hashes, list(range(producing.next_chunk, ready)),
                           producing.block_ids)
        saves.append(save)
        self.refill.saved(producing.model, save.hashes)  # a check racing this put does not store them twice
        producing.next_chunk = ready
        if ready == len(producing.hashes):
            del self._producing[req_id]

    def build(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: the loads planned since the last step, producers' newly computed chunks, and
        the chunks of their prefix-cache hits the store lost (requests scheduled this step only)."""
        plan = StepPlan(loads=self._loads, lookups=self._lookups, cancelled=self._cancelled)
        self._loads, self._lookups, self._cancelled = [], [], []
        if self.lookups is not None:
            self.lookups.new_step()
        for req_id in list(self._held):
            self._release_ready(req_id, plan)
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._started:  # resumed after a preemption, sent anew (vLLM >= 0.33, V2 runner)
                self._resumed(new_req.req_id, list(new_req.block_ids[0]))
            else:
                self._start_producing(new_req)
            if new_req.req_id in self._producing:
                self._save_ready(new_req.req_id, new_req.num_computed_tokens + scheduled.get(new_req.req_id, 0),
                                 plan.saves)
            if new_req.req_id in self._refilling:
                self._refill_ready(new_req.req_id, plan.saves)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # vLLM 0.32's V1 runner resumes requests here
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                self._resumed(req_id, list(new_blocks[0]) if new_blocks is not None else None)
            elif req_id in self._refilling:
                self._refill_ready(req_id, plan.saves)
            producing = self._producing.get(req_id)
            if producing is None:
                continue
            if new_blocks is not None and req_id not in resumed:
                producing.block_ids.extend(new_blocks[0])
            self._save_ready(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan.saves)
        return plan

    def _resumed(self, req_id: str, block_ids: list[int] | None) -> None:
        """A request resumed after a preemption, with its blocks now: its blocks were freed, so a refill of the
        old ones is dropped (not asked again: the next request of the prefix refills); a producer keeps its
        store progress (what it stored before is not stored again) and saves the rest from its new blocks."""
        self._refilling.pop(req_id, None)
        producing = self._producing.get(req_id)
        if producing is not None and block_ids is not None:
            producing.block_ids = block_ids

    def loads_finished(self, req_ids: Any) -> None:
        """The asynchronous loads the workers reported finished (vLLM's ``finished_recving``)."""
        self._loading.difference_update(req_ids)

    def finished(self, request: Any, block_ids: list[int] | None = None) -> bool:
        """Forget a finished request; one whose asynchronous load is still in flight (aborted while vLLM held
        it in ``WAITING_FOR_REMOTE_KVS``) has its load cancelled by the next step's plan. vLLM keeps its blocks
        until the workers report the load finished, which they do once, cancelled or not. True when the
        request's blocks are to be held for its refill check (a producer request whose check's answer is
        not in): a later plan releases them, and the workers report it once as ``finished_sending``. Never
        for a request whose blocks may no longer be those its check was planned from: preempted since
        (vLLM freed them), or ``block_ids`` (its blocks now, when given) not starting with them."""
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            self._cancelled.append(request.request_id)
        self._producing.pop(request.request_id, None)
        self._started.discard(request.request_id)
        self.sources.pop(request.request_id, None)
        refilling = self._refilling.pop(request.request_id, None)
        hold = refilling is not None and self._may_hold(request, refilling, block_ids)
        if refilling is not None and hold:
            self._held[request.request_id] = _Held(refilling, self._clock())
        self._hits.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        if self.lookups is not None:
            self.lookups.forget(request.request_id)
        self._counted.discard(request.request_id)
        self._planned.discard(request.request_id)
        self._unkeyed.discard(request.request_id)
        return hold

    def _may_hold(self, request: Any, refilling: _Refilling, block_ids: list[int] | None) -> bool:
        """Whether a finished request's blocks may be held for its refill: room for it, and they are still the
        blocks its check was planned from."""
        return (request.request_id not in self._held and len(self._held) < self.max_held
                and getattr(request, "num_preemptions", 0) == refilling.preemptions
                and (block_ids is None or list(block_ids[:len(refilling.block_ids)]) == refilling.block_ids))

    def close(self, timeout: float = 5.0) -> bool:
        """Forget the held requests (the engine is shutting down) and stop the refill's and the lookups'
        threads; False when one of them is still inside the store."""
        self._held.clear()
        idle = self.refill.close(timeout)
        return (self.lookups.close(timeout) if self.lookups is not None else True) and idle
