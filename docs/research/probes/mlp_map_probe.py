"""Probe: a non-linear decoder map. Today's dense affine map plus a residual MLP per group
(y = x + x W + b + gelu(rms(x) A + a) B, rank R, B starting at 0), trained from scratch with the default
recipe (same space, teacher windows, steps and seed as the default map), against the bundle's default map
on fresh windows."""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

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

# usage: mlp_map_probe.py BUNDLE CONSUMER STEPS RANK SEEDS(0,1) WINDOWS
bundle, consumer_name, steps, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seeds, n = sys.argv[5], int(sys.argv[6])
producer_source = resolve("smollm2-135m-instruct")
consumer_source = resolve(consumer_name, base=producer_source)
producer, consumer = load_model(producer_source), load_model(consumer_source)
space = load_space(Path(bundle), producer_fingerprint=producer.fingerprint)
G, C = space.layout.groups, space.layout.width
SIZES = (G * C * C, G * C * rank, G * rank, G * rank * C)


def unpack(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w, a_in, a_bias, b_out = flat.split(SIZES)
    return w.view(G, C, C), a_in.view(G, C, rank), a_bias.view(G, rank), b_out.view(G, rank, C)


def mlp_map(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    w, a_in, a_bias, b_out = unpack(flat)
    u = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = F.gelu(torch.einsum("...gc,gcr->...gr", u, a_in) + a_bias)
    return torch.einsum("...gc,gcd->...gd", x, w) + torch.einsum("...gr,grd->...gd", h, b_out)


def initial(layout, structure, device):
    flat = torch.zeros(sum(SIZES), device=device)
    generator = torch.Generator().manual_seed(0)
    _, a_in, _, _ = unpack(flat)
    a_in.copy_(torch.randn(G, C, rank, generator=generator) / C**0.5)
    return flat.requires_grad_(True)


dist.initial_map = initial
dist.apply_map = mlp_map
captured = {}


def keep(consumer, fp, weight, bias, cfp, patches):
    captured.update(weight=weight.float(), bias=bias.float())
    return None


dist.PairDecoder = keep
plan = plan_pairs(producer_source, [consumer_name], None)[0]
config = CalibrationConfig(budget=0.125, packing="ans-1", distill_steps=steps)
_, stats = dist.distil_decoder(producer, consumer, space, plan.corpus, config)
print("train", json.dumps(stats), flush=True)

base = load_scd_codec(Path(bundle), producer, consumer)
plain = ScdCodec(space, PairDecoder.identity(space, consumer.name))
for seed in [int(s) for s in seeds.split(",")]:
    torch.manual_seed(seed)
    cfg = QualityConfig(consumer=consumer_name, windows=n, seed=seed, methods=("oracle", "raw"))
    corpus, _ = cfg.corpora(consumer_source)
    p = cfg.prefix_tokens
    windows = eval_windows(consumer.tokenizer, corpus, n, p + cfg.continuation_tokens + 1, seed)
    scores = {k: ContinuationScore() for k in ("dense", "mlp")}
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
            y = x + mlp_map(x, captured["weight"]) + captured["bias"]
        head = KVState(xhat.keys[:, :, :s], xhat.values[:, :, :s], start=0)
        state = KVState.cat([head, from_features(y, space.layout, s)])
        scores["mlp"].add(continue_with_prefix(consumer.model, state, feed), oracle, targets)
        scores["dense"].add(continue_with_prefix(consumer.model, base.decode(payload), feed), oracle, targets)
        if i % 10 == 9:
            print(seed, i + 1, {k: (round(v.mean_kl, 4), round(v.top1_rate, 4)) for k, v in scores.items()}, flush=True)
    result = {k: {"kl": v.mean_kl, "top1": v.top1_rate, "ppl": v.ppl} for k, v in scores.items()}
    print("result", seed, json.dumps(result), flush=True)
