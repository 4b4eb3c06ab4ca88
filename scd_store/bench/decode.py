"""``scd-store bench decode``: time to turn a prefix's SCD codes into a consumer's full KV, against
the consumer's own prefill of the same tokens, measured side by side in one run.

Runs on the real prepared pair and bundle when given, else on a random-init model of the
producer's architecture with a code space fitted to its own KV (speed does not depend on weights).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scd_store.adapters.transformers.calibrate import layout_of
from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import to_features
from scd_store.codecs.scd.space import CodeSpace

# SmolLM2-135M's geometry, for random-init timing runs
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)


@dataclass(frozen=True, slots=True)
class DecodeBenchConfig:
    prefix_tokens: tuple[int, ...] = (448, 2048)
    budget: float = 0.25
    repeats: int = 5
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.prefix_tokens or min(self.prefix_tokens) <= 8 or self.repeats <= 0:
            raise ValueError("prefix lengths must be > 8 and repeats positive")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype}")


def timed_median(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median wall time of ``fn`` in seconds (after one warm-up), synchronising CUDA."""
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_model(device: str, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype).eval()


def self_fitted_space(model: LlamaForCausalLM, ids: torch.Tensor, budget: float) -> CodeSpace:
    """A code space fitted to ``model``'s own KV on ``ids`` (a stand-in for a calibrated one)."""
    layout = layout_of(model)
    state, _ = prefill_capture(model, ids)
    x = to_features(state.to("cpu", torch.float32), layout)[4:].double().transpose(0, 1)
    mean = x.mean(1)
    cov = torch.einsum("gtc,gtd->gcd", x - mean[:, None], x - mean[:, None]) / x.shape[1]
    return CodeSpace.from_statistics("bench", layout, mean, cov, budget)


@torch.no_grad()
def run_decode_bench(config: DecodeBenchConfig, codec: ScdCodec | None = None,
                     consumer: torch.nn.Module | None = None) -> dict:
    """Per prefix length: encode, decode and prefill medians and ``decode_vs_prefill``."""
    dtype = getattr(torch, config.dtype)
    model = consumer if consumer is not None else random_model(config.device, dtype)
    generator = torch.Generator().manual_seed(0)
    results = []
    for length in config.prefix_tokens:
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator).to(config.device)
        if codec is None:
            space = self_fitted_space(model, ids, config.budget)
            bench_codec = ScdCodec(space, PairDecoder.identity(space, "bench"))
        else:
            bench_codec = codec
        # speed does not depend on whose KV is coded: the timed model's own state stands in for the producer's
        state, _ = prefill_capture(model, ids, hidden_layers=bench_codec.space.patch_layers)
        payload = bench_codec.encode(state.to(dtype=torch.float32))
        # the consumer's own prefill as a server runs it: logits for the last token only
        prefill_s = timed_median(lambda ids=ids: prefill_capture(model, ids, last_logits_only=True), config.repeats,
                           config.device)
        decode_s = timed_median(lambda p=payload, c=bench_codec: c.decode(p, device=config.device, dtype=dtype),
                          config.repeats, config.device)
        encode_s = timed_median(lambda s=state, c=bench_codec: c.encode(s), config.repeats, config.device)
        results.append({
            "prefix_tokens": length,
            "payload_bytes": len(payload),
            "payload_ratio": round(len(payload) / state.fp16_bytes(), 4),
            "prefill_ms": round(prefill_s * 1e3, 3),
            "decode_ms": round(decode_s * 1e3, 3),
            "encode_ms": round(encode_s * 1e3, 3),
            "decode_vs_prefill": round(decode_s / prefill_s, 4),
        })
    return {"device": config.device, "dtype": config.dtype, "budget": config.budget,
            "model": "real" if consumer is not None else "random-init SmolLM2-135M geometry",
            "threads": torch.get_num_threads(), "results": results}
