import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.adapters.vllm.paged_layout import LayoutError  # noqa: E402
from scd_store.adapters.vllm.plan import StepPlan  # noqa: E402
from scd_store.adapters.vllm.worker_side import WorkerSide, layer_order  # noqa: E402
from scd_store.service import KVService  # noqa: E402
from scd_store.store.registry import FileRegistry  # noqa: E402
from scd_store.store.tiered import TieredStore  # noqa: E402
from scd_store.store.tiers.cpu import CpuTier  # noqa: E402
from tests.bundles import PRODUCER, write_tiny_bundle  # noqa: E402


def test_lookups_are_counted_where_the_loads_run(tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = KVService(TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=8),
                        [tmp_path / "bundle"])
    try:
        WorkerSide(service).count_lookups(StepPlan(lookups=[("consumer-a", 24), (PRODUCER, 8), ("stranger", 8)]))
        assert service.store.stats.value("requested_tokens", pair="tiny-space/consumer-a") == 24
        assert service.store.stats.value("requested_tokens") == 24  # producers and strangers request nothing
    finally:
        service.close()


def test_layers_are_taken_in_model_order_by_their_index():
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert layer_order(names) == sorted(names, key=lambda n: int(n.split(".")[2]))
    with pytest.raises(LayoutError, match="layer index"):
        layer_order(["attn"])


def test_a_producer_chunk_is_copied_as_blocks_and_unpacked_off_the_engine_thread():
    import types

    import torch

    from scd_store.adapters.vllm.plan import ChunkSave, slots_of
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim = 32, 3, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(6, heads, block, 2 * dim) for _ in layers]
    request_blocks = [4, 1, 5, 2]
    slots = torch.tensor(slots_of(request_blocks, block, 0, 4 * block))
    written = [(torch.randn(4 * block, heads, dim), torch.randn(4 * block, heads, dim)) for _ in layers]
    for layer, cache, (k, v) in zip(layers, caches, written, strict=True):
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)  # the engine's own writes
    submitted = []
    service = types.SimpleNamespace(submit_put=lambda model, hashes, states, **_: submitted.append(states) or True,
                                    put_fits=lambda chunks, nbytes: True, store=types.SimpleNamespace(stats=None))
    worker = WorkerSide(service)
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    save = ChunkSave("r1", "producer", [b"\x01" * 16, b"\x02" * 16], [0, 2 * block],
                     [slots.tolist()[:2 * block], slots.tolist()[2 * block:]])
    from scd_store.adapters.vllm import worker_side as module

    unpacked = []
    read = module.read_tokens
    module.read_tokens = lambda *a: unpacked.append(1) or read(*a)
    try:
        worker._save_one(save)
        assert unpacked == []  # nothing un-packed on the engine's thread: a block copy only
        for cache in caches:
            cache.zero_()  # the blocks are reused at once: the put worker reads its own copy
        states = submitted[0]()
        assert unpacked  # on the put worker
    finally:
        module.read_tokens = read
    assert [s.start for s in states] == [0, 2 * block]
    for i, state in enumerate(states):
        for layer, (k, v) in enumerate(written):
            part = slice(i * 2 * block, (i + 1) * 2 * block)
            assert torch.equal(state.keys[layer], k[part].transpose(0, 1))
            assert torch.equal(state.values[layer], v[part].transpose(0, 1))
    with pytest.raises(LayoutError, match="whole"):
        worker._save_one(ChunkSave("r2", "producer", [b"\x03" * 16], [0], [list(range(1, 2 * block + 1))]))


def test_a_hit_is_written_into_the_request_blocks_from_the_first_token_the_engine_lacks():
    import types

    import torch

    from scd_store.adapters.vllm.paged_layout import probe, read_tokens
    from scd_store.adapters.vllm.plan import ChunkLoad, slots_of
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim, chunk = 32, 3, 64, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(8, heads, block, 2 * dim) for _ in layers]
    decoded = {bytes([i]) * 16: (torch.randn(2, heads, chunk, dim), torch.randn(2, heads, chunk, dim))
               for i in range(3)}
    asked = []

    def get(model, hashes, into):
        asked.append(list(hashes))
        states = []
        for i, h in enumerate(hashes):
            keys, values = into(i, chunk)
            keys.copy_(decoded[h][0])
            values.copy_(decoded[h][1])
            states.append(h)
        return states

    worker = WorkerSide(types.SimpleNamespace(get=get))
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    blocks = [7, 2, 5, 0, 3, 6]
    load = ChunkLoad("r1", "consumer", list(decoded), chunk, 96, blocks, block)  # the engine holds tokens 0..95
    assert worker.paged() is None  # vLLM-CPU packs keys for its kernels: loads write through the backend's op
    assert worker._load_one(load) == 3 * chunk
    assert asked == [list(decoded)[1:]]  # chunk 0 lies wholly in the engine's own cache: not fetched
    assert torch.equal(caches[0][blocks[0]], torch.zeros_like(caches[0][0]))  # the engine's blocks are untouched
    maps = [probe(layer, cache) for layer, cache in zip(layers, caches, strict=True)]
    slots = torch.tensor(slots_of(blocks, block, 96, 3 * chunk))
    want_k = torch.cat([decoded[h][0] for h in decoded], 2)[:, :, 96:]
    for layer, (block_map, cache) in enumerate(zip(maps, caches, strict=True)):
        keys, values = read_tokens(block_map, cache, slots)
        assert torch.equal(keys, want_k[layer].transpose(0, 1))
        assert torch.equal(values, torch.cat([decoded[h][1] for h in decoded], 2)[layer, :, 96:].transpose(0, 1))


def test_a_save_the_put_queue_has_no_room_for_is_counted_and_never_copied():
    import types

    import torch

    from scd_store.adapters.vllm.plan import ChunkSave
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim = 32, 3, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(6, heads, block, 2 * dim) for _ in layers]
    counted, asked, submitted = [], [], []
    service = types.SimpleNamespace(put_fits=lambda chunks, nbytes: asked.append((chunks, nbytes)) or False,
                                    count=lambda name, n=1, **_: counted.append((name, n)),
                                    submit_put=lambda *a, **k: submitted.append(a))
    worker = WorkerSide(service)
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    worker._save_one(ChunkSave("r", "producer", [b"\x01" * 16], [0], [list(range(2 * block, 4 * block))]))
    assert asked == [(1, 2 * heads * block * 2 * dim * 4 * len(layers))]  # two blocks of every layer, fp32
    assert counted == [("dropped_puts", 1)] and submitted == []


def test_a_load_decodes_every_chunk_into_one_buffer_pair():
    import types

    import torch

    from scd_store.adapters.vllm.plan import ChunkLoad
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim, chunk = 32, 3, 64, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(8, heads, block, 2 * dim) for _ in layers]
    handed = []

    def get(model, hashes, into):
        for i in range(len(hashes)):
            keys, values = into(i, chunk)
            handed.append(keys.data_ptr())
            keys.fill_(i + 1)
            values.fill_(-(i + 1))
        return list(hashes)

    worker = WorkerSide(types.SimpleNamespace(get=get))
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    blocks = [7, 2, 5, 0, 3, 6]
    assert worker._load_one(ChunkLoad("r", "consumer", [bytes([i]) * 16 for i in range(3)], chunk, 0, blocks,
                                      block)) == 3 * chunk
    assert len(set(handed)) == 1  # one pair, written out chunk by chunk
    from scd_store.adapters.vllm.paged_layout import probe, read_tokens
    from scd_store.adapters.vllm.plan import slots_of

    keys, values = read_tokens(probe(layers[0], caches[0]), caches[0],
                               torch.tensor(slots_of(blocks, block, 0, 3 * chunk)))
    for i in range(3):  # each chunk's own values landed, none overwritten by the next
        assert bool((keys[i * chunk:(i + 1) * chunk] == i + 1).all())
        assert bool((values[i * chunk:(i + 1) * chunk] == -(i + 1)).all())


def test_layouts_are_probed_at_registration_never_on_a_serving_thread(monkeypatch):
    """The probes launch the backend's own kernels: run lazily, they ran on the put or fetch thread mid-serving
    (on a GPU, beside the engine's work and captures). They run once, when the caches are registered."""
    import threading
    import types

    import torch

    from scd_store.adapters.vllm import worker_side as module
    from tests.adapters.vllm.engine_layers import cpu_layer

    block, heads, dim = 32, 3, 64
    layers = [cpu_layer(torch.float32, block, dim) for _ in range(2)]
    caches = [torch.zeros(6, heads, block, 2 * dim) for _ in layers]
    probes = []
    for name in ("layer_maps", "paged_target"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: probes.append(
            (_name, threading.current_thread().name)) or _real(*a))
    worker = WorkerSide(types.SimpleNamespace())
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)},
                    {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    assert sorted(n for n, _ in probes) == ["layer_maps", "paged_target"]
    here = threading.current_thread().name
    serving = threading.Thread(target=lambda: (worker.maps(), worker.paged()), name="scd-store-put")
    serving.start()
    serving.join()
    assert probes == [(n, here) for n, _ in probes]  # nothing probed on the serving thread
