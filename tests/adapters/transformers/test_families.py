"""The common model families, as small random-init models: the keys' rotation read from the model, capture,
own-KV injection, a few calibration steps, and an encode / store / decode round trip through the service."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from scd_store.adapters.transformers import LoadedModel, continue_with_prefix, prefill_capture
from scd_store.adapters.transformers.calibration import CalibrationConfig, distil_decoder, fit_space
from scd_store.adapters.transformers.layout import UnsupportedModel, layout_of
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.codecs.scd.layout import from_features, to_features
from scd_store.codecs.scd.rope import apply_rope
from scd_store.models.user_text import UserText
from scd_store.service import KVService
from scd_store.store.registry import FileRegistry
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier

VOCAB, PREFIX, TAIL = 300, 40, 8
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama(rope: dict | None = None, **extra) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**COMMON, rope_scaling=rope, **extra)


FAMILIES = {
    "llama": lambda: llama(),
    "llama-rope-llama3": lambda: llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-rope-linear": lambda: llama({"rope_type": "linear", "factor": 2.0}),
    "llama-rope-dynamic": lambda: llama({"rope_type": "dynamic", "factor": 2.0}),
    "llama-rope-yarn": lambda: llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16,
                                              max_window_layers=1),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=16),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=32, sliding_window=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=16, sliding_window_pattern=2),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
}


class ByteTokenizer:
    """One id per byte (folded into the vocabulary): enough for calibration windows of a random model."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + b % (VOCAB - 3) for b in text.encode()]}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()


def fine_tune_of(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """The same model with every weight nudged: a stand-in fine-tune."""
    tuned = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02 * p.std().clamp_min(1e-3))
    return tuned


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, VOCAB, (PREFIX + TAIL,), generator=torch.Generator().manual_seed(5))


def test_the_rotation_is_the_models_own(family):
    model = build(family)
    layout = layout_of(model)
    rotary = model.model.rotary_emb
    positions = torch.arange(0, 300, 7)
    keys = torch.randn(1, 2, len(positions), layout.head_dim)
    cos, sin = layout.angles(positions)
    kinds = list(getattr(model.config, "layer_types", None) or ["full_attention"] * layout.num_layers)
    for layer in range(layout.num_layers):
        args = (keys, positions[None]) + ((kinds[layer],) if layout.per_layer_rope else ())
        hf_cos, hf_sin = rotary(*args)
        want = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(keys, keys, hf_cos, hf_sin)[1]
        ours = apply_rope(keys, cos[layer] if layout.per_layer_rope else cos, sin[layer] if layout.per_layer_rope
                          else sin)
        torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
    assert layout.per_layer_rope == (family == "gemma3")
    assert (layout.rope is None) == (family in ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2"))


def test_capture_and_own_kv_injection_equal_the_direct_forward(family, ids):
    model = build(family)
    state, _ = prefill_capture(model, ids[:PREFIX])
    assert state.num_tokens == PREFIX  # every layer keeps the whole prefix, sliding-window ones too
    with torch.no_grad():
        direct = model(input_ids=ids[None]).logits[0, PREFIX:]
    torch.testing.assert_close(continue_with_prefix(model, state, ids[PREFIX:]), direct, atol=2e-4, rtol=1e-4)
    layout = layout_of(model)
    for start in (0, 9):
        part = type(state)(state.keys[:, :, start:], state.values[:, :, start:], start=start)
        back = from_features(to_features(part, layout), layout, start)
        torch.testing.assert_close(back.keys, part.keys, atol=1e-5, rtol=1e-5)


def test_calibrate_store_and_decode_through_the_service(family, tmp_path):
    calibrate_store_and_decode(family, tmp_path, "fixed")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_entropy_coded_space_calibrates_stores_and_decodes_through_the_service(family, tmp_path):
    space = calibrate_store_and_decode(family, tmp_path, "ecsq")
    assert space.ecsq is not None and space.packing == "ans-1"
    assert space.payload_ratio() <= 0.25 + 0.01  # the tables' entropy meets the budget


def test_a_fixed_rate_space_with_range_coded_payloads_calibrates_stores_and_decodes(tmp_path):
    space = calibrate_store_and_decode("llama", tmp_path, "fixed", packing="ans-1")
    assert space.ecsq is None and space.tables is not None and space.packing == "ans-1"
    assert space.payload_ratio() < 0.25


def calibrate_store_and_decode(family: str, tmp_path, quantiser: str, packing: str = ""):
    """Fit a space (``quantiser``) and a decoder on a family's random model; store and decode through the service."""
    producer_model = build(family)
    tokenizer = ByteTokenizer()
    producer = LoadedModel("producer", producer_model, tokenizer, "p-fp")
    consumer = LoadedModel("consumer", fine_tune_of(producer_model), tokenizer, "c-fp")
    (tmp_path / "text.txt").write_text(" ".join(f"word{i % 97} w{i % 13}" for i in range(3000)))
    text = UserText((str(tmp_path / "text.txt"),))
    config = CalibrationConfig(budget=0.25 if quantiser == "ecsq" or packing else 0.5, basis_windows=12,
                               prefix_tokens=32, continuation_tokens=4, distill_windows=3, distill_steps=3,
                               quantiser=quantiser, packing=packing)
    space = fit_space(producer, [text], config, f"{family}-space", progress=False)
    decoder, stats = distil_decoder(producer, consumer, space, text, config, progress=False)
    assert stats["steps"] == 3 and stats["kl_last"] >= 0
    bundle = tmp_path / "bundle"
    save_space(bundle, space, extra={"producer": "producer"})
    save_pair(bundle, decoder)
    store = TieredStore([CpuTier(8 << 20)], FileRegistry(tmp_path / "reg.json"), chunk_size=16)
    service = KVService(store, [bundle], discovery_interval_s=0)
    ids = torch.tensor(tokenizer("word5 w5 word6 w6 word7 w7 word8 w8 word9")["input_ids"][:40])
    produced, _ = prefill_capture(producer_model, ids[:32])
    chunks = [type(produced)(produced.keys[:, :, i:i + 16].contiguous(), produced.values[:, :, i:i + 16].contiguous(),
                             start=i) for i in (0, 16)]
    hashes = [bytes([i]) * 16 for i in range(2)]
    assert service.put("producer", hashes, chunks) == 2
    got = service.get("consumer", hashes)
    assert [s.start for s in got] == [0, 16]
    decoded = type(produced).cat(got)
    codec = service.binding("consumer").codec
    for state, chunk in zip(got, chunks, strict=True):  # the service serves the codec's decode, at its position
        want = codec.decode(codec.encode(chunk))
        assert torch.equal(state.keys, want.keys) and torch.equal(state.values, want.values)
    error = (decoded.keys - produced.keys).norm() / produced.keys.norm()
    assert torch.isfinite(decoded.keys).all() and error < 0.5, f"decoded keys {error:.2f} off the producer's"
    logits = continue_with_prefix(consumer.model, decoded, ids[32:40])
    assert torch.isfinite(logits).all()
    service.close()
    return space


@pytest.mark.parametrize(("config", "match"), [
    (lambda: transformers.DeepseekV3Config(**{**COMMON, "num_hidden_layers": 2}, kv_lora_rank=16, q_lora_rank=16,
                                           n_routed_experts=4, num_experts_per_tok=2), "MLA"),
    (lambda: transformers.JambaConfig(**{**COMMON, "num_hidden_layers": 2}, attn_layer_period=2, attn_layer_offset=1,
                                      num_experts=1), "hybrid"),
    (lambda: transformers.PhiConfig(**COMMON, partial_rotary_factor=0.5), "partial rotary"),
])
def test_mla_hybrid_and_partial_rotary_models_are_refused(config, match):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config())
    with pytest.raises(UnsupportedModel, match=match):
        layout_of(model)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_patch_is_refused_where_keys_are_not_k_proj_alone(family):
    from scd_store.codecs.scd.patch import PatchAligner

    model = build(family)
    with pytest.raises(ValueError, match="REUSE only"):
        PatchAligner.initial(0, "kv", model.model.layers[0].self_attn, 8, 0)
