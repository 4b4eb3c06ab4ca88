import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from scd_store.bench.raw_reuse import RawKVDirectory  # noqa: E402
from tests.bundles import correlated_state  # noqa: E402


def test_the_raw_baseline_serves_the_producers_kv_to_any_other_model(tmp_path):
    raw = RawKVDirectory(tmp_path / "raw", producer="base", chunk_size=8)
    state = correlated_state(8, seed=3)
    hashes = [b"\x01" * 16, b"\x02" * 16]
    assert raw.binding("base").role == "producer" and raw.binding("any-fine-tune").role == "consumer"
    assert raw.submit_put("base", hashes[:1], lambda: [state])
    raw.close()
    assert raw.contains("any-fine-tune", hashes) == 1
    keys, values = torch.empty_like(state.keys), torch.empty_like(state.values)
    (got,) = raw.get("any-fine-tune", hashes, into=lambda i, tokens: (keys, values))
    assert torch.allclose(keys, state.keys.half().float()) and torch.allclose(values, state.values.half().float())
    assert got.num_tokens == 8 and raw.bytes_read > 0
    (tmp_path / "raw" / f"{hashes[0].hex()}.kv").write_bytes(b"garbage")
    assert raw.get("any-fine-tune", hashes) == []  # a bad file is a miss


def test_the_raw_baseline_offers_every_service_call_the_vllm_connector_makes(tmp_path):
    import re
    from pathlib import Path

    import scd_store.adapters.vllm as vllm_adapter

    called = {name for path in Path(vllm_adapter.__file__).parent.glob("*.py")
              for name in re.findall(r"\bservice\.([a-z_]+)\b(?!\.)", path.read_text())}
    called -= {"py", "settings", "hashing", "hash_agreement", "log_once", "kv_service"}  # module names in imports
    assert {"chunk_size", "lookup", "get", "submit_put", "count", "observe", "incidents"} <= called
    raw = RawKVDirectory(tmp_path / "raw", producer="base", chunk_size=8)
    assert sorted(name for name in called if not hasattr(raw, name)) == []
