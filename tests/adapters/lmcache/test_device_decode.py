"""decode_device: where LMCache's chunks are decoded before it reads them. On the CPU straight into the host
memory; on a device into a staging tensor, copied in without blocking and waited for before the batch returns.
The logic runs here on the CPU with a stand-in for the CUDA stream; the CUDA run itself needs a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scd_store.adapters.lmcache.device_decode import (
    DeviceDecode,
    HostDecode,
    StagedBatch,
    decode_device,
    decode_target,
)
from scd_store.adapters.lmcache.layout import kv_2ltd_views
from scd_store.codecs.scd.layout import KVLayout
from scd_store.service import KVService, SettingsError
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from tests.adapters.lmcache.stand_ins import DeferredCopies
from tests.bundles import LAYOUT, PRODUCER, chunked, write_tiny_bundle

HEADS, CHUNK = LAYOUT.kv_heads, 8
SHAPE = (2, LAYOUT.num_layers, CHUNK, LAYOUT.kv_heads * LAYOUT.head_dim)  # KV_2LTD


def fake_cuda(available: bool = True, count: int = 1, current: int = 0) -> SimpleNamespace:
    return SimpleNamespace(is_available=lambda: available, device_count=lambda: count, current_device=lambda: current)


def test_on_the_cpu_chunks_decode_straight_into_the_host_memory():
    host = torch.zeros(SHAPE)
    target = decode_target("cpu")
    assert isinstance(target, HostDecode)
    with target.batch(HEADS) as batch:
        keys, values = batch.buffers(host)
        keys.fill_(1.0)
        values.fill_(2.0)
        batch.land(1)
    assert keys.data_ptr() == host.data_ptr() and bool((host[0] == 1).all()) and bool((host[1] == 2).all())


def test_a_cuda_decode_device_that_is_not_here_is_a_settings_error_naming_it():
    with pytest.raises(SettingsError, match="decode_device is 'cuda' but CUDA is not available"):
        decode_device("cuda", fake_cuda(available=False))
    with pytest.raises(SettingsError, match="decode_device is 'cuda:2' but this process sees 1 CUDA"):
        decode_device("cuda:2", fake_cuda(count=1))
    assert decode_device("cuda", fake_cuda(count=2, current=1)) == torch.device("cuda", 1)  # fixed at start
    assert decode_device("cuda:0", fake_cuda()) == torch.device("cuda", 0)
    if not torch.cuda.is_available():  # the real torch.cuda of this machine
        with pytest.raises(SettingsError, match="decode_device"):
            decode_target("cuda")


def test_each_decoded_chunk_is_copied_in_and_waited_for_before_the_batch_returns():
    copies = DeferredCopies()
    hosts = [torch.zeros(SHAPE), torch.zeros(SHAPE), torch.zeros(SHAPE[:2] + (3,) + SHAPE[3:])]
    staged: list[int] = []
    with StagedBatch(HEADS, torch.device("cpu"), copies) as batch:
        for i, host in enumerate(hosts):  # as KVService.get: buffers for chunk i, then its decode
            keys, values = batch.buffers(host)
            staged.append(keys.data_ptr())
            assert keys.data_ptr() != host.data_ptr()  # decoded off the host memory
            keys.fill_(10.0 + i)
            values.fill_(20.0 + i)
        batch.land(2)  # the third chunk was refused by the codec
        assert all(int(h.abs().sum()) == 0 for h in hosts)  # nothing has landed before the wait
    assert copies.waits == 1 and copies.landed == 2 and copies.scopes == 1
    for i in (0, 1):
        assert bool((hosts[i][0] == 10 + i).all()) and bool((hosts[i][1] == 20 + i).all())
    assert int(hosts[2].abs().sum()) == 0  # never decoded: never copied
    assert staged[0] == staged[1]  # one staging tensor per batch (a short last chunk gets its own)


def test_a_failed_get_still_waits_for_the_copies_in_flight():
    copies = DeferredCopies()
    hosts = [torch.zeros(SHAPE), torch.zeros(SHAPE)]
    with pytest.raises(RuntimeError, match="store went away"), StagedBatch(HEADS, torch.device("cpu"), copies) as batch:
        batch.buffers(hosts[0])[0].fill_(3.0)
        batch.buffers(hosts[1])  # the first chunk's copy is queued now
        raise RuntimeError("store went away")
    assert copies.waits == 1 and not copies.queued  # LMCache may free the memory now
    assert copies.landed == 1  # the decoded chunk's copy; the one never decoded was not queued


def test_a_device_with_no_room_for_a_chunk_ends_the_run_there(monkeypatch, caplog):
    copies = DeferredCopies()
    hosts = [torch.zeros(SHAPE), torch.zeros(SHAPE[:2] + (3,) + SHAPE[3:])]
    with StagedBatch(HEADS, torch.device("cpu"), copies) as batch:
        batch.buffers(hosts[0])[0].fill_(4.0)

        def full(*args, **kwargs):
            raise torch.OutOfMemoryError("no room")

        monkeypatch.setattr(torch, "empty", full)  # the short last chunk needs a staging tensor of its own
        assert batch.buffers(hosts[1]) is None
        monkeypatch.undo()
        batch.land(1)
    assert copies.landed == 1 and bool((hosts[0][0] == 4).all()) and "has no room" in caplog.text


@pytest.fixture
def service(tmp_path):
    """A service whose producer stored three 8-token chunks (positions 0, 8, 16)."""
    write_tiny_bundle(tmp_path / "bundle")
    store = TieredStore([CpuTier(1 << 22)], FileRegistry(tmp_path / "reg.json"), chunk_size=CHUNK)
    service = KVService(store, [tmp_path / "bundle"])
    hashes = [bytes([i + 1]) * 16 for i in range(3)]
    assert service.put(PRODUCER, hashes, chunked(3, CHUNK, seed=5)) == 3
    yield service, hashes
    store.close()


def retrieve(service: KVService, hashes: list[bytes], target: HostDecode | DeviceDecode,
             host: list[torch.Tensor], layout: KVLayout = LAYOUT) -> int:
    """The plugin's get: chunk i lands in ``host[i]``; the chunks decoded."""
    with target.batch(layout.kv_heads) as batch:
        states = service.get("consumer-a", hashes, into=lambda i, tokens: batch.buffers(host[i]))
        batch.land(len(states))
    return len(states)


def test_a_staged_decode_lands_the_same_kv_as_the_host_decode(service):
    """Through KVService.get's decode loop: decode_device cpu and a staged decode (the CPU standing for the
    device, the stream deferred) land the same bits in host memory."""
    service, hashes = service
    direct = [torch.zeros(SHAPE, dtype=torch.float16) for _ in hashes]
    assert retrieve(service, hashes, HostDecode(), direct) == 3
    copies = DeferredCopies()
    staged = [torch.zeros(SHAPE, dtype=torch.float16) for _ in hashes]
    assert retrieve(service, hashes, DeviceDecode(torch.device("cpu"), copies), staged) == 3
    assert copies.landed == 3 and copies.waits == 1
    assert all(int(d.abs().sum()) > 0 and torch.equal(d, s) for d, s in zip(direct, staged, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pinned_host_memory_holds_the_devices_decode_bit_for_bit(service):
    service, hashes = service
    device = decode_device("cuda")
    reference = [torch.zeros(SHAPE, dtype=torch.bfloat16, device=device) for _ in hashes]
    states = service.get("consumer-a", hashes, into=lambda i, tokens: kv_2ltd_views(reference[i], HEADS))
    assert len(states) == 3
    host = [torch.zeros(SHAPE, dtype=torch.bfloat16).pin_memory() for _ in hashes]
    assert retrieve(service, hashes, decode_target("cuda"), host) == 3
    assert all(torch.equal(h, r.cpu()) and int(h.float().abs().sum()) > 0 for h, r in zip(host, reference, strict=True))
