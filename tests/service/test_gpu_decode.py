"""A GPU tier's hit decodes from its tensor payload: no host copy on the tier's device, one copy to another
decode device, and the same KV, bit for bit, as the bytes path (a real ScdCodec over a small random space)."""

from __future__ import annotations

import pytest
import torch

from scd_store.codecs.scd.codec import ScdCodec
from scd_store.service import KVService
from scd_store.service.decode_loop import payload_on, same_device
from scd_store.store.registry import FileRegistry
from scd_store.store.results import CodeChunk
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.gpu import GpuTier
from scd_store.store.verify import verify_entry
from tests.bundles import PRODUCER, chunked, write_tiny_bundle
from tests.store.gpu_helpers import HostGpuTier, cuda, forbid_host_copies

HASHES = [bytes([i]) * 16 for i in range(3)]


def service_over(tmp_path, name: str, tier) -> KVService:
    """A service over one tier, the tiny bundle registered, the same three chunks put."""
    store = TieredStore([tier], FileRegistry(tmp_path / f"{name}.json"), chunk_size=8)
    service = KVService(store, [tmp_path / "bundle"])
    assert service.put(PRODUCER, HASHES, chunked(3, 8, seed=5)) == 3
    return service


@pytest.fixture
def bundle(tmp_path):
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))


@pytest.fixture
def services(tmp_path, bundle, request):
    """(bytes path: a CPU tier, tensor path: a GPU tier) over the same bundle and chunks."""
    made = [service_over(tmp_path, "bytes", CpuTier(1 << 20)),
            service_over(tmp_path, "tensor", getattr(request, "param", HostGpuTier)(1 << 20))]
    yield made
    for service in made:
        service.close()


@pytest.fixture
def payloads(monkeypatch):
    """Every payload the codec is handed (decode and decode_into)."""
    seen: list[object] = []
    decode, decode_into = ScdCodec.decode, ScdCodec.decode_into
    monkeypatch.setattr(ScdCodec, "decode", lambda self, p, **k: seen.append(p) or decode(self, p, **k))
    monkeypatch.setattr(ScdCodec, "decode_into", lambda self, p, *a, **k: seen.append(p) or decode_into(self, p, *a,
                                                                                                           **k))
    return seen


def assert_identical(a, b) -> None:
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert x.start == y.start and torch.equal(x.keys.cpu(), y.keys.cpu()) and torch.equal(x.values.cpu(),
                                                                                              y.values.cpu())


def buffers(device: str = "cpu"):
    keys = torch.full((2, 2, 24, 8), float("nan"), device=device)
    values = torch.full_like(keys, float("nan"))
    return keys, values, lambda i, n: (keys[:, :, 8 * i:8 * i + n], values[:, :, 8 * i:8 * i + n])


def in_tier(payload: torch.Tensor, service: KVService) -> bool:
    """Whether ``payload`` is a view of one of the service's GPU tier blob tensors (no copy was made)."""
    tier = service.store.tiers[0]
    ptr = payload.untyped_storage().data_ptr()
    return any(ptr == e.data.untyped_storage().data_ptr() for e in tier.get_blobs_now(list(held_keys(service))))


def held_keys(service: KVService) -> list[str]:
    binding = service.binding("consumer-a")
    return service.store.consumer(binding.pair_id, binding.model, binding.space.fingerprint).keys(HASHES)


def test_a_tensor_payload_decodes_bit_for_bit_as_its_bytes(services, payloads, monkeypatch) -> None:
    by_bytes, by_tensor = services
    want = by_bytes.get("consumer-a", HASHES)
    assert all(isinstance(p, memoryview) for p in payloads)
    payloads.clear()
    forbid_host_copies(monkeypatch)
    got = by_tensor.get("consumer-a", HASHES)
    assert_identical(got, want)
    assert len(payloads) == 3 and all(isinstance(p, torch.Tensor) and in_tier(p, by_tensor) for p in payloads)
    assert by_tensor.store.stats.value("hit_chunks", tier="gpu") == 3


def test_a_tensor_payload_decodes_into_engine_buffers_as_its_bytes(services, payloads, monkeypatch) -> None:
    by_bytes, by_tensor = services
    k1, v1, into1 = buffers()
    assert len(by_bytes.get("consumer-a", HASHES, into=into1)) == 3
    payloads.clear()
    forbid_host_copies(monkeypatch)
    k2, v2, into2 = buffers()
    assert len(by_tensor.get("consumer-a", HASHES, into=into2)) == 3
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and not k2.isnan().any()
    assert all(isinstance(p, torch.Tensor) and in_tier(p, by_tensor) for p in payloads)


def test_a_decode_never_writes_into_the_tier(services) -> None:
    _, by_tensor = services
    gpu = by_tensor.store.tiers[0]
    before = {key: gpu.get_now(key) for key in held_keys(by_tensor)}
    assert all(before.values())
    by_tensor.get("consumer-a", HASHES)
    by_tensor.get("consumer-a", HASHES, into=buffers()[2])
    for key, raw in before.items():
        assert gpu.get_now(key) == raw
        verify_entry(key, raw, None)  # the checksum still holds over what the tier keeps


def test_stored_bytes_agree_between_the_paths(services) -> None:
    by_bytes, by_tensor = services
    assert by_tensor.stored_bytes("consumer-a", HASHES) == by_bytes.stored_bytes("consumer-a", HASHES) > 0


def test_payload_on_leaves_bytes_and_same_device_tensors_alone(monkeypatch) -> None:
    meta = None
    view = memoryview(b"abc")
    tensor = torch.arange(3, dtype=torch.uint8)
    assert payload_on(CodeChunk("k", 0, 1, view, meta, "cpu"), torch.device("cpu")) is view
    assert payload_on(CodeChunk("k", 0, 1, tensor, meta, "gpu"), torch.device("cpu")) is tensor
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert same_device(torch.device("cuda", 0), torch.device("cuda", 0))


# ----------------------------------------------------------------- CUDA: the tier on the device
@cuda
@pytest.mark.parametrize("services", [GpuTier], indirect=True)
def test_a_cuda_hit_decoded_on_cuda_makes_no_host_copy(services, payloads, monkeypatch) -> None:
    by_bytes, by_tensor = services
    want = by_bytes.get("consumer-a", HASHES, device="cuda")
    payloads.clear()
    forbid_host_copies(monkeypatch)
    got = by_tensor.get("consumer-a", HASHES, device="cuda")
    assert_identical(got, want)
    assert all(p.device.type == "cuda" and in_tier(p, by_tensor) for p in payloads)
    keys, values, into = buffers("cuda")
    assert len(by_tensor.get("consumer-a", HASHES, into=into)) == 3 and not keys.isnan().any()


@cuda
@pytest.mark.parametrize("services", [GpuTier], indirect=True)
def test_a_cuda_hit_decoded_on_the_cpu_is_copied_once(services, payloads, monkeypatch) -> None:
    by_bytes, by_tensor = services
    want = by_bytes.get("consumer-a", HASHES)
    payloads.clear()
    forbid_host_copies(monkeypatch)  # the tier's own host path is not taken: the decode copies the payload only
    got = by_tensor.get("consumer-a", HASHES, device="cpu")
    assert_identical(got, want)
    assert len(payloads) == 3 and all(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in payloads)
