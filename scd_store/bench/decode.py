"""``scd-store bench decode``: time to turn a prefix's SCD codes into a consumer's full KV, against
the consumer's own prefill of the same tokens, measured side by side in one run.

Prefill and decode are interleaved (each round: one prefill, then ``decodes_per_round`` decodes),
so both see the same machine. ``decode_vs_prefill`` is the ratio of the best times (other
processes only ever add time, and they add proportionally more to a 30 ms decode than to a
1.3 s prefill, which averages them in); ``decode_vs_prefill_median`` is the ratio of the medians.

Runs on the real prepared pair and bundle when given, else on a random-init model of the
producer's architecture with a code space fitted to its own KV (speed does not depend on weights), once,
on the first prefix length, and reused for the others (as a calibrated space is: one fit, every length;
Llama-3-8B's geometry is 64 eigendecompositions of 1024 x 1024 on the host, ``fit_s``).
Beside the plain decode (fresh output tensors) the same rounds time ``decode_into`` (into one
preallocated destination, as an engine's KV buffers are: a long prefix's fresh output pages cost
more than its maths on a CPU) and, where the decode's products run in bf16, ``decode_fp32_products``.
On CUDA the timed decode reads the payload from device memory (a GPU tier hit) and replays CUDA
graphs; ``decode_from_host_best_ms`` (bytes in host memory), ``decode_eager_best_ms`` (no
graphs) and ``decode_fused_best_ms`` (the opt-in fused Triton kernel) are reported beside it, with
``fused_kernel``: ``"triton"`` where the kernel ran, ``"fallback: ..."`` where it did not build or run and the
codec fell back to the PyTorch decode (then ``decode_fused_best_ms`` times that), ``"unavailable: ..."``
where it was never tried; the report's ``fused_kernel`` sums up the rows (``"not timed"`` off CUDA).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.layout import layout_of
from scd_store.bench.geometries import DEFAULT_GEOMETRY, GEOMETRIES, geometry
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd import codec as codec_module
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.ecsq import fit
from scd_store.codecs.scd.fused import available as fused_available
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.range_coding import PACKING as ENTROPY_PACKING
from scd_store.codecs.scd.space import CodeSpace


@dataclass(frozen=True, slots=True)
class DecodeBenchConfig:
    prefix_tokens: tuple[int, ...] = (448, 2048)
    budget: float = 0.25
    repeats: int = 5  # rounds: one prefill and decodes_per_round decodes each
    decodes_per_round: int = 5
    device: str = "cpu"
    dtype: str = "float32"
    geometry: str = DEFAULT_GEOMETRY  # the random-init model's (scd_store.bench.geometries); unused with a consumer
    quantiser: str = "fixed"  # the random-init space's: "fixed" or "ecsq" (range-coded payloads); a bundle says its own

    def __post_init__(self) -> None:
        if not self.prefix_tokens or min(self.prefix_tokens) <= 8 or min(self.repeats, self.decodes_per_round) <= 0:
            raise ValueError("prefix lengths must be > 8; repeats and decodes_per_round positive")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype}")
        if self.quantiser not in ("fixed", "ecsq"):
            raise ValueError(f"quantiser must be fixed or ecsq, not {self.quantiser!r}")
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be one of {sorted(GEOMETRIES)}, not {self.geometry!r}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    """Wall time of one call of ``fn`` in seconds, synchronising CUDA."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def timed_median(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median wall time of ``fn`` in seconds (after one warm-up), synchronising CUDA."""
    fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def side_by_side(prefill: Callable[[], object], decode: Callable[[], object], rounds: int, decodes_per_round: int,
                 device: str, others: dict[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
    """Interleaved timings (seconds) after one warm-up of each: per round one prefill, then
    ``decodes_per_round`` decodes (and as many of each of ``others``, alternating with them)."""
    decoders = {"decode": decode, **(others or {})}
    prefill()
    for fn in decoders.values():
        fn()
    times: dict[str, list[float]] = {"prefill": [], **{name: [] for name in decoders}}
    for _ in range(rounds):
        times["prefill"].append(timed(prefill, device))
        for _ in range(decodes_per_round):
            for name, fn in decoders.items():
                times[name].append(timed(fn, device))
    return times


def random_model(device: str, dtype: torch.dtype, seed: int = 0, name: str = DEFAULT_GEOMETRY) -> LlamaForCausalLM:
    """A random-init model of geometry ``name``, built on ``device`` in ``dtype`` (Llama-3-8B in bf16 on
    a GPU: 16 GB there, never a 32 GB fp32 copy on the host first)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**geometry(name))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def space_fitted_to(state: KVState, layout: KVLayout, budget: float, space_id: str = "bench",
                    quantiser: str = "fixed") -> CodeSpace:
    """A code space fitted to ``state``'s own features past the sinks (a stand-in for a calibrated one:
    encode and decode speed depend on the geometry and the budget, not on the weights); ``"ecsq"``: with
    entropy-coded quantisers fitted to the same features."""
    features = to_features(state.to(dtype=torch.float32), layout)[4:]
    x = features.double().transpose(0, 1)  # on the state's device
    mean = x.mean(1)
    centred = x - mean[:, None]
    cov = torch.einsum("gtc,gtd->gcd", centred, centred) / x.shape[1]
    space = CodeSpace.from_statistics(space_id, layout, mean.cpu(), cov.cpu(), budget)
    if quantiser == "ecsq":
        z = space.project(features.cpu()).flatten(1)
        space = space.with_ecsq(fit(z, space.sigma.flatten(), torch.ones(z.shape[1]), budget * 16))
    return space


def self_fitted_space(model: LlamaForCausalLM, ids: torch.Tensor, budget: float, quantiser: str = "fixed"
                      ) -> CodeSpace:
    """A code space fitted to ``model``'s own KV on ``ids``."""
    state, _ = prefill_capture(model, ids)
    return space_fitted_to(state, layout_of(model), budget, quantiser=quantiser)


class _KernelWarnings(logging.Handler):
    """The codec's warnings that the fused kernel fell back to the PyTorch decode (and why)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "kernel unavailable" in record.getMessage():
            self.messages.append(record.getMessage())


def fused_kernel_state(codec: ScdCodec, device: str, warnings: list[str]) -> str:
    """Which decode ``codec`` (made with ``fused_kernel=True``) ran: ``"triton"`` (the fused kernel),
    ``"fallback: WHY"`` (the kernel raised; the codec went on with the PyTorch decode) or
    ``"unavailable: WHY"`` (never tried)."""
    head_dim = codec.space.layout.head_dim
    if not codec.reuse_only:
        return "unavailable: a PATCH space (the kernel decodes REUSE spaces only)"
    if not fused_available(device, head_dim):
        return (f"unavailable: needs CUDA (or Triton's interpreter), Triton installed and heads of a power of two "
                f"from 32 (here {head_dim})")
    if codec.fused_kernel:
        return "triton"
    return "fallback: " + (warnings[0] if warnings else "the kernel did not run")[:300]


def _cuda_variants(codec: ScdCodec, payload: bytes, source: torch.Tensor, config: DecodeBenchConfig,
                   dtype: torch.dtype, tokens: int) -> dict:
    """Best times (ms) of the decode from host bytes (the payload copied in first), without CUDA
    graphs, and with the opt-in fused Triton kernel (graphs on), and which decode that last one ran
    (``fused_kernel``); a variant that raises is reported as ``<variant>_error`` instead of ending the run."""
    eager = ScdCodec(codec.space, codec.decoder, cuda_graphs=False)
    fused = ScdCodec(codec.space, codec.decoder, fused_kernel=True)
    if fused.graphs is not None:
        fused.graphs.warm_up(config.device, dtype, [tokens], starts=[0])
    runs = config.repeats * config.decodes_per_round
    variants = {"decode_from_host_best_ms": lambda: codec.decode(payload, device=config.device, dtype=dtype),
                "decode_eager_best_ms": lambda: eager.decode(source, device=config.device, dtype=dtype),
                "decode_fused_best_ms": lambda: fused.decode(source, device=config.device, dtype=dtype)}
    out: dict = {}
    warnings = _KernelWarnings()
    codec_module.log.addHandler(warnings)
    try:
        for name, fn in variants.items():
            try:
                fn(), fn()
                out[name] = round(min(timed(fn, config.device) for _ in range(runs)) * 1e3, 3)
            except (RuntimeError, ValueError) as exc:  # one variant failing (e.g. the fused kernel) keeps the others
                out[name.replace("_best_ms", "_error")] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        codec_module.log.removeHandler(warnings)
    out["fused_kernel"] = fused_kernel_state(fused, config.device, warnings.messages)
    out["graph_replays"] = codec.graphs.replays if codec.graphs is not None else 0
    return out


def kernels_summary(results: list[dict], on_cuda: bool) -> str:
    """The report's ``fused_kernel``: the rows' one state, or each distinct one joined by " | "."""
    if not on_cuda:
        return "not timed (the fused variant is timed on CUDA only)"
    states = list(dict.fromkeys(row.get("fused_kernel", "not timed") for row in results))
    return " | ".join(states)


@torch.no_grad()
def run_decode_bench(config: DecodeBenchConfig, codec: ScdCodec | None = None,
                     consumer: torch.nn.Module | None = None) -> dict:
    """Per prefix length: encode, decode and prefill times (medians and bests) and ``decode_vs_prefill``."""
    dtype = getattr(torch, config.dtype)
    model = consumer if consumer is not None else random_model(config.device, dtype, name=config.geometry)
    generator = torch.Generator().manual_seed(0)
    on_cuda = torch.device(config.device).type == "cuda"
    results = []
    fitted, fit_s = None, 0.0
    for length in config.prefix_tokens:
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator).to(config.device)
        if codec is None:
            if fitted is None:  # once, on the first length's own KV: speed depends on the geometry, not the fit
                fit_start = time.perf_counter()
                fitted = self_fitted_space(model, ids, config.budget, config.quantiser)
                fit_s = time.perf_counter() - fit_start
            bench_codec = ScdCodec(fitted, PairDecoder.identity(fitted, "bench"))
        else:
            bench_codec = codec
        # speed does not depend on whose KV is coded: the timed model's own state stands in for the producer's
        state, _ = prefill_capture(model, ids, hidden_layers=bench_codec.space.patch_layers)
        payload = bench_codec.encode(state.to(dtype=torch.float32))
        if on_cuda and bench_codec.graphs is not None:  # captured before timing, never while decoding
            bench_codec.graphs.warm_up(config.device, dtype, [length], starts=[0])
        # the consumer's own prefill as a server runs it: logits for the last token only
        # on an accelerator the codes come from its GPU tier: a device tensor, no host copy
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(config.device) if on_cuda else payload
        # an engine decodes into its own KV buffers: one preallocated destination, reused (no fresh pages)
        shape = (state.num_layers, state.num_kv_heads, state.num_tokens, state.head_dim)
        into = tuple(torch.empty(shape, device=config.device, dtype=dtype) for _ in range(2))
        others = {"into": lambda p=source, c=bench_codec, o=into: c.decode_into(p, *o)}
        space = bench_codec.space
        if space.coder is not None:  # the same codes in the other payload format, interleaved
            other = "planes-2" if space.packing == ENTROPY_PACKING else ENTROPY_PACKING
            twin = ScdCodec(space.with_packing(other), bench_codec.decoder)
            twin_payload = twin.encode(state.to(dtype=torch.float32))
            twin_source = torch.frombuffer(bytearray(twin_payload), dtype=torch.uint8).to(config.device) \
                if on_cuda else twin_payload
            others[other] = lambda p=twin_source, c=twin: c.decode(p, device=config.device, dtype=dtype)
        if not on_cuda and bench_codec.product_dtype(config.device) != torch.float32:
            # the same decode with fp32 products, interleaved: what the low-precision products buy
            fp32 = ScdCodec(bench_codec.space, bench_codec.decoder, matmul="float32")
            others["fp32"] = lambda p=source, c=fp32: c.decode(p, device=config.device, dtype=dtype)
        times = side_by_side(lambda ids=ids: prefill_capture(model, ids, last_logits_only=True),
                             lambda p=source, c=bench_codec: c.decode(p, device=config.device, dtype=dtype),
                             config.repeats, config.decodes_per_round, config.device, others)
        prefill, decode = times["prefill"], times["decode"]
        extra = {"decode_into_best_ms": round(min(times["into"]) * 1e3, 3),
                 "decode_into_vs_prefill": round(min(times["into"]) / min(prefill), 4)}
        for fmt in ("planes-2", ENTROPY_PACKING):
            if fmt in times:
                extra.update({f"decode_{fmt}_best_ms": round(min(times[fmt]) * 1e3, 3),
                              f"decode_{fmt}_vs_prefill": round(min(times[fmt]) / min(prefill), 4),
                              f"payload_{fmt}_ratio": round(len(twin_payload) / state.fp16_bytes(), 4)})
        if "fp32" in times:
            extra.update({"decode_fp32_products_best_ms": round(min(times["fp32"]) * 1e3, 3),
                          "decode_fp32_products_vs_prefill": round(min(times["fp32"]) / min(prefill), 4)})
        encode_s = timed_median(lambda s=state, c=bench_codec: c.encode(s), config.repeats, config.device)
        if on_cuda:
            extra.update(_cuda_variants(bench_codec, payload, source, config, dtype, length))
        results.append({
            "prefix_tokens": length,
            "payload_bytes": len(payload),
            "payload_ratio": round(len(payload) / state.fp16_bytes(), 4),
            "packing": bench_codec.space.packing,
            "prefill_ms": round(statistics.median(prefill) * 1e3, 3),
            "decode_ms": round(statistics.median(decode) * 1e3, 3),
            "prefill_best_ms": round(min(prefill) * 1e3, 3),
            "decode_best_ms": round(min(decode) * 1e3, 3),
            "encode_ms": round(encode_s * 1e3, 3),
            "decode_vs_prefill": round(min(decode) / min(prefill), 4),
            "decode_vs_prefill_median": round(statistics.median(decode) / statistics.median(prefill), 4),
            **extra,
        })
    return {"device": config.device, "dtype": config.dtype, "budget": config.budget,
            "products": str(bench_codec.product_dtype(config.device)).removeprefix("torch."),
            "payload_on": "device" if on_cuda else "host",
            "model": "real" if consumer is not None else f"random-init {GEOMETRIES[config.geometry][0]} geometry",
            "geometry": "real" if consumer is not None else config.geometry,
            "fit_s": round(fit_s, 3), "fused_kernel": kernels_summary(results, on_cuda),
            "threads": torch.get_num_threads(), "rounds": config.repeats, "decodes_per_round": config.decodes_per_round,
            "results": results}
