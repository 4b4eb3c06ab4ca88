"""vLLM's own scheduler (0.32 or 0.34) driving the connector's two halves, with no model run: :func:`engine` builds a
``Scheduler`` (a one-layer model config written to a directory, no weights) whose connector is an
:class:`ScdConnector` over a stand-in service, and a worker-role connector; :meth:`Engine.step` runs
one step as vLLM's engine core does (schedule, the worker's connector calls, ``update_from_output``)."""

from __future__ import annotations

import dataclasses
import json
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from scd_store.adapters.vllm.connector import ScdConnector
from scd_store.adapters.vllm.lookups import Lookups
from scd_store.adapters.vllm.scheduler_side import SchedulerSide
from scd_store.adapters.vllm.worker_side import WorkerSide
from scd_store.service import Lookup

BLOCK, CHUNK, BLOCKS = 16, 32, 64
PROMPT = list(range(1, 101))  # three whole chunks (96 tokens) and a tail


def runner_output(ran: list[str], kv_output: KVConnectorOutput) -> ModelRunnerOutput:
    """The model runner's output of a step that sampled one token per request (vLLM 0.33 dropped its
    ``req_id_to_index``)."""
    extra = {"req_id_to_index": {r: i for i, r in enumerate(ran)}} \
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)} else {}
    return ModelRunnerOutput(req_ids=ran, sampled_token_ids=[[7] for _ in ran], kv_connector_output=kv_output,
                             **extra)


def _config(model_dir: Path, batched_tokens: int = 1024) -> tuple[VllmConfig, KVCacheConfig]:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256,
        "max_position_embeddings": 1024, "torch_dtype": "float32"}))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched_tokens, max_model_len=1024,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="ScdConnector", kv_role="kv_both",
                                            kv_connector_module_path="scd_store.adapters.vllm.connector",
                                            kv_load_failure_policy="recompute"))
    vllm_config.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return vllm_config, KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                      kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


def _connector(vllm_config: VllmConfig, kv_config: KVCacheConfig, role: KVConnectorRole) -> ScdConnector:
    """An ScdConnector past vLLM's own base set-up, without a store (its halves are set by :func:`engine`)."""
    connector = ScdConnector.__new__(ScdConnector)
    KVConnectorBase_V1.__init__(connector, vllm_config=vllm_config, role=role, kv_cache_config=kv_config)
    connector.served_model, connector._checked = "consumer-a", {"consumer-a"}
    connector._scheduler = connector._worker = None
    connector.service = None
    return connector


class Engine:
    """A scheduler and a worker connector, stepped the way vLLM's engine core steps them."""

    def __init__(self, scheduler: Scheduler, worker: ScdConnector) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.side: SchedulerSide = scheduler.connector._scheduler
        self.free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.reported: list[str] = []  # every finished_recving, in order
        self.sent: list[str] = []  # every finished_sending (held producer requests released), in order
        hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as vLLM's engine core does: requests carry their block hashes
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)

    def add(self, req_id: str, prompt: list[int] = PROMPT, max_tokens: int = 4) -> Request:
        request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens), None, block_hasher=self._hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()  # as vLLM's model runner does, forward or not (kv_connector_no_forward)
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        self.reported.extend(sorted(recving or ()))
        self.sent.extend(sorted(sending or ()))
        kv_output = KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                      invalid_block_ids=self.worker.get_block_ids_with_load_errors())
        self.worker.clear_connector_metadata()
        ran = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(out, runner_output(ran, kv_output))
        return out

    def preempt(self, req_id: str) -> None:
        """Preempt a running request with vLLM's own code, as its schedule does when it runs out of blocks (the
        request's blocks are freed; it waits to be resumed)."""
        request = self.scheduler.requests[req_id]
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())

    def blocks_in_use(self) -> int:
        return self.free_blocks - self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def engine(tmp_path: Path, lookup: Callable[[str, Any], Lookup], load_one: Callable[..., int],
           lookups: dict[str, Any] | None = None, *, role: str = "consumer",
           save_one: Callable[[Any], None] | None = None, counted: list[tuple[str, int]] | None = None,
           batched_tokens: int = 1024, **side: Any) -> Engine:
    """vLLM's scheduler over the connector: ``lookup(model, hashes)`` answers the store's presence checks
    (on lookup threads when ``lookups`` gives :class:`Lookups` keywords), ``load_one(load, gate)`` stands in
    for the worker's fetch, decode and write (returns the tokens written), ``save_one(save)`` for its block
    copy of a producer's chunks. The served model has ``role``; ``batched_tokens``: the scheduler's token budget
    per step (a small one chunks a prefill over several steps); ``side``: more :class:`SchedulerSide` keywords
    (a ``refill``, ``refill_hold_s``, a ``clock``); incidents are appended to ``counted``."""
    vllm_config, kv_config = _config(tmp_path / "model", batched_tokens)
    counts = counted if counted is not None else []
    service = types.SimpleNamespace(chunk_size=CHUNK, lookup=lookup, readable_by_others=lambda *a: 0,
                                    binding=lambda model: types.SimpleNamespace(role=role),
                                    incidents=lambda log: types.SimpleNamespace(
                                        count=lambda name, *a, n=1, **k: counts.append((name, n))),
                                    observe=lambda *a, **k: None, count_requested=lambda *a: None)
    front = _connector(vllm_config, kv_config, KVConnectorRole.SCHEDULER)
    front._scheduler = SchedulerSide(service, "consumer-a", BLOCK,
                                     lookups=Lookups(lookup, **lookups) if lookups is not None else None, **side)
    with mock.patch.object(KVConnectorFactory, "create_connector", lambda **_: front):  # vLLM's own would open a store
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                              structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)
    back = _connector(vllm_config, kv_config, KVConnectorRole.WORKER)
    back._worker = WorkerSide(service)
    back._worker._load_one = load_one
    if save_one is not None:
        back._worker._save_one = lambda save, after=None: save_one(save)
    return Engine(scheduler, back)
