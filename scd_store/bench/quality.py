"""``scd-store bench quality``: how well a consumer continues from each method's prefix KV.

For every held-out window of ``prefix + continuation + 1`` tokens the producer prefills the
prefix once; each method turns that (or the consumer's own prefill, for ``oracle``) into the
consumer's prefix KV; the consumer then runs the continuation on top of it and is scored against
the oracle (its own prefill) and the true next tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from scd_store.adapters.transformers import LoadedModel, continue_with_prefix, load_model, prefill_capture
from scd_store.adapters.transformers.droidspeak import DroidSpeakCodec, select_group
from scd_store.adapters.transformers.layout import layout_of
from scd_store.bench.anchor_map import SUFFIX as MAP_SUFFIX
from scd_store.bench.anchor_map import MappedAnchor
from scd_store.bench.metrics import ContinuationScore
from scd_store.bench.pareto import plot_pareto
from scd_store.bench.quality_intervals import method_intervals, paired_difference
from scd_store.codecs import make_codec
from scd_store.codecs.kvquant import KVQuantLiteCodec
from scd_store.codecs.scd.bundle import load_pair, load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.models import catalog
from scd_store.models.sources import ModelSource, resolve
from scd_store.models.user_text import UserText
from scd_store.models.windows import Corpus, corpus_name, eval_windows

BASELINE_METHODS = ("oracle", "none", "raw", "int8", "int4", "int2", "droidspeak")
EXTRA_METHODS = ("rot1", "rot2", "rot3", "rot4", "kvq2")  # measured when named in --methods
SCD_METHOD = "scd"
NO_MAP = "/no-map"  # suffix of a bundle's space decoded without its consumer's map (KVTC-style: no adaptation)
DROIDSPEAK = "droidspeak"


@dataclass(frozen=True, slots=True)
class QualityConfig:
    """What ``bench quality`` measures; ``quick()`` is the short variant used by demos and CI."""

    consumer: str  # a catalog name, checkpoint directory, PEFT adapter directory or NAME=PATH
    producer: str = catalog.PRODUCER
    text: tuple[str, ...] = ()  # held-out evaluation text (files / folders); default: the catalog corpus's eval split
    calib_text: tuple[str, ...] = ()  # text the droidspeak baseline picks its layers on (with ``text``)
    windows: int = 20
    prefix_tokens: int = 448
    continuation_tokens: int = 64
    seed: int = 0
    methods: tuple[str, ...] = BASELINE_METHODS
    device: str = "cpu"
    bundles: tuple[str, ...] = ()  # SCD calibration bundles: each adds an scd method (see scd_method_names)
    no_map: bool = False  # also each bundle's space with no decoder map (the producer's KV through the codes alone)
    anchor_map: str = ""  # a bundle whose map also follows each anchor (``int2+map``...): adaptation held equal
    droidspeak_layers: int = 6  # size of the layer group the droidspeak baseline recomputes
    selection_windows: int = 4  # calibration-split windows that choose the droidspeak group
    selection_stride: int = 1  # candidate group starts tried: every layer, or every n-th

    def __post_init__(self) -> None:
        if self.windows <= 0 or self.prefix_tokens <= 0 or self.continuation_tokens <= 0:
            raise ValueError("windows, prefix_tokens and continuation_tokens must be positive")
        unknown = set(self.methods) - set(BASELINE_METHODS) - set(EXTRA_METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; known: {', '.join(BASELINE_METHODS + EXTRA_METHODS)} "
                             "(scd methods come from --bundle)")
        if "oracle" not in self.methods:
            raise ValueError("the oracle method is required: every metric is relative to it")
        if len(set(self.scd_method_names())) != len(self.bundles):
            raise ValueError("bundles must have distinct directory names")
        if self.anchor_map and not self.anchors():
            raise ValueError("--anchor-map needs an anchor among the methods (raw, int8, int4, int2, rot1..4, kvq2)")
        if min(self.droidspeak_layers, self.selection_windows, self.selection_stride) <= 0:
            raise ValueError("droidspeak_layers, selection_windows and selection_stride must be positive")

    def corpora(self, consumer: ModelSource) -> tuple[Corpus, Corpus | None]:
        """The evaluation text and the text droidspeak selects its layers on (None: no such text)."""
        if self.text:
            return UserText(self.text), UserText(self.calib_text) if self.calib_text else None
        if not consumer.in_catalog:
            raise ValueError(f"consumer {consumer.name} is not in the catalog: give held-out text (--text PATH)")
        return catalog.consumer(consumer.name).corpus, catalog.consumer(consumer.name).corpus

    def scd_method_names(self) -> list[str]:
        """``scd`` for a single bundle, else ``scd:<bundle directory name>`` per bundle."""
        if len(self.bundles) == 1:
            return [SCD_METHOD]
        return [f"{SCD_METHOD}:{Path(b).name}" for b in self.bundles]

    def anchors(self) -> list[str]:
        """The measured methods that compress the producer's KV without adapting it (what ``anchor_map`` follows)."""
        return [m for m in self.methods if m not in ("oracle", "none", DROIDSPEAK)]

    def mapped_anchor_names(self) -> list[str]:
        """``<anchor>+map`` for each anchor when ``anchor_map`` is set."""
        return [a + MAP_SUFFIX for a in self.anchors()] if self.anchor_map else []

    def quick(self) -> QualityConfig:
        return replace(self, windows=min(self.windows, 6), continuation_tokens=min(self.continuation_tokens, 32),
                       selection_windows=min(self.selection_windows, 2), selection_stride=3)


@dataclass(slots=True)
class QualityReport:
    producer: str
    consumer: str
    prefix_tokens: int
    continuation_tokens: int
    windows: int
    seed: int
    text: str = ""
    methods: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it was not measured
    paired: list[dict] = field(default_factory=list)  # each scd method minus each baseline (and its no-map twin)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def run_quality(config: QualityConfig, progress: bool = True) -> QualityReport:
    """Run the benchmark; deterministic for a given config."""
    torch.manual_seed(config.seed)
    producer_source = resolve(config.producer)
    consumer_source = resolve(config.consumer, base=producer_source)
    corpus, calib_corpus = config.corpora(consumer_source)
    skipped = {}
    base_methods = list(config.methods)
    if DROIDSPEAK in base_methods and calib_corpus is None:
        base_methods.remove(DROIDSPEAK)
        skipped[DROIDSPEAK] = "no --calib-text to choose its layers on (never the evaluation text)"
    producer = load_model(producer_source, device=config.device)
    consumer = load_model(consumer_source, device=config.device)
    length = config.prefix_tokens + config.continuation_tokens + 1
    windows = eval_windows(consumer.tokenizer, corpus, config.windows, length, config.seed)
    methods = [*base_methods, *config.scd_method_names()]
    if config.no_map:
        methods += [name + NO_MAP for name in config.scd_method_names()]
    scores = {name: ContinuationScore() for name in methods}
    codecs = {name: make_codec(name) for name in base_methods if name not in ("oracle", "none", DROIDSPEAK, "kvq2")}
    if "kvq2" in base_methods:  # pre-RoPE keys: it needs the producer's rotation
        codecs["kvq2"] = KVQuantLiteCodec(layout_of(producer.model))
    for name, bundle in zip(config.scd_method_names(), config.bundles, strict=True):
        codecs[name] = load_scd_codec(Path(bundle), producer, consumer)
        if config.no_map:
            space = codecs[name].space
            codecs[name + NO_MAP] = ScdCodec(space, PairDecoder.identity(space, consumer.name))
    if config.anchor_map:
        mapped = load_scd_codec(Path(config.anchor_map), producer, consumer)
        for name in config.mapped_anchor_names():
            anchor = codecs[name.removesuffix(MAP_SUFFIX)]
            codecs[name] = MappedAnchor(anchor, mapped.decoder, mapped.space.layout, mapped.space.sink_tokens)
            methods.append(name)
            scores[name] = ContinuationScore()
    residual_layers: list[int] = []
    hidden_layers = sorted({layer for name in config.scd_method_names() for layer in codecs[name].space.patch_layers})
    if DROIDSPEAK in base_methods:
        calib = eval_windows(consumer.tokenizer, calib_corpus, config.selection_windows, length - 1, config.seed,
                             split="calib")
        group, _ = select_group(producer.model, consumer.model, calib, config.prefix_tokens,
                                config.droidspeak_layers, stride=config.selection_stride)
        codecs[DROIDSPEAK] = DroidSpeakCodec(consumer.model, group)
        residual_layers = [group.start]
    p = config.prefix_tokens
    for window in tqdm(windows, desc=f"quality {consumer.name}", unit="window", disable=not progress):
        prefix, feed, targets = window[:p], window[p:-1], window[p + 1 :]
        own_state, _ = prefill_capture(consumer.model, prefix)
        oracle_logits = continue_with_prefix(consumer.model, own_state, feed)
        producer_state, _ = prefill_capture(producer.model, prefix, hidden_layers=hidden_layers,
                                            residual_layers=residual_layers)
        for name in methods:
            if name == "oracle":
                logits, nbytes = oracle_logits, 0
            elif name == "none":
                logits, nbytes = continue_with_prefix(consumer.model, None, feed), 0
            else:
                payload = codecs[name].encode(producer_state)
                state = codecs[name].decode(payload, device=config.device)
                logits, nbytes = continue_with_prefix(consumer.model, state, feed), len(payload)
            scores[name].add(logits, oracle_logits, targets)
            scores[name].payload_bytes += nbytes
            scores[name].prefix_tokens += p
    fp16_per_token = 2 * 2 * producer_state.num_layers * producer_state.num_kv_heads * producer_state.head_dim
    oracle_ppl = scores["oracle"].ppl
    report = QualityReport(producer.name, consumer.name, p, config.continuation_tokens, len(windows), config.seed,
                           corpus_name(corpus), skipped=skipped)
    bundle_of = dict(zip(config.scd_method_names(), config.bundles, strict=True))
    for name in methods:
        s = scores[name]
        extra = {}
        if name == DROIDSPEAK:
            extra = {"layers": [codecs[name].group.start, codecs[name].group.stop]}
        elif name.endswith(MAP_SUFFIX):
            extra = {"map_of": config.anchor_map}
        elif name in bundle_of:
            patches = codecs[name].decoder.patches
            extra = {"bundle": bundle_of[name], "kind": "patch-" + patches[0].source if patches else "reuse",
                     "patch_layers": [p.layer for p in patches]}
        report.methods.append({
            "name": name,
            "ppl": round(s.ppl, 4),
            "ppl_rel": round(s.ppl / oracle_ppl - 1.0, 5),
            "kl": round(s.mean_kl, 5),
            "top1": round(s.top1_rate, 4),
            "bytes_per_token": round(s.bytes_per_token, 2),
            "payload_ratio": round(s.bytes_per_token / fp16_per_token, 4),
            "intervals": method_intervals(s, scores["oracle"]) if name != "oracle" else {},
            **extra,
        })
    baselines = [m for m in base_methods if m != "oracle"]
    baselines += [m for m in methods if m.endswith(MAP_SUFFIX)]
    for name in config.scd_method_names():
        for other in baselines + ([name + NO_MAP] if config.no_map else []):
            report.paired.append({"a": name, "b": other, **paired_difference(scores[name], scores[other])})
    return report


def load_scd_codec(bundle: Path, producer: LoadedModel, consumer: LoadedModel) -> ScdCodec:
    """The SCD codec of ``bundle`` for this producer / consumer pair (fingerprints checked)."""
    space = load_space(bundle, producer_fingerprint=producer.fingerprint)
    return ScdCodec(space, load_pair(bundle, consumer.name, space, consumer_fingerprint=consumer.fingerprint))


def write_report(report: QualityReport, path: Path | None) -> None:
    """Write the JSON report and its Pareto plot next to it (same name, ``.png``)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.to_json() + "\n")
        plot_pareto([json.loads(report.to_json())], path.with_suffix(".png"))
