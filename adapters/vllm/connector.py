"""scd-store as a vLLM v1 KV connector: :class:`ScdConnector` (``KVConnectorBase_V1``; vLLM 0.32, on the CPU
or CUDA: what it serves is in :mod:`~scd_store.adapters.vllm.engine_check`).

Launch flags::

    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
        --kv-transfer-config '{"kv_connector": "ScdConnector",
            "kv_connector_module_path": "scd_store.adapters.vllm.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"bundles": ["/path/to/bundle"],
                                          "store_config": "/path/to/scd-store.yaml"}}'

The extra config holds the settings every scd-store adapter reads
(:mod:`scd_store.service.settings`). Requests of a space's producer (the served model, no
adapter) store their prompt's whole chunks as codes; requests of a registered consumer (the served
model, or a LoRA adapter by its ``--lora-modules`` name) load the leading run of stored chunks,
decoded into their own KV. A producer's chunks served by vLLM's own prefix cache are checked against
the store off the engine's thread and stored again when it lost them (``refilled_chunks``); a request
that finishes before the answer is in has its blocks held until then (``request_finished`` returns
True, ``get_finished`` reports it in ``finished_sending``). Hits only a remote tier holds load on
fetch threads between steps, each within ``load_deadline_s``.
Everyone else is a clean miss. A load that cannot be decoded is
recomputed by vLLM, never served.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from scd_store.adapters.vllm.async_loads import load_workers
from scd_store.adapters.vllm.engine_check import check_engine, check_groups, check_tensor_parallel
from scd_store.adapters.vllm.hashing import chain_canary
from scd_store.adapters.vllm.lookups import Lookups
from scd_store.adapters.vllm.plan import StepPlan
from scd_store.adapters.vllm.ranks import rank_heads
from scd_store.adapters.vllm.scheduler_side import SchedulerSide
from scd_store.adapters.vllm.worker_side import WorkerSide
from scd_store.service import EngineSettings, SettingsError, acquire_service, release_service
from scd_store.service.defaults import LOAD_DEADLINE_S, LOOKUP_DEADLINE_S
from scd_store.service.hash_agreement import HashMismatch

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("scd_store.adapters.vllm")
SHUTDOWN_WAIT_S = 5.0  # how long shutdown waits for the fetch (and lookup) threads to leave the store


def served_model_name(vllm_config: VllmConfig) -> str:
    """The name clients call the server's model by (the first ``--served-model-name``, else the path)."""
    name = vllm_config.model_config.served_model_name
    return name[0] if isinstance(name, (list, tuple)) else str(name)


class ScdConnector(KVConnectorBase_V1):
    """scd-store's codes as vLLM's external KV cache: the scheduler half plans, the worker half moves KV."""

    skip_param = "scd_skip_load"  # kv_transfer_params key a request sets to compute its prompt itself
    async_loads = False  # set from the settings (async_loads) when the service opens
    lookup_deadline_s = LOOKUP_DEADLINE_S  # set from the settings (lookup_deadline_s) when the service opens
    load_workers = 2  # fetch threads: set from the settings (load_workers) and vLLM's max_num_seqs
    load_deadline_s = LOAD_DEADLINE_S  # set from the settings (load_deadline_s) when the service opens

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config)
        check_groups(kv_cache_config)
        self.served_model = served_model_name(vllm_config)
        block_size = vllm_config.cache_config.block_size
        self.max_positions = int(vllm_config.model_config.max_model_len)  # stored chunks reaching past it: refused
        self.service = self._open_service(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        try:
            chunk_size = self.service.chunk_size
            if chunk_size % block_size:
                raise SettingsError(f"scd-store's chunk_size ({chunk_size}) must be a multiple of vLLM's block size "
                                    f"({block_size}): set --block-size or the store's chunk_size")
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("scd-store: kv_load_failure_policy set to 'recompute' (a code that cannot be decoded is "
                         "recomputed by the engine, never a failed request)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            binding = self.service.binding(self.served_model)
            self.service.note_served(self.served_model)
            check_tensor_parallel(vllm_config, binding.role if binding is not None else None,
                                  self._kv_transfer_config.kv_role)
            self.check_hashing(self.served_model)
        except BaseException:
            self._close_service(self.service)
            raise
        self._checked = {self.served_model}
        self._scheduler = SchedulerSide(self.service, self.served_model, block_size, self.skip_param,
                                        async_loads=self.async_loads,
                                        lookups=self._lookups() if self.async_loads else None,
                                        ) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(self.service, self.load_workers, self.load_deadline_s) \
            if role == KVConnectorRole.WORKER else None
        log.info("scd-store vLLM connector (%s) for %r: models %s", role.name.lower(), self.served_model,
                 self.service.models())

    def _open_service(self, extra_config: dict[str, Any]) -> Any:
        """The service the connector serves from: the process's shared :class:`KVService` for its settings."""
        settings = EngineSettings.from_mapping({"max_positions": self.max_positions, **extra_config})
        # vLLM holds a finished request's blocks for in-flight writes only on a consumer (kv_both, kv_consumer)
        self.async_loads = settings.async_loads and self._kv_transfer_config.kv_role != "kv_producer"
        self.lookup_deadline_s = settings.lookup_deadline_s
        self.load_workers = load_workers(settings.load_workers, self._vllm_config.scheduler_config.max_num_seqs)
        self.load_deadline_s = settings.load_deadline_s
        return acquire_service(settings)

    def _lookups(self) -> Lookups:
        """The scheduler's lookup threads, their deadlines and failures counted in the service's stats."""
        return Lookups(self.service.lookup, deadline_s=self.lookup_deadline_s, incidents=self.service.incidents(log))

    def _close_service(self, service: Any) -> None:
        release_service(service)

    def check_hashing(self, model: str) -> None:
        """Record (producer) or compare (consumer) this process's chunk hashing for ``model``."""
        with contextlib.suppress(HashMismatch):  # counted and logged by the service; the model's lookups miss
            self.service.check_hashing(model, chain_canary(self.service.chunk_size))

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.added(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        lora = getattr(request, "lora_request", None)
        if lora is not None and lora.lora_name not in self._checked:
            self._checked.add(lora.lora_name)
            self.check_hashing(lora.lora_name)
        return self._scheduler.match(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34: whether this request's hit may load asynchronously (it may then start loading before the
        running batch has room, ``--max-num-inflight-kv-loads``): a registered consumer's request with
        ``async_loads`` on, whose hit a remote tier may hold. Cheap: no lookup (never a false negative)."""
        return self._scheduler is not None and self.async_loads and self._scheduler.may_load(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM 0.34: the loaded tokens by the tier that held them (gpu: device, cpu: host, disk: disk, a peer:
        p2p, Redis: external_unspecified), summing to ``num_external_tokens``."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        planned = self._scheduler.sources.pop(request.request_id, {}) if self._scheduler is not None else {}
        if num_external_tokens <= 0:
            return {}
        if sum(planned.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource(source): tokens for source, tokens in planned.items()}

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34: no. The connector's fetch threads and its views of the KV cache are not drained and re-armed
        around the cache's remap (``unregister_kv_caches`` / ``restore_kv_caches``), so an engine with it does not
        offer sleep mode."""
        return False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The loads the workers reported finished: an abort after this cancels nothing."""
        super().update_connector_output(connector_output)
        if self._scheduler is not None:
            self._scheduler.loads_finished(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (an asynchronous load still in flight is cancelled by the next step's plan). True
        (vLLM keeps its blocks) only for a producer request whose refill check is not answered yet: a later
        step's plan copies what the store lost out of its blocks and releases it, and the workers report it
        once in ``finished_sending``. vLLM itself keeps the blocks of a request aborted while
        ``WAITING_FOR_REMOTE_KVS`` until the workers report its load, which they do once, cancelled or not."""
        held = self._scheduler.finished(request, list(block_ids)) if self._scheduler is not None else False
        return held, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        layers = self._vllm_config.compilation_config.static_forward_context
        self._worker.register(kv_caches, layers, rank_heads(self._vllm_config))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._get_connector_metadata()
        if self._worker is not None and isinstance(plan, StepPlan) and (plan.loads or plan.cancelled):
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Chunks are gathered once every layer has been written (:meth:`wait_for_save`), ordered after this: the
        forward's write of the layer, on the stream it runs on."""
        plan = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._worker is not None and isinstance(plan, StepPlan) and plan.saves:
            self._worker.layer_written()

    def wait_for_save(self) -> None:
        plan = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._worker is not None and isinstance(plan, StepPlan):
            self._worker.count_lookups(plan)
            if plan.saves:
                self._worker.save(plan)
            if plan.released:  # after the saves' block copy: their blocks may be freed now
                self._worker.release(plan.released)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The held producer requests released (vLLM frees their blocks), and the requests whose asynchronous
        loads are done or past their deadline (their failed blocks are in this step's
        :meth:`get_block_ids_with_load_errors`, which vLLM asks for right after)."""
        if self._worker is None:
            return None, None
        done, sent = self._worker.finished_loads(), self._worker.finished_saves()
        return sent or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Cancel the asynchronous loads (and lookups), wait for their threads, then release the service; one
        still inside a load past the wait keeps the service open (left to the process's exit): it is never
        closed under a thread that may still use it or write the engine's blocks."""
        idle = self._scheduler.close(SHUTDOWN_WAIT_S) if self._scheduler is not None else True
        idle = (self._worker.close(SHUTDOWN_WAIT_S) if self._worker is not None else True) and idle
        service, self.service = self.service, None
        if service is None:
            return
        if not idle:
            log.warning("scd-store: a load or lookup thread was still inside the store %.0f s after shutdown "
                        "began; the service is left open for the process's exit rather than closed under it",
                        SHUTDOWN_WAIT_S)
            return
        self._close_service(service)
