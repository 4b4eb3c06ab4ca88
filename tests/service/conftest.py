import pytest

from scd_store.service import KVService
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier


@pytest.fixture
def store(tmp_path):
    """An in-process CPU tier with a file registry, 8-token chunks."""
    st = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    yield st
    st.close()


SERVED_HASHES = [bytes([i]) * 16 for i in range(3)]


@pytest.fixture
def service(store, tmp_path):
    """A service over ``store`` with the tiny bundle (consumer ``consumer-a``), the producer's three 8-token
    chunks stored under :data:`SERVED_HASHES`."""
    from tests.bundles import PRODUCER, chunked, write_tiny_bundle

    write_tiny_bundle(tmp_path / "bundle", consumers=("consumer-a",))
    service = KVService(store, [tmp_path / "bundle"])
    service.put(PRODUCER, SERVED_HASHES, chunked(3, 8, seed=5))
    return service
