"""``scd-store bench ttft``: disaggregated time to first token, against the consumer's own prefill.

The producer prefills each shared prefix once (not timed: it is paid once for every consumer).
A consumer answering a request of ``suffix_tokens`` new tokens on top of the prefix then either

- prefills prefix + suffix itself (``own``: logits for the last token only, as a server does), or
- fetches the prefix's payload, decodes it into its KV and prefills only the suffix:
  ``ttft = bytes / link + transfer overhead + store get + decode + suffix prefill``.

All compute is measured in this run on this machine (medians of ``repeats``); the link is modelled
at 1, 10 and 100 Gbit/s; the per-transfer overhead is measured: the median NIXL read of one small
blob from a second process (in-process copy when NIXL is absent). ``store get`` is a CPU-tier get
(checksummed) of the payload cut into chunk-sized blobs. Methods: ``raw`` (fp16), ``int4``,
``scd`` (a calibrated bundle) and ``droidspeak`` (a 6-layer recompute group; its decode runs those
layers of the consumer over the prefix).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.droidspeak import DroidSpeakCodec, LayerGroup
from scd_store.adapters.transformers.inject import build_cache
from scd_store.adapters.transformers.loading import load_model
from scd_store.bench.decode import timed_median
from scd_store.codecs.base import Codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.registry import make_codec
from scd_store.models import catalog
from scd_store.models.windows import eval_windows
from scd_store.store.keys import chunk_hashes
from scd_store.store.registry import FileRegistry, Pair, Space
from scd_store.store.tiered import TieredStore
from scd_store.store.tiers.cpu import CpuTier

LINKS_GBIT = (1.0, 10.0, 100.0)


@dataclass(frozen=True, slots=True)
class TtftConfig:
    consumer: str = "smollm2-135m-shakespeare"
    prefix_tokens: tuple[int, ...] = (512, 1024, 2048)
    suffix_tokens: int = 32
    links_gbit: tuple[float, ...] = LINKS_GBIT
    bundle: str | None = None
    droidspeak_group: tuple[int, int] = (18, 24)
    repeats: int = 3
    chunk_tokens: int = 256
    seed: int = 0
    methods: tuple[str, ...] = field(default=("raw", "int4", "scd", "droidspeak"))

    def __post_init__(self) -> None:
        if not self.prefix_tokens or min(self.prefix_tokens) < 16 or self.suffix_tokens <= 0:
            raise ValueError("prefixes must be >= 16 tokens and suffix_tokens positive")
        if self.repeats <= 0 or not self.links_gbit or min(self.links_gbit) <= 0:
            raise ValueError("repeats and link speeds must be positive")
        unknown = set(self.methods) - {"raw", "int4", "scd", "droidspeak"}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}")
        if "scd" in self.methods and not self.bundle:
            raise ValueError("the scd method needs --bundle (a calibration bundle for the consumer)")


@torch.no_grad()
def first_token(model: torch.nn.Module, state: KVState | None, ids: torch.Tensor) -> int:
    """Prefill ``ids`` after the prefix in ``state`` (None: no prefix), logits for the last token only."""
    kwargs = {cache_kwarg(model): build_cache(model, state), "use_cache": True} if state is not None else {}
    logits = model(input_ids=ids[None], logits_to_keep=1, **kwargs).logits
    return int(logits[0, -1].argmax())


def transfer_overhead_s(repeats: int = 20) -> tuple[float, str]:
    """Median time of one small blob read from a second process (NIXL), or an in-process copy."""
    from scd_store.store.transfer import make_reader, nixl_available

    if nixl_available():
        from scd_store.bench.transfer import SourceProcess

        with SourceProcess("nixl") as source:
            reader = make_reader(kind="nixl")
            name = reader.connect(source.info)
            refs = source.refs[:1]
            seconds = timed_median(lambda: reader.read(name, refs), repeats, "cpu")
            reader.close()
            return seconds, "nixl"
    from scd_store.store.transfer import make_source

    with make_source(1 << 20, kind="copy") as src, make_reader(kind="copy") as reader:
        refs = src.publish({"b": b"\0" * (64 << 10)})
        name = reader.connect(src.info())
        return timed_median(lambda: reader.read(name, refs), repeats, "cpu"), "copy"


def store_get_s(payload: bytes, chunk_blobs: int, repeats: int) -> float:
    """A CPU-tier get of ``payload`` cut into ``chunk_blobs`` blobs (checksums verified)."""
    with tempfile.TemporaryDirectory() as tmp:
        registry = FileRegistry(Path(tmp) / "registry.json")
        registry.register_space(Space("ttft", "p", "p-fp", "ttft-fp", codec_id="bench", chunk_size=1))
        registry.register_pair(Pair("ttft-pair", "ttft", "c", "c-fp", "pair-fp", "ttft-fp"))
        store = TieredStore([CpuTier(4 * len(payload) + (64 << 20))], registry, chunk_size=1)
        try:
            n = max(1, chunk_blobs)
            step = -(-len(payload) // n)
            parts = [payload[i * step:(i + 1) * step] for i in range(n)]
            hashes = chunk_hashes(list(range(n)), 1)
            store.producer("ttft", "p", "ttft-fp").put(hashes, parts, [1] * n, codec_id="bench")
            view = store.consumer("ttft-pair", "c", "ttft-fp")
            return timed_median(lambda: view.get(hashes), repeats, "cpu")
        finally:
            store.close()


def _codecs(config: TtftConfig, producer, consumer) -> dict[str, Codec]:
    codecs: dict[str, Codec] = {}
    for name in config.methods:
        if name in ("raw", "int4"):
            codecs[name] = make_codec(name)
        elif name == "scd":
            from scd_store.bench.quality import load_scd_codec

            codecs[name] = load_scd_codec(Path(config.bundle), producer, consumer)
        else:
            codecs[name] = DroidSpeakCodec(consumer.model, LayerGroup(*config.droidspeak_group))
    return codecs


def _prefix_ids(consumer, config: TtftConfig, length: int) -> torch.Tensor:
    spec = catalog.consumer(config.consumer)
    try:
        return eval_windows(consumer.tokenizer, spec.corpus, 1, length, config.seed)[0]
    except ValueError:  # no held-out window that long: random ids time the same
        return torch.randint(0, consumer.model.config.vocab_size, (length,),
                             generator=torch.Generator().manual_seed(config.seed))


MODELLED = ("a what-if: decode, suffix prefill and store get are measured in this process; the fetch over each "
            "link is modelled from the payload size (bytes / bandwidth). Measured client-side TTFT against real "
            "vLLM servers: scd-store bench serve")


@torch.no_grad()
def run_ttft(config: TtftConfig, progress: bool = True) -> dict[str, Any]:
    """Per prefix length and method: measured parts, modelled fetch, TTFT and speed-up per link."""
    producer, consumer = load_model(catalog.PRODUCER), load_model(config.consumer)
    codecs = _codecs(config, producer, consumer)
    overhead, transport = transfer_overhead_s()
    report: dict[str, Any] = {"kind": "modelled", "what": MODELLED,
                              "consumer": config.consumer, "suffix_tokens": config.suffix_tokens,
                              "links_gbit": list(config.links_gbit), "transfer": transport,
                              "transfer_overhead_ms": round(overhead * 1e3, 3), "threads": torch.get_num_threads(),
                              "repeats": config.repeats, "prefixes": []}
    for length in config.prefix_tokens:
        ids = _prefix_ids(consumer, config, length + config.suffix_tokens)
        prefix, suffix = ids[:length], ids[length:]
        own_s = timed_median(lambda ids=ids: first_token(consumer.model, None, ids), config.repeats, "cpu")
        hidden = sorted(getattr(getattr(codecs.get("scd"), "space", None), "patch_layers", ()) or ())
        residual = [config.droidspeak_group[0]] if "droidspeak" in codecs else []
        produced, _ = prefill_capture(producer.model, prefix, hidden_layers=hidden, residual_layers=residual)
        entry: dict[str, Any] = {"prefix_tokens": length, "own_prefill_ms": round(own_s * 1e3, 2), "methods": {}}
        for name, codec in codecs.items():
            payload = codec.encode(produced)
            decode_s = timed_median(lambda c=codec, p=payload: c.decode(p), config.repeats, "cpu")
            state = codec.decode(payload)
            suffix_s = timed_median(lambda s=state, x=suffix: first_token(consumer.model, s, x), config.repeats, "cpu")
            get_s = store_get_s(payload, -(-length // config.chunk_tokens), config.repeats)
            compute = decode_s + suffix_s + get_s + overhead
            per_link = {}
            for gbit in config.links_gbit:
                fetch = len(payload) * 8 / (gbit * 1e9)
                ttft = fetch + compute
                per_link[f"{gbit:g}"] = {"fetch_ms": round(fetch * 1e3, 3), "ttft_ms": round(ttft * 1e3, 2),
                                         "speedup": round(own_s / ttft, 3)}
            entry["methods"][name] = {
                "payload_bytes": len(payload), "payload_ratio": round(len(payload) / produced.fp16_bytes(), 4),
                "decode_ms": round(decode_s * 1e3, 2), "suffix_prefill_ms": round(suffix_s * 1e3, 2),
                "store_get_ms": round(get_s * 1e3, 3), "links": per_link}
        report["prefixes"].append(entry)
        if progress:
            best = {n: m["links"][f"{config.links_gbit[len(config.links_gbit) // 2]:g}"]["speedup"]
                    for n, m in entry["methods"].items()}
            print(f"prefix {length}: own prefill {entry['own_prefill_ms']} ms; speed-up at the middle link {best}",
                  flush=True)
    return report


def plot_ttft(report: dict[str, Any], png: Path) -> None:
    """Speed-up over own prefill vs link bandwidth, one panel per prefix length, one line per method."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("the TTFT plot needs matplotlib: pip install 'scd-store[plots]'",
                                  name="matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = report["prefixes"]
    fig, axes = plt.subplots(1, len(prefixes), figsize=(4.2 * len(prefixes), 3.6), squeeze=False)
    links = report["links_gbit"]
    for ax, entry in zip(axes[0], prefixes, strict=True):
        for name, method in entry["methods"].items():
            ax.plot(links, [method["links"][f"{g:g}"]["speedup"] for g in links], marker="o",
                    label=f"{name} ({method['payload_ratio']:.0%})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_title(f"{entry['prefix_tokens']}-token prefix (own prefill {entry['own_prefill_ms']:.0f} ms)",
                     fontsize=9)
        ax.set_xlabel("link (Gbit/s)")
        ax.set_ylabel("TTFT speed-up vs own prefill")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['consumer']}: disaggregated TTFT (+{report['suffix_tokens']} new tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
