"""Probe: how much do the producer's raw sink tokens cost the consumer? Codes with the producer's sinks (as
served), with the consumer's own sinks (what a 4-token consumer prefill would give), with the map on them too."""
import json
import sys
from pathlib import Path

import torch

from scd_store.adapters.transformers import continue_with_prefix, load_model, prefill_capture
from scd_store.bench.metrics import ContinuationScore
from scd_store.bench.quality import QualityConfig, load_scd_codec
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.decoder import apply_map
from scd_store.codecs.scd.layout import from_features, to_features
from scd_store.models.sources import resolve
from scd_store.models.windows import eval_windows

# usage: sink_probe.py BUNDLE CONSUMER SEED WINDOWS
bundle, consumer_name, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(seed)
cfg = QualityConfig(consumer=consumer_name, windows=n, seed=seed, methods=("oracle", "raw"))
producer_source = resolve(cfg.producer)
consumer_source = resolve(cfg.consumer, base=producer_source)
corpus, calib_corpus = cfg.corpora(consumer_source)
producer, consumer = load_model(producer_source), load_model(consumer_source)
codec = load_scd_codec(Path(bundle), producer, consumer)
s = codec.space.sink_tokens
layout, dec = codec.space.layout, codec.decoder
p = cfg.prefix_tokens
windows = eval_windows(consumer.tokenizer, corpus, n, p + cfg.continuation_tokens + 1, seed)
calib = eval_windows(consumer.tokenizer, calib_corpus, 48, p + cfg.continuation_tokens + 1, seed + 7, split="calib")
shift_k = shift_v = 0
for w in calib:  # a window's first s tokens' KV depends on those s tokens only
    o, _ = prefill_capture(consumer.model, w[:s])
    q, _ = prefill_capture(producer.model, w[:s])
    shift_k = shift_k + (o.keys - q.keys) / len(calib)
    shift_v = shift_v + (o.values - q.values) / len(calib)
names = ["codes+shift_sinks", "codes", "codes+own_sinks", "codes+mapped_sinks", "raw", "raw+own_sinks"]
scores = {k: ContinuationScore() for k in names}


def with_head(state, keys, values):
    k, v = state.keys.clone(), state.values.clone()
    k[:, :, :s], v[:, :, :s] = keys, values
    return KVState(k, v, start=state.start)


def mapped(keys, values):
    x = to_features(KVState(keys, values, start=0), layout)
    y = x + apply_map(x, dec.weight.float()) + dec.bias.float()
    out = from_features(y, layout, 0)
    return out.keys, out.values


for i, window in enumerate(windows):
    prefix, feed, targets = window[:p], window[p:-1], window[p + 1:]
    own, _ = prefill_capture(consumer.model, prefix)
    oracle = continue_with_prefix(consumer.model, own, feed)
    prod, _ = prefill_capture(producer.model, prefix)
    state = codec.decode(codec.encode(prod))
    ok, ov = own.keys[:, :, :s], own.values[:, :, :s]
    mk, mv = mapped(prod.keys[:, :, :s].float(), prod.values[:, :, :s].float())
    states = {"codes+shift_sinks": with_head(state, prod.keys[:, :, :s] + shift_k, prod.values[:, :, :s] + shift_v),
              "codes": state, "codes+own_sinks": with_head(state, ok, ov),
              "codes+mapped_sinks": with_head(state, mk, mv),
              "raw": prod, "raw+own_sinks": with_head(prod, ok, ov)}
    for k, st in states.items():
        scores[k].add(continue_with_prefix(consumer.model, st, feed), oracle, targets)
    if i % 10 == 9:
        print(i + 1, {k: (round(v.mean_kl, 4), round(v.top1_rate, 4)) for k, v in scores.items()}, flush=True)
print(json.dumps({k: {"kl": v.mean_kl, "top1": v.top1_rate, "ppl": v.ppl} for k, v in scores.items()}))
