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
    called -= {"py", "settings", "hashing", "hash_agreement", "log_once", "kv_service", "defaults",
               "engine_facts"}  # modules
    assert {"chunk_size", "lookup", "get", "submit_put", "count", "observe", "incidents"} <= called
    raw = RawKVDirectory(tmp_path / "raw", producer="base", chunk_size=8)
    assert sorted(name for name in called if not hasattr(raw, name)) == []


def test_the_raw_baseline_keeps_its_blobs_in_scd_store_tiers_and_a_bad_one_is_a_miss(tmp_path):
    from scd_store.bench.raw_blobs import TierBlobs

    raw = RawKVDirectory(None, producer="base", chunk_size=8, tiers=[{"kind": "cpu", "max_bytes": "4MiB"}])
    state = correlated_state(8, seed=4)
    hashes = [b"\x03" * 16, b"\x04" * 16]
    try:
        assert raw.submit_put("base", hashes, lambda: [state, state])
        raw._pool.submit(lambda: None).result(10)  # the write worker has run
        assert raw.contains("fine-tune", hashes) == 2 and raw.lookup("fine-tune", hashes).remote_chunks == 0
        assert [s.num_tokens for s in raw.get("fine-tune", hashes)] == [8, 8]
        assert isinstance(raw.blobs, TierBlobs)
        tier = raw.blobs.tiers[0]
        tier.put_now(TierBlobs.keys(hashes[1:])[0], b"not a tensor pack")
        assert len(raw.get("fine-tune", hashes)) == 1  # the bad blob is a miss, the chunks before it are served
    finally:
        raw.close()
    with pytest.raises(ValueError, match="exactly one"):
        RawKVDirectory(tmp_path / "raw", producer="base", tiers=[{"kind": "cpu"}])
