"""The scheduler half's plans, driven the way vLLM's scheduler calls it (request and output objects
with vLLM's field names), over a real service and store."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.plan import ChunkLoad, slots_of  # noqa: E402
from scd_store.adapters.vllm.scheduler_side import SchedulerSide  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.keys import chunk_hashes  # noqa: E402
from scd_store.store.registry import FileRegistry  # noqa: E402
from scd_store.store.tiered import TieredStore  # noqa: E402
from scd_store.store.tiers.cpu import CpuTier  # noqa: E402
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle  # noqa: E402

CHUNK, BLOCK = 8, 4
PROMPT = list(range(100, 100 + 3 * CHUNK + 5))  # three whole chunks and a tail


@pytest.fixture
def service(tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a", "adapter-x"))
    store = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=CHUNK)
    service = KVService(store, [tmp_path / "bundle"])
    yield service
    service.close()


def request(req_id, model=None, prompt=PROMPT, **extra):
    lora = None if model is None else SimpleNamespace(lora_name=model)
    return SimpleNamespace(request_id=req_id, req_id=req_id, prompt_token_ids=prompt, lora_request=lora,
                           prompt_embeds=None, mm_features=[], **extra)


def output(new=(), cached=None, scheduled=None):
    cached = cached or SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled or {})


def store_prompt(service, chunks=3):
    state = correlated_state(chunks * CHUNK, seed=1)
    states = [type(state)(state.keys[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous(),
                          state.values[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous(), start=i * CHUNK)
              for i in range(chunks)]
    service.put(PRODUCER, chunk_hashes(PROMPT, CHUNK)[:chunks], states)


def test_producer_chunks_are_planned_as_prefill_computes_them(service):
    side = SchedulerSide(service, PRODUCER, BLOCK)
    blocks = [7, 3, 9, 1, 4, 2, 8, 5]
    new = request("p1", block_ids=(blocks[:4],), num_computed_tokens=0)
    plan = side.build(output([new], scheduled={"p1": 12}))  # chunked prefill: 12 tokens this step
    assert [s.starts for s in plan.saves] == [[0]]
    assert plan.saves[0].slots == [slots_of(blocks, BLOCK, 0, CHUNK)]
    assert plan.saves[0].hashes == chunk_hashes(PROMPT, CHUNK)[:1]
    cached = SimpleNamespace(req_ids=["p1"], new_block_ids=[(blocks[4:],)], num_computed_tokens=[12],
                             resumed_req_ids=set())
    plan = side.build(output(cached=cached, scheduled={"p1": len(PROMPT) - 12}))
    assert [s.starts for s in plan.saves] == [[8, 16]]  # positions are the chunks' places in the prompt
    assert plan.saves[0].slots[1] == slots_of(blocks, BLOCK, 16, 24)
    done = SimpleNamespace(req_ids=["p1"], new_block_ids=[None], num_computed_tokens=[len(PROMPT)],
                           resumed_req_ids=set())
    assert side.build(output(cached=done, scheduled={"p1": 1})).saves == []  # decode steps store nothing


def test_chunks_from_the_engines_own_prefix_cache_are_not_stored_as_computed(service):
    side = SchedulerSide(service, PRODUCER, BLOCK)
    new = request("p2", block_ids=(list(range(8)),), num_computed_tokens=2 * CHUNK)
    plan = side.build(output([new], scheduled={"p2": len(PROMPT) - 2 * CHUNK}))
    assert [s.starts for s in plan.saves] == [[16]]  # chunks 0 and 1 are checked off-thread (test_refill.py)
    side.close()


def test_a_lora_adapter_named_like_the_producer_never_stores(service):
    """An adapter's KV is its own weights' even when its name is the producer's (runtime loading, a resolver,
    a typo in --lora-modules): only the served base model produces."""
    side = SchedulerSide(service, "some-server", BLOCK)
    new = request("a1", model=PRODUCER, block_ids=(list(range(8)),), num_computed_tokens=0)
    assert side.build(output([new], scheduled={"a1": len(PROMPT)})).saves == []
    base = SchedulerSide(service, PRODUCER, BLOCK)
    assert base.build(output([request("b1", block_ids=(list(range(8)),), num_computed_tokens=0)],
                             scheduled={"b1": len(PROMPT)})).saves  # the same server's own model does
    side.close()
    base.close()


def test_consumers_and_other_models_never_store(service):
    side = SchedulerSide(service, "consumer-a", BLOCK)
    plans = side.build(output([request("c1", block_ids=(list(range(8)),), num_computed_tokens=0),
                               request("u1", model="not-registered", block_ids=(list(range(8)),),
                                       num_computed_tokens=0)],
                              scheduled={"c1": len(PROMPT), "u1": len(PROMPT)}))
    assert plans.saves == []


def test_a_consumer_hit_is_the_stored_leading_run_and_leaves_the_last_token(service):
    store_prompt(service, chunks=2)
    side = SchedulerSide(service, "consumer-a", BLOCK)
    assert side.matched_tokens(request("c1"), 0) == 2 * CHUNK
    store_prompt(service, chunks=3)
    assert side.matched_tokens(request("c2"), 0) == 3 * CHUNK
    whole = PROMPT[:3 * CHUNK]  # a prompt of exactly three chunks: the engine computes the last token itself
    assert side.matched_tokens(request("c3", prompt=whole), 0) == 2 * CHUNK
    assert side.matched_tokens(request("c4"), 3 * CHUNK) == 0  # the engine's own cache already has it all
    assert service.store.stats.value("requested_tokens") == 0  # counted where the loads run (the worker)
    lookups = side.build(output()).lookups
    assert lookups == [("consumer-a", 3 * CHUNK), ("consumer-a", 3 * CHUNK), ("consumer-a", 2 * CHUNK),
                       ("consumer-a", 3 * CHUNK)]
    assert side.build(output()).lookups == []


def test_the_load_plan_covers_only_tokens_the_engine_has_not(service):
    store_prompt(service)
    side = SchedulerSide(service, "consumer-a", BLOCK)
    req = request("c1")
    assert side.matched_tokens(req, BLOCK) == 3 * CHUNK - BLOCK
    blocks = [5, 6, 7, 8, 9, 10, 11, 12]
    side.after_alloc(req, blocks, 3 * CHUNK - BLOCK)
    (load,) = side.build(output()).loads
    assert isinstance(load, ChunkLoad) and load.first_token == BLOCK and load.model == "consumer-a"
    assert load.slots == slots_of(blocks, BLOCK, BLOCK, 3 * CHUNK)
    assert load.blocks_from(CHUNK) == {7, 8, 9, 10}
    assert side.build(output()).loads == []  # planned once


def test_adapters_are_consumers_by_name_and_unknown_models_miss(service):
    store_prompt(service)
    side = SchedulerSide(service, PRODUCER, BLOCK)
    assert side.matched_tokens(request("a1", model="adapter-x"), 0) == 3 * CHUNK
    assert side.matched_tokens(request("b1"), 0) == 0  # the producer reads its own raw cache
    assert side.matched_tokens(request("u1", model="not-registered"), 0) == 0


def test_requests_whose_tokens_do_not_identify_them_are_neither_stored_nor_served(service, caplog):
    store_prompt(service)
    producer = SchedulerSide(service, PRODUCER, BLOCK)
    embedded = SimpleNamespace(**{**vars(request("e1", model="adapter-x")), "prompt_embeds": object()})
    assert producer.matched_tokens(embedded, 0) == 0
    assert producer.matched_tokens(embedded, 0) == 0  # asked again while waiting for blocks: counted once
    mm = SimpleNamespace(**{**vars(request("m1", block_ids=(list(range(8)),), num_computed_tokens=0)),
                            "mm_features": [object()]})
    assert producer.build(output([mm], scheduled={"m1": len(PROMPT)})).saves == []
    assert service.store.stats.value("unkeyable_requests") == 2
    assert sum("unkeyable" in r.message for r in caplog.records) == 1


def test_a_request_can_opt_out_of_loading_and_a_cache_salt_isolates_it(service):
    store_prompt(service)
    side = SchedulerSide(service, "consumer-a", BLOCK)
    assert side.matched_tokens(request("s1", kv_transfer_params={"scd_skip_load": True}), 0) == 0
    assert side.matched_tokens(request("s2", kv_transfer_params={"raw_skip_load": True}), 0) == 3 * CHUNK
    assert side.matched_tokens(request("s3", cache_salt="tenant-7"), 0) == 0  # isolated: never shared
    producer = SchedulerSide(service, PRODUCER, BLOCK)
    salted = request("p9", block_ids=(list(range(8)),), num_computed_tokens=0, cache_salt="tenant-7")
    producer.added(salted)
    assert producer.build(output([salted], scheduled={"p9": len(PROMPT)})).saves == []

