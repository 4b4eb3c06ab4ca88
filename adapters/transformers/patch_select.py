"""Patch-layer selection: where does exact consumer KV buy the most, measured on calibration text.

For each layer ``l`` the consumer continues from the producer's raw KV with layer ``l`` replaced by
its own exact KV; the drop in KL to its own prefill is that layer's gain (drift there, amplified by
every layer above it). The ``k`` layers with the largest gain, summed over the space's consumers,
are patched. Measured on logits, not on reconstruction error: raw error ranks layers badly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.inject import continue_with_prefix
from scd_store.codecs.kv_state import KVState


def _kl(logits: torch.Tensor, oracle: torch.Tensor) -> float:
    return float(F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(oracle.float(), -1), log_target=True,
                          reduction="none").sum(-1).mean())


@torch.no_grad()
def layer_gains(producer: torch.nn.Module, consumer: torch.nn.Module, windows: Sequence[torch.Tensor],
                prefix_tokens: int, progress: bool = False) -> list[float]:
    """Per layer: mean KL(raw reuse) - KL(raw reuse with that layer's exact consumer KV), in nats."""
    gains: list[float] | None = None
    for window in tqdm(windows, desc="patch layers: gains", unit="window", disable=not progress):
        prefix, feed = window[:prefix_tokens], window[prefix_tokens:]
        own, _ = prefill_capture(consumer, prefix)
        produced, _ = prefill_capture(producer, prefix)
        oracle = continue_with_prefix(consumer, own, feed)
        base = _kl(continue_with_prefix(consumer, produced, feed), oracle)
        if gains is None:
            gains = [0.0] * produced.num_layers
        for layer in range(produced.num_layers):
            keys, values = produced.keys.clone(), produced.values.clone()
            keys[layer], values[layer] = own.keys[layer], own.values[layer]
            kl = _kl(continue_with_prefix(consumer, KVState(keys, values), feed), oracle)
            gains[layer] += (base - kl) / len(windows)
    return gains or []


def choose_patch_layers(gains_per_consumer: Sequence[Sequence[float]], k: int) -> tuple[int, ...]:
    """The ``k`` layers with the largest summed gain, in layer order."""
    if k <= 0:
        return ()
    total = [sum(col) for col in zip(*gains_per_consumer, strict=True)]
    if k > len(total):
        raise ValueError(f"cannot patch {k} of {len(total)} layers")
    return tuple(sorted(sorted(range(len(total)), key=lambda i: -total[i])[:k]))
