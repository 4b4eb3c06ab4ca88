"""The GPU tier: blobs verified as they enter, hits handed out as their kept header and a tensor view of the
payload (no host copy) kept for the reader's CUDA stream, eviction by bytes. Runs on a CPU through a host-backed
tier (tests.store.gpu_helpers); the CUDA variants run where CUDA is present."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from scd_store.store.blob import BlobError, BlobMeta, ForeignBlob, SignatureError, UnknownKey, encode_blob
from scd_store.store.keyring import Keyring
from scd_store.store.keys import generation_of, hash_keys
from scd_store.store.records import Space
from scd_store.store.signing import SigningKey
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.base import TierError
from scd_store.store.tiers.cpu import CpuTier
from scd_store.store.tiers.gpu import GpuTier, keep_for_stream
from scd_store.store.verify import verify_entry, verify_held
from tests.conftest import needs_cryptography, with_cryptography
from tests.store.conftest import HASHES, PAYLOADS, SPACE, put_all
from tests.store.gpu_helpers import HostGpuTier, cuda, forbid_host_copies, gpu_tiers
from tests.store.test_signing import replace_file

KEYS = hash_keys("space-a", generation_of("space-fp"), HASHES)
META = BlobMeta("raw", "space-fp", 4)
# None where cryptography is missing: the tests that sign or verify carry needs_cryptography
PRODUCER_KEY, ATTACKER = with_cryptography(lambda: tuple(SigningKey("k1", bytes([n]) * 32, spaces=("*",))
                                                         for n in (1, 3)), (None, None))


def blob(i: int, *, key: str | None = None, signer: SigningKey | None = None, meta: BlobMeta = META) -> bytes:
    return encode_blob(meta, PAYLOADS[i], key=KEYS[i] if key is None else key, signer=signer)


def keyring(tmp_path, *lines: str) -> Keyring:
    """A keyring over ``keys/default.keys`` holding ``lines`` (a rewrite, renamed over the file, is seen at once)."""
    (tmp_path / "keys").mkdir(exist_ok=True)
    replace_file(tmp_path / "keys" / "default.keys", "".join(line + "\n" for line in lines))
    return Keyring(tmp_path / "keys", reload_s=0)


def make_store(registry, tiers, keyring: Keyring | None = None) -> TieredStore:
    return TieredStore(tiers, registry, chunk_size=4, op_timeout_s=2.0, put_timeout_s=5.0, keyring=keyring)


@pytest.fixture(params=gpu_tiers())
def gpu_cls(request):
    return request.param


@pytest.fixture
def gpu_store(registry, gpu_cls):
    st = make_store(registry, [gpu_cls(1 << 20), CpuTier(1 << 20)])
    yield st
    st.close()


@pytest.fixture
def signed_store(tmp_path, registry, gpu_cls):
    ring = keyring(tmp_path, PRODUCER_KEY.line())
    st = make_store(registry, [gpu_cls(1 << 20), CpuTier(1 << 20)], ring)
    yield st
    st.close()


def consumer_of(store: TieredStore):
    return store.consumer("pair-a", "consumer-m", "space-fp")


def count(store: TieredStore, name: str) -> int:
    return store.stats.value(name, tier="gpu", space="space-a")


# ----------------------------------------------------------------- hits: the kept header and a tensor view
def test_a_hit_is_its_verified_header_and_a_tensor_view_of_the_payload(gpu_store, monkeypatch) -> None:
    put_all(gpu_store)
    gpu = gpu_store.tiers[0]
    forbid_host_copies(monkeypatch)
    chunks = consumer_of(gpu_store).get(HASHES)
    assert [c.tier for c in chunks] == ["gpu"] * 6 and all(c.on_device for c in chunks)
    for chunk, payload, key in zip(chunks, PAYLOADS, KEYS, strict=True):
        data = gpu.get_tensor(key)
        assert isinstance(chunk.payload, torch.Tensor) and chunk.payload.device == gpu.device
        assert chunk.payload.dtype == torch.uint8 and chunk.payload.dim() == 1 and chunk.payload.is_contiguous()
        assert chunk.payload.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # a view: no copy
        assert chunk.nbytes == len(payload) and chunk.meta == META and chunk.token_count == 4
    monkeypatch.undo()
    assert [bytes(c.host_payload()) for c in chunks] == PAYLOADS
    assert gpu_store.stats.value("hit_chunks", tier="gpu", pair="pair-a") == 6
    assert gpu_store.stats.value("bytes_read", tier="gpu") == gpu.usage().bytes_used  # whole blobs, as stored


def test_get_now_still_returns_the_blob_bytes(gpu_store) -> None:
    put_all(gpu_store, 2)
    assert gpu_store.tiers[0].get_now(KEYS[1]) == blob(1)
    assert gpu_store.tiers[0].get_many_now([KEYS[0], "absent"]) == [blob(0), None]


# ----------------------------------------------------------------- verification at entry
def test_a_corrupted_blob_never_enters_and_is_counted(gpu_store, caplog) -> None:
    gpu = gpu_store.tiers[0]
    for n, at in enumerate((-20, 5, 25)):  # payload, prefix (format version), header JSON
        bad = bytearray(blob(0))
        bad[at] ^= 0xFF
        with caplog.at_level(logging.WARNING, logger="scd_store.store"):
            gpu.put_now(KEYS[0], bytes(bad))
        assert not gpu.contains_now(KEYS[0]) and count(gpu_store, "corrupt_blobs") == n + 1
    gpu.put_now(KEYS[0], blob(0)[:-1])  # truncated
    gpu.put_now("not-a-store-key", blob(0))  # no space to label it with: counted under the tier only
    assert count(gpu_store, "corrupt_blobs") == 4 and gpu.usage().items == 0
    assert gpu_store.stats.value("corrupt_blobs", tier="gpu") == 5
    assert caplog.text.count("refused a blob") == 1  # every one counted, the first one logged
    assert consumer_of(gpu_store).get(HASHES) == []


@needs_cryptography
def test_a_blob_with_a_bad_signature_never_enters(signed_store, tmp_path) -> None:
    gpu = signed_store.tiers[0]
    gpu.put_now(KEYS[0], blob(0, signer=ATTACKER))  # forged: same key id, another key
    gpu.put_now(KEYS[1], blob(1))  # unsigned, where signatures are required
    gpu.put_now(KEYS[2], encode_blob(META, PAYLOADS[2], key=KEYS[2], signer=SigningKey("k9", bytes([9]) * 32)))
    assert gpu.usage().items == 0 and count(signed_store, "bad_signatures") == 3
    gpu.put_now(KEYS[0], blob(0, signer=PRODUCER_KEY))  # the genuine one enters
    assert gpu.contains_now(KEYS[0]) and gpu.get_blobs_now([KEYS[0]])[0].key_id == "k1"


@needs_cryptography
def test_a_blob_under_another_key_never_enters(signed_store, gpu_store) -> None:
    signed = signed_store.tiers[0]
    signed.put_now(KEYS[1], blob(0, signer=PRODUCER_KEY))  # genuine for KEYS[0]: its signature covers that key
    assert not signed.contains_now(KEYS[1]) and count(signed_store, "bad_signatures") == 1
    plain = gpu_store.tiers[0]  # unsigned: the blob's space fingerprint must be its key's generation
    plain.put_now(KEYS[0], blob(0, meta=BlobMeta("raw", "other-fp", 4)))
    other = hash_keys("space-a", generation_of("other-fp"), HASHES[:1])[0]
    plain.put_now(other, blob(0))  # a space-fp blob under another generation's key
    assert plain.usage().items == 0 and count(gpu_store, "foreign_blobs") == 2


def test_a_promotion_enters_verified_and_is_then_served_as_a_tensor(gpu_store) -> None:
    put_all(gpu_store)
    gpu_store.flush()
    for key in KEYS:
        gpu_store.tiers[0].delete_now(key)
    first = consumer_of(gpu_store).get(HASHES)
    assert [c.tier for c in first] == ["cpu"] * 6 and not any(c.on_device for c in first)
    assert gpu_store.stats.value("promotions", tier="gpu") == 6
    again = consumer_of(gpu_store).get(HASHES)
    assert [c.tier for c in again] == ["gpu"] * 6 and [bytes(c.host_payload()) for c in again] == PAYLOADS


def test_a_gpu_tier_below_the_top_promotes_its_bytes(registry, gpu_cls) -> None:
    with make_store(registry, [CpuTier(1 << 20), gpu_cls(1 << 20)]) as st:
        put_all(st)
        st.flush()
        for key in KEYS:
            st.tiers[0].delete_now(key)
        chunks = consumer_of(st).get(HASHES)
        assert [c.tier for c in chunks] == ["gpu"] * 6 and all(c.on_device for c in chunks)
        assert [st.tiers[0].get_now(k) for k in KEYS] == [blob(i) for i in range(6)]  # read back once, promoted


# ----------------------------------------------------------------- a hit: the kept header against the reader
@needs_cryptography
def test_a_key_rotated_out_ends_what_it_signed_on_the_gpu_tier(signed_store, tmp_path) -> None:
    put_all(signed_store, 2)
    assert len(consumer_of(signed_store).get(HASHES)) == 2
    keyring(tmp_path)  # the key file no longer holds k1
    assert consumer_of(signed_store).get(HASHES) == []
    assert count(signed_store, "bad_signatures") >= 1
    assert not signed_store.tiers[0].contains_now(KEYS[0])  # this process's memory: deleted


@needs_cryptography
def test_verify_held_checks_the_readers_space_on_the_kept_header(tmp_path) -> None:
    verify_held(META, "", SPACE, None)
    with pytest.raises(ForeignBlob):
        verify_held(BlobMeta("raw", "other-fp", 4), "", SPACE, None)
    with pytest.raises(BlobError):
        verify_held(BlobMeta("raw", "space-fp", 5), "", SPACE, None)  # past the space's chunk size
    ring = keyring(tmp_path, PRODUCER_KEY.line())
    verify_held(META, "k1", SPACE, ring)
    with pytest.raises(SignatureError):
        verify_held(META, "", SPACE, ring)
    with pytest.raises(UnknownKey):
        verify_held(META, "k2", SPACE, ring)
    with pytest.raises(BlobError, match="no token"):
        verify_entry(KEYS[0], blob(0, meta=BlobMeta("raw", "space-fp", 0)), None)
    other_space = Space("space-a", "producer-m", "prod-fp", "other-fp", chunk_size=4)
    with pytest.raises(ForeignBlob):
        verify_held(META, "", other_space, None)


# ----------------------------------------------------------------- eviction by bytes
def test_eviction_bookkeeping(registry, gpu_cls) -> None:
    size = len(blob(5))  # the largest of the six
    with make_store(registry, [gpu_cls(2 * size + 10)]) as st:
        gpu = st.tiers[0]
        put_all(st, 3)
        assert gpu.contains_many_now(KEYS[:3]) == [False, True, True]
        assert st.stats.value("evictions", tier="gpu", space="space-a") == 1
        assert gpu.get_blobs_now(KEYS[:1]) == [None] and gpu.get_tensor(KEYS[0]) is None
        held = gpu.get_blobs_now(KEYS[1:3])
        assert gpu.usage().items == 2 and gpu.usage().bytes_used == sum(h.nbytes for h in held)
        gpu.put_now(KEYS[2], blob(2))  # again: replaced, not counted twice
        assert gpu.usage().bytes_used == sum(h.nbytes for h in held)
        assert gpu.delete_now(KEYS[1]) and gpu.usage().bytes_used == held[1].nbytes
        big = encode_blob(META, b"x" * (3 * size), key=KEYS[4])
        gpu.put_now(KEYS[4], big)  # larger than the whole tier: refused, nothing flushed
        assert gpu.rejected_too_large == 1 and gpu.contains_now(KEYS[2])
        assert [c.tier for c in consumer_of(st).get(HASHES[2:3])] == ["gpu"]


# ----------------------------------------------------------------- payloads kept for the reader's stream
class WatchedTier(HostGpuTier):
    """A host-backed tier noting each tensor it keeps for a reader: (storage pointer, the reader's thread)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.kept: list[tuple[int, str]] = []

    def _keep(self, tensor: torch.Tensor) -> None:
        self.kept.append((tensor.untyped_storage().data_ptr(), threading.current_thread().name))


def test_every_gpu_tier_payload_handed_out_is_kept_for_the_readers_stream(registry) -> None:
    with make_store(registry, [WatchedTier(1 << 20)]) as st:
        put_all(st)
        chunks: list = []
        reader = threading.Thread(target=lambda: chunks.extend(consumer_of(st).get(HASHES)), name="reader")
        reader.start()
        reader.join()
        assert [c.tier for c in chunks] == ["gpu"] * 6
        assert st.tiers[0].kept == [(c.payload.untyped_storage().data_ptr(), "reader") for c in chunks]
        data = st.tiers[0].get_tensor(KEYS[0])
        assert st.tiers[0].kept[-1] == (data.untyped_storage().data_ptr(), "MainThread")


def test_keep_for_stream_records_a_cuda_tensor_on_the_current_stream(monkeypatch) -> None:
    class Payload:  # a CUDA tensor's face, on a CPU
        device = torch.device("cuda", 0)

        def __init__(self) -> None:
            self.streams: list[str] = []

        def record_stream(self, stream: str) -> None:
            self.streams.append(stream)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"current on {device}")
    payload = Payload()
    keep_for_stream(payload)  # type: ignore[arg-type]
    keep_for_stream(payload, "decode stream")  # type: ignore[arg-type]
    assert payload.streams == ["current on cuda:0", "decode stream"]
    keep_for_stream(torch.zeros(3))  # host memory: nothing to keep


@cuda
def test_a_gpu_tier_payload_outlives_eviction_and_reupload_while_a_reader_stream_reads_it(registry) -> None:
    """A reader's stream still reading a hit (a long kernel first) when the blob is evicted and two blobs of its
    size are uploaded: the caching allocator does not hand the hit's memory to either upload."""
    size = 1 << 16
    blobs = [encode_blob(META, bytes([n]) * size, key=KEYS[n]) for n in range(3)]
    with make_store(registry, [GpuTier(len(blobs[0]) + 16)]) as st:
        gpu = st.tiers[0]
        gpu.put_now(KEYS[0], blobs[0])
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            chunks = consumer_of(st).get(HASHES[:1])
            assert [c.tier for c in chunks] == ["gpu"]
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the read
            seen = chunks[0].payload.clone()
        del chunks  # the reader's last reference: the memory is freed with the read still queued
        gpu.put_now(KEYS[1], blobs[1])  # evicts blob 0
        gpu.put_now(KEYS[2], blobs[2])  # evicts blob 1; without record_stream it could take blob 0's memory
        assert gpu.contains_many_now(KEYS[:3]) == [False, False, True]
        reader.synchronize()
        assert bool((seen == 0).all()), "the hit was overwritten by a later upload before its reader read it"


# ----------------------------------------------------------------- construction
@cuda
def test_the_gpu_tier_refuses_a_device_that_is_not_cuda() -> None:
    with pytest.raises(TierError, match="CUDA device"):
        GpuTier(1024, device="cpu")


def test_gpu_tier_refuses_to_start_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(TierError, match="CUDA"):
        GpuTier(max_bytes=1024)
    assert HostGpuTier(1024).device.type == "cpu"  # the tests' host-backed tier only
