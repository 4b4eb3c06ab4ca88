"""Shared by the map probes: train a decoder map of another form with the default recipe (calibration's own
distillation loop, its map swapped), then score it beside the bundle's default map on fresh windows."""
import json
from collections.abc import Callable
from pathlib import Path

import torch

import scd_store.adapters.transformers.calibration.distillation as dist
from scd_store.adapters.transformers import continue_with_prefix, load_model, prefill_capture
from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.adapters.transformers.calibration.run import plan_pairs
from scd_store.bench.metrics import ContinuationScore
from scd_store.bench.quality import QualityConfig, load_scd_codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import load_space
from scd_store.codecs.scd.codec import ScdCodec
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import from_features, to_features
from scd_store.models.sources import resolve
from scd_store.models.windows import eval_windows

MapFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (features x, trained weight) -> x W


class Pair:
    """The producer, one consumer and the bundle's space."""

    def __init__(self, bundle: str, consumer_name: str) -> None:
        self.bundle, self.consumer_name = Path(bundle), consumer_name
        self.producer_source = resolve("smollm2-135m-instruct")
        self.consumer_source = resolve(consumer_name, base=self.producer_source)
        self.producer, self.consumer = load_model(self.producer_source), load_model(self.consumer_source)
        self.space = load_space(self.bundle, producer_fingerprint=self.producer.fingerprint)


def train_map(pair: Pair, steps: int, initial_map: Callable, apply_map: MapFn) -> dict[str, torch.Tensor]:
    """Distil a map of another form (``initial_map(layout, structure, device)``, ``apply_map``) at the default
    recipe on the space's codes; returns its weight and bias (as a decoder keeps them) and prints the stats."""
    dist.initial_map, dist.apply_map = initial_map, apply_map
    captured = {}

    def keep(consumer, fp, weight, bias, cfp, patches):
        captured.update(weight=weight.float(), bias=bias.float())

    dist.PairDecoder = keep
    plan = plan_pairs(pair.producer_source, [pair.consumer_name], None)[0]
    config = CalibrationConfig(budget=0.125, packing="ans-1", distill_steps=steps)
    _, stats = dist.distil_decoder(pair.producer, pair.consumer, pair.space, plan.corpus, config)
    print("train", json.dumps(stats), flush=True)
    return captured


def compare(pair: Pair, name: str, apply_map: MapFn, trained: dict[str, torch.Tensor], seeds: str, n: int) -> None:
    """Score ``y = x + apply_map(x, W) + b`` beside the bundle's default map ("dense") on ``n`` fresh windows
    per seed (``"0,1"``), printing running and final KL / top-1 / PPL."""
    space, consumer, producer = pair.space, pair.consumer, pair.producer
    base = load_scd_codec(pair.bundle, producer, consumer)
    plain = ScdCodec(space, PairDecoder.identity(space, consumer.name))
    for seed in [int(s) for s in seeds.split(",")]:
        torch.manual_seed(seed)
        cfg = QualityConfig(consumer=pair.consumer_name, windows=n, seed=seed, methods=("oracle", "raw"))
        corpus, _ = cfg.corpora(pair.consumer_source)
        p = cfg.prefix_tokens
        windows = eval_windows(consumer.tokenizer, corpus, n, p + cfg.continuation_tokens + 1, seed)
        scores = {k: ContinuationScore() for k in ("dense", name)}
        s = space.sink_tokens
        for i, window in enumerate(windows):
            prefix, feed, targets = window[:p], window[p:-1], window[p + 1:]
            own, _ = prefill_capture(consumer.model, prefix)
            oracle = continue_with_prefix(consumer.model, own, feed)
            prod, _ = prefill_capture(producer.model, prefix)
            payload = base.encode(prod)
            xhat = plain.decode(payload)
            rest = KVState(xhat.keys[:, :, s:], xhat.values[:, :, s:], start=s)
            x = to_features(rest, space.layout)
            with torch.no_grad():
                y = x + apply_map(x, trained["weight"]) + trained["bias"]
            head = KVState(xhat.keys[:, :, :s], xhat.values[:, :, :s], start=0)
            state = KVState.cat([head, from_features(y, space.layout, s)])
            scores[name].add(continue_with_prefix(consumer.model, state, feed), oracle, targets)
            scores["dense"].add(continue_with_prefix(consumer.model, base.decode(payload), feed), oracle, targets)
            if i % 10 == 9:
                print(seed, i + 1, {k: (round(v.mean_kl, 4), round(v.top1_rate, 4)) for k, v in scores.items()},
                      flush=True)
        result = {k: {"kl": v.mean_kl, "top1": v.top1_rate, "ppl": v.ppl} for k, v in scores.items()}
        print("result", seed, json.dumps(result), flush=True)
