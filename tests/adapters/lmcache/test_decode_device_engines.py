"""decode_device in the LMCache plugin (inside real LMCacheEngines) and the multiprocess server's L2 adapter: a
staged decode (the CPU standing for the device, its stream deferred) hands LMCache the same KV as the host
decode, only after every copy landed; a CUDA device that is not here fails at start, naming the setting."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey

from scd_store.adapters.lmcache.dense_connector import DenseKVConnector
from scd_store.adapters.lmcache.device_decode import DeviceDecode, HostDecode
from scd_store.adapters.lmcache.l2_adapter import ScdL2Adapter, object_hash
from scd_store.service import SettingsError
from tests.adapters.lmcache.engines import DIM, HEADS, LAYERS, Engines, producer_kv, scd_backend
from tests.adapters.lmcache.stand_ins import DeferredCopies
from tests.bundles import PRODUCER, chunked

CHUNK, TOKENS = 16, 40  # two whole chunks and a partial one
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")


@pytest.fixture
def engines(tmp_path):
    made = Engines(tmp_path)
    yield made
    made.close()


def test_the_plugin_hands_lmcache_the_same_kv_from_a_staged_decode(engines):
    config = engines.config(CHUNK)
    kv, tokens = producer_kv(TOKENS), torch.arange(50, 50 + TOKENS)
    producer = engines.start(PRODUCER, config, DenseKVConnector(kv))
    producer.store(tokens)
    assert scd_backend(producer).drain(timeout=30)
    direct = torch.zeros_like(kv)
    host = engines.start("consumer-a", config, DenseKVConnector(direct))
    assert isinstance(scd_backend(host).decode_target, HostDecode)  # the default: cpu
    assert int(host.retrieve(tokens).sum()) == TOKENS
    staged = torch.zeros_like(kv)
    device = engines.start("consumer-a", config, DenseKVConnector(staged))
    copies = DeferredCopies()
    scd_backend(device).decode_target = DeviceDecode(torch.device("cpu"), copies)
    assert int(device.retrieve(tokens).sum()) == TOKENS
    assert copies.landed == 3 and not copies.queued  # one copy per chunk, all landed before LMCache read them
    assert int(direct.abs().sum()) > 0 and torch.equal(staged, direct)


@NO_CUDA
def test_a_plugin_told_to_decode_on_cuda_where_there_is_none_fails_at_start(engines, caplog):
    with caplog.at_level(logging.ERROR, logger="scd_store.adapters.lmcache"):
        engine = engines.start("consumer-a", engines.config(CHUNK, decode_device="cuda"),
                               DenseKVConnector(torch.zeros(2, LAYERS, TOKENS, 16, dtype=torch.float16)))
    assert scd_backend(engine) is None  # LMCache only logs a backend that fails to build
    assert "bad configuration: decode_device is 'cuda' but CUDA is not available" in caplog.text


def l2_params(engines: Engines, **extra: object) -> dict:
    """A consumer's server: its store reads the engines' disk with the public key of the producer's keys."""
    import yaml

    from scd_store.store.host_keys import deployment_keys

    private, public = deployment_keys(engines.bundle.parent / "keys")
    settings = yaml.safe_load(engines.store_yaml.read_text())
    for name, keys in (("producer", private), ("consumer", public)):
        (engines.bundle.parent / f"{name}.yaml").write_text(yaml.safe_dump({**settings, "signing_keys": str(keys)}))
    return {"server_role": "consumer", "bundles": [str(engines.bundle)],
            "store_config": str(engines.bundle.parent / "consumer.yaml"), **extra}


def produce(engines: Engines, hashes: list[bytes], states: list) -> int:
    """The producer's chunks, stored by a process of its own (its store holds the private key)."""
    from scd_store.service import KVService
    from scd_store.store.build import open_store
    from scd_store.store.config import load_config

    service = KVService(open_store(load_config(str(engines.bundle.parent / "producer.yaml"))), [engines.bundle])
    try:
        return service.put(PRODUCER, hashes, states)
    finally:
        service.close()


def load(adapter: ScdL2Adapter, keys: list[ObjectKey], tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    """An L2 load of ``keys`` into fresh L1 objects: the chunks loaded and their tensors."""
    objects = [SimpleNamespace(tensor=torch.zeros(2, LAYERS, n, HEADS * DIM, dtype=torch.float16)) for n in tokens]
    task = adapter.submit_load_task(keys, objects)
    deadline = time.monotonic() + 30
    while (bitmap := adapter.query_load_result(task)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return bitmap.popcount(), [obj.tensor for obj in objects]


def test_the_l2_adapter_loads_the_same_kv_from_a_staged_decode(engines):
    adapter = ScdL2Adapter(l2_params(engines))
    try:
        keys = [ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name="consumer-a", kv_rank=1 << 24) for i in range(3)]
        assert produce(engines, [object_hash(k) for k in keys], chunked(3, CHUNK, seed=3)) == 3
        found, direct = load(adapter, keys, [CHUNK] * 3)
        assert found == 3 and isinstance(adapter.decode_target, HostDecode)
        copies = DeferredCopies()
        adapter.decode_target = DeviceDecode(torch.device("cpu"), copies)
        found, staged = load(adapter, keys, [CHUNK] * 3)
        assert found == 3 and copies.landed == 3 and not copies.queued
        assert all(int(d.abs().sum()) > 0 and torch.equal(d, s) for d, s in zip(direct, staged, strict=True))
    finally:
        adapter.close()


@NO_CUDA
def test_an_l2_adapter_told_to_decode_on_cuda_where_there_is_none_fails_at_start(engines):
    with pytest.raises(SettingsError, match="decode_device is 'cuda:0' but CUDA is not available"):
        ScdL2Adapter(l2_params(engines, decode_device="cuda:0"))
