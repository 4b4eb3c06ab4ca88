import pytest

from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier


@pytest.fixture
def store(tmp_path):
    """An in-process CPU tier with a file registry, 8-token chunks."""
    st = TieredStore([CpuTier(1 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=8)
    yield st
    st.close()
