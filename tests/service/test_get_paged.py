"""``KVService.get_paged``: a consumer's codes decoded straight into an engine's paged cache through slot
tables, the same KV :meth:`KVService.get` decodes, at exactly the slots named; misses, refused chunks,
the caller's stop and the deadline end the run, and nothing outside the named slots is written."""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.paged import paged_caches, slot_table
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service import KVService, PagedTargets
from tests.bundles import PRODUCER, chunked, correlated_state, write_tiny_bundle
from tests.service.conftest import SERVED_HASHES

HASHES = SERVED_HASHES
PAIR = "tiny-space/consumer-a"
BLOCKS, BLOCK = 6, 4  # 24 slots: three 8-token chunks fit


def _caches(heads: int = 2, dim: int = 8):
    raw = [torch.full((BLOCKS, 2, BLOCK, heads, dim), float("nan")) for _ in range(2)]
    return raw, paged_caches(raw)


def _targets(caches, tables, asked=None):
    def slots(i: int, tokens: int):
        if asked is not None:
            asked.append((i, tokens))
        return tables[i] if i < len(tables) else None
    return PagedTargets(caches, slots)


def _read(raw, slots):
    blocks, places = slots // BLOCK, slots % BLOCK
    return [(c[:, 0][blocks, places], c[:, 1][blocks, places]) for c in raw]  # [tokens, heads, dim] per layer


def test_paged_gets_write_what_get_decodes_at_the_named_slots_and_nowhere_else(service):
    raw, caches = _caches()
    order = [5, 2, 0, 4, 1, 3]  # the request's blocks, out of order
    table = slot_table(order, 0, 24, BLOCK)
    table[:3] = -1  # tokens the engine already holds: not written
    tables = [table[8 * i:8 * i + 8] for i in range(3)]
    assert service.get_paged("consumer-a", HASHES, _targets(caches, tables)) == 3
    states = service.get("consumer-a", HASHES)
    for i, state in enumerate(states):
        keep = tables[i] >= 0
        for layer, (k, v) in enumerate(_read(raw, tables[i][keep])):
            assert torch.equal(k, state.keys[layer][:, keep].transpose(0, 1))
            assert torch.equal(v, state.values[layer][:, keep].transpose(0, 1))
    written = sum(int((~c.isnan()).sum()) for c in raw)
    assert written == 2 * 2 * 21 * 2 * 8  # layers x K/V x tokens x heads x dims: the three skipped slots untouched
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 0


def test_a_refused_chunk_ends_the_run_and_later_slots_stay_untouched(service):
    space = service.binding(PRODUCER).space
    big = service.binding(PRODUCER).codec.encode(correlated_state(256, start=8, seed=7))
    producer = service.store.producer(space.space_id, PRODUCER, space.fingerprint)
    assert producer.put([HASHES[1]], [big], [8], codec_id=ScdCodec.codec_id)  # 256 tokens under an 8-token header
    raw, caches = _caches()
    table = torch.arange(24, dtype=torch.int64)
    asked = []
    assert service.get_paged("consumer-a", HASHES, _targets(caches, [table[:8], table[8:16], table[16:]], asked)) == 1
    assert asked == [(0, 8), (1, 8)]  # chunk 2 is never asked for
    for c in raw:
        assert not c[:2].isnan().any()  # chunk 0: slots 0..7 (blocks 0 and 1)
        assert c[2:].isnan().all()  # slots 8.. (blocks 2..): nothing written
    assert service.store.stats.value("refused_chunks", pair=PAIR) == 1


def test_the_callers_stop_ends_the_run(service):
    raw, caches = _caches()
    assert service.get_paged("consumer-a", HASHES, _targets(caches, [torch.arange(8, dtype=torch.int64)])) == 1
    assert all(c[2:].isnan().all() and not c[:2].isnan().any() for c in raw)


def test_anyone_but_a_registered_consumer_gets_nothing_written(service):
    raw, caches = _caches()
    tables = [torch.arange(8 * i, 8 * i + 8, dtype=torch.int64) for i in range(3)]
    before = service.store.stats.value("refused_requests")
    assert service.get_paged(PRODUCER, HASHES, _targets(caches, tables)) == 0
    assert service.get_paged("stranger", HASHES, _targets(caches, tables)) == 0
    assert service.store.stats.value("refused_requests") == before + 2
    assert all(c.isnan().all() for c in raw)


def test_past_the_deadline_no_chunk_is_written(store, tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = KVService(store, [tmp_path / "bundle"], get_deadline_s=1e-9)
    service.put(PRODUCER, HASHES, chunked(3, 8, seed=5))
    raw, caches = _caches()
    tables = [torch.arange(8 * i, 8 * i + 8, dtype=torch.int64) for i in range(3)]
    assert service.get_paged("consumer-a", HASHES, _targets(caches, tables)) == 0
    assert service.store.stats.value("deadline_chunks", pair=PAIR) == 3
    assert all(c.isnan().all() for c in raw)


def test_caches_that_cannot_take_the_consumers_kv_raise_before_anything_is_written(service):
    raw, caches = _caches(heads=1)  # one head short
    tables = [torch.arange(8 * i, 8 * i + 8, dtype=torch.int64) for i in range(3)]
    with pytest.raises(ValueError):
        service.get_paged("consumer-a", HASHES, _targets(caches, tables))
    assert all(c.isnan().all() for c in raw)
