"""The roles of an LMCache multiprocess server's L2 adapter (in process; the real ``lmcache server`` processes are in
integration_tests/test_lmcache_mp_roles.py): a server serves one role, whatever model its clients name."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey

from scd_store.adapters.lmcache import l2_adapter as l2_module
from scd_store.adapters.lmcache.l2_adapter import ScdL2Adapter, object_hash
from scd_store.service import SettingsError
from tests.adapters.lmcache.engines import DIM, HEADS, LAYERS, Engines, producer_kv
from tests.adapters.lmcache.test_decode_device_engines import l2_params, produce
from tests.bundles import PRODUCER, chunked

CHUNK = 16


@pytest.fixture
def engines(tmp_path):
    made = Engines(tmp_path)
    yield made
    made.close()


def params(engines: Engines, role: str, **extra: object) -> dict:
    consumer = l2_params(engines)
    keys = "producer" if role == "producer" else "consumer"
    return {**consumer, "server_role": role, "store_config": str(engines.bundle.parent / f"{keys}.yaml"), **extra}


def keys_of(model: str, n: int = 2, first: int = 1) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=bytes([first + i]) * 32, model_name=model, kv_rank=1 << 24) for i in range(n)]


def wait(poll, task):
    deadline = time.monotonic() + 30
    while (result := poll(task)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return result


def store(adapter: ScdL2Adapter, keys: list[ObjectKey]) -> int:
    """A client's store of ``keys`` (positions published by the server, as its transfer path does)."""
    adapter.positions.record([k.chunk_hash for k in keys], [i * CHUNK for i in range(len(keys))])
    kv = producer_kv(CHUNK * len(keys))
    objects = [SimpleNamespace(tensor=kv[:, :, i * CHUNK:(i + 1) * CHUNK].clone(), get_size=lambda: 1)
               for i in range(len(keys))]
    done: dict = {}
    wait(lambda task: done.update(adapter.pop_completed_store_tasks()) or done.get(task),
         adapter.submit_store_task(keys, objects))
    adapter.service.drain(timeout=30)
    return adapter.service.stat("puts")


def loaded(adapter: ScdL2Adapter, keys: list[ObjectKey]) -> int:
    objects = [SimpleNamespace(tensor=torch.zeros(2, LAYERS, CHUNK, HEADS * DIM, dtype=torch.float16))
               for _ in keys]
    return wait(adapter.query_load_result, adapter.submit_load_task(keys, objects)).popcount()


def test_a_server_names_its_role(engines):
    for bad in (None, "both", "PRODUCER"):
        with pytest.raises(SettingsError, match="server_role"):
            ScdL2Adapter({**params(engines, "consumer"), "server_role": bad})
    with pytest.raises(SettingsError, match="producer's server's setting"):
        ScdL2Adapter(params(engines, "consumer", allow_remote_clients=True))


def test_a_consumers_server_holds_no_private_key(engines):
    with pytest.raises(SettingsError, match="public keys only"):
        ScdL2Adapter({**params(engines, "consumer"), "store_config": str(engines.bundle.parent / "producer.yaml")})


def test_a_client_of_a_consumers_server_cannot_store_as_the_producer(engines):
    """The attack: a consumer engine (or any process reaching the port) registers under the producer's name and
    stores KV of its choosing; a genuine consumer then loads the decode of it. Refused, counted, a miss."""
    adapter = ScdL2Adapter(params(engines, "consumer"))
    try:
        forged = keys_of(PRODUCER)
        assert store(adapter, forged) == 0
        assert adapter.service.stat("client_role_refusals") == 2
        assert loaded(adapter, keys_of("consumer-a")) == 0  # nothing of it to load
        genuine = keys_of("consumer-a", first=9)
        assert produce(engines, [object_hash(k) for k in genuine], chunked(2, CHUNK, seed=3)) == 2
        assert loaded(adapter, genuine) == 2  # what the producer itself stored is served
    finally:
        adapter.close()


def test_a_producers_server_stores_its_chunks_and_serves_no_consumer(engines, monkeypatch):
    monkeypatch.setattr(l2_module, "remote_listeners", lambda: [])  # only loopback sockets
    adapter = ScdL2Adapter(params(engines, "producer"))
    try:
        assert store(adapter, keys_of(PRODUCER)) == 2
        assert loaded(adapter, keys_of("consumer-a")) == 0
        assert adapter.service.stat("client_role_refusals") == 2
    finally:
        adapter.close()


@pytest.mark.parametrize("listening", [["0.0.0.0:5555"], None])
def test_a_producers_server_others_can_reach_stores_nothing(engines, monkeypatch, listening):
    """Bound beyond the loopback address (or where that cannot be told), anyone reaching it could store as the
    producer: nothing is stored, unless the operator says the network is the producer engine's alone."""
    monkeypatch.setattr(l2_module, "remote_listeners", lambda: listening)
    adapter = ScdL2Adapter(params(engines, "producer"))
    try:
        assert store(adapter, keys_of(PRODUCER)) == 0 and adapter.service.stat("client_role_refusals") == 2
    finally:
        adapter.close()
    trusted = ScdL2Adapter(params(engines, "producer", allow_remote_clients=True))
    try:
        assert store(trusted, keys_of(PRODUCER, first=5)) == 2
    finally:
        trusted.close()


def test_the_listeners_check_sees_this_processes_sockets():
    import socket

    from scd_store.adapters.lmcache.listeners import remote_listeners

    with socket.socket() as local, socket.socket() as wide:
        local.bind(("127.0.0.1", 0))
        local.listen()
        before = remote_listeners()
        assert before is not None and f"127.0.0.1:{local.getsockname()[1]}" not in before
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        assert f"0.0.0.0:{wide.getsockname()[1]}" in (remote_listeners() or [])
