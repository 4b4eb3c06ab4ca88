"""Probe: a joint K|V map per layer (y_l = x_l + x_l W_l + b, x_l = [K_l | V_l] pre-RoPE, W_l [2C, 2C]) against
today's dense per-group map (W_g [C, C] for K and V apart), same space, teacher windows, steps and seed."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

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

# usage: joint_map_probe.py BUNDLE CONSUMER STEPS SEEDS(0,1) WINDOWS
bundle, consumer_name, steps, seeds, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
producer_source = resolve("smollm2-135m-instruct")
consumer_source = resolve(consumer_name, base=producer_source)
producer, consumer = load_model(producer_source), load_model(consumer_source)
space = load_space(Path(bundle), producer_fingerprint=producer.fingerprint)
L, C = space.layout.num_layers, space.layout.width


def joint(x, w):
    lead = x.shape[:-2]
    return torch.einsum("...lc,lcd->...ld", x.reshape(*lead, L, 2 * C), w).reshape(x.shape)


dist.initial_map = lambda layout, structure, device: torch.zeros(L, 2 * C, 2 * C, device=device, requires_grad=True)
dist.apply_map = joint
captured = {}


def keep(consumer, fp, weight, bias, cfp, patches):
    captured.update(weight=weight.float(), bias=bias.float())
    return None


dist.PairDecoder = keep
plan = plan_pairs(producer_source, [consumer_name], None)[0]
config = CalibrationConfig(budget=0.125, packing="ans-1", distill_steps=steps)
_, stats = dist.distil_decoder(producer, consumer, space, plan.corpus, config)
print("train", json.dumps(stats), flush=True)
save_file({k: v.contiguous() for k, v in captured.items()}, f"joint-map-{consumer_name}.safetensors")

base = load_scd_codec(Path(bundle), producer, consumer)
plain = ScdCodec(space, PairDecoder.identity(space, consumer.name))
for seed in [int(s) for s in seeds.split(",")]:
    torch.manual_seed(seed)
    cfg = QualityConfig(consumer=consumer_name, windows=n, seed=seed, methods=("oracle", "raw"))
    corpus, _ = cfg.corpora(consumer_source)
    p = cfg.prefix_tokens
    windows = eval_windows(consumer.tokenizer, corpus, n, p + cfg.continuation_tokens + 1, seed)
    scores = {k: ContinuationScore() for k in ("dense", "joint")}
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
        y = x + joint(x, captured["weight"]) + captured["bias"]
        head = KVState(xhat.keys[:, :, :s], xhat.values[:, :, :s], start=0)
        state = KVState.cat([head, from_features(y, space.layout, s)])
        scores["joint"].add(continue_with_prefix(consumer.model, state, feed), oracle, targets)
        scores["dense"].add(continue_with_prefix(consumer.model, base.decode(payload), feed), oracle, targets)
        if i % 10 == 9:
            print(seed, i + 1, {k: (round(v.mean_kl, 4), round(v.top1_rate, 4)) for k, v in scores.items()}, flush=True)
    result = {k: {"kl": v.mean_kl, "top1": v.top1_rate, "ppl": v.ppl} for k, v in scores.items()}
    print("result", seed, json.dumps(result), flush=True)
