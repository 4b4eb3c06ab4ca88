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
