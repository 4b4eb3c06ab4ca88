from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")


def test_engines_whose_kv_the_connector_cannot_read_are_refused_at_start():
    from scd_store.adapters.vllm.connector import check_engine
    from scd_store.service import SettingsError

    def config(device="cpu", tp=1, pp=1):
        return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))

    check_engine(config())
    with pytest.raises(SettingsError, match="cuda"):
        check_engine(config("cuda"))
    with pytest.raises(SettingsError, match="parallel"):
        check_engine(config(tp=2))
