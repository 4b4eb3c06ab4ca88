"""A consumer's read as the SGLang backend does it (``DeviceDecode.read`` over the real service, into the host
pool's layout and dtype): the page-by-page staged path, on the CPU with an injected stream, gives the CPU
decode's pages bit for bit; on CUDA the pages, decoded on the reading thread's stream and copied to host
memory, equal the same decode without streams and match the CPU decode within the dtype's rounding.

No SGLang here (so it runs on a GPU machine without it): the host pool is the stand-in of
:mod:`tests.adapters.sglang.host_pool`. Bit-equality across devices is not asserted: the decode's matmuls sum
in another order on CUDA (and the CPU's default product is bf16 on AMX and AVX512-BF16 machines, so fp32 is forced)."""

from __future__ import annotations

import pytest
import torch

from scd_store.adapters.sglang.device import DeviceDecode, device_decode
from scd_store.adapters.sglang.pages import flat_page
from scd_store.codecs.kv_state import KVState
from scd_store.service import EngineSettings, acquire_service, release_service
from tests.adapters.sglang.host_pool import PAGE, HostPool
from tests.adapters.sglang.test_device import recording_decode
from tests.bundles import PRODUCER, correlated_state, write_tiny_bundle
from tests.conftest import skip_where_the_store_cannot_sign

PAGES = 3
HASHES = [bytes([i + 1]) * 16 for i in range(PAGES)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}  # about one rounding of the pool's dtype, and the sums'


@pytest.fixture
def service(tmp_path, monkeypatch):
    skip_where_the_store_cannot_sign()  # the default store's disk tier signs with the host keyring
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCD_STORE_DECODE_MATMUL", "float32")
    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = acquire_service(EngineSettings.from_mapping({"bundles": [str(tmp_path / "bundle")]}))
    state = correlated_state(PAGES * PAGE, seed=6)
    pages = [KVState(state.keys[:, :, p * PAGE:(p + 1) * PAGE].contiguous(),
                     state.values[:, :, p * PAGE:(p + 1) * PAGE].contiguous(), start=p * PAGE) for p in range(PAGES)]
    assert service.put(PRODUCER, HASHES, pages) == PAGES
    yield service
    release_service(service)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_cpu_reads_are_the_service_decode_and_the_staged_path_gives_them_bit_for_bit(service, layout):
    pool = HostPool(layout)
    got = DeviceDecode().read(service, "consumer-a", HASHES, pool)
    want = [flat_page(s, layout, pool.dtype) for s in service.get("consumer-a", HASHES)]
    assert len(got) == len(want) == PAGES
    assert all(g.dtype == torch.float16 and torch.equal(g, w) for g, w in zip(got, want, strict=True))
    log: list[str] = []
    staged = recording_decode(log)[0].read(service, "consumer-a", HASHES, pool)  # into one reused page
    assert log == ["enter", "exit", "sync"] and len(staged) == PAGES
    assert all(torch.equal(g, w) for g, w in zip(staged, want, strict=True))
    assert DeviceDecode().read(service, PRODUCER, HASHES, pool) == []  # a producer's own pages: raw
    gap = [HASHES[0], bytes(16), HASHES[2]]  # the leading run only
    assert len(recording_decode([])[0].read(service, "consumer-a", gap, pool)) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA decode needs CUDA")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_reads_land_complete_in_host_memory_and_match_the_cpu_decode(service, layout, dtype):
    decode = device_decode("cuda")
    pool, tol = HostPool(layout, dtype=dtype), TOLERANCE[dtype]
    for _ in range(3):  # the reference decodes: eager, then CUDA graph capture and replay where the codec has them
        got = decode.read(service, "consumer-a", HASHES, pool)
        for i, page in enumerate(got):
            pool.set_from_flat_data_page(i * PAGE, page)
        same = [flat_page(s, layout, dtype).cpu() for s in service.get("consumer-a", HASHES, device=decode.device)]
        cpu = [flat_page(s, layout, dtype) for s in service.get("consumer-a", HASHES)]
        assert len(got) == len(same) == len(cpu) == PAGES
        for i, page in enumerate(got):
            assert page.device.type == "cpu" and page.dtype == dtype
            torch.testing.assert_close(page, same[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(page, cpu[i], atol=tol, rtol=tol)
            torch.testing.assert_close(pool.get_data_page(i * PAGE), cpu[i], atol=tol, rtol=tol)
