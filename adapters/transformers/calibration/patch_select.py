"""Patch-layer selection: where does exact consumer KV buy the most, measured on calibration text.

For each layer ``l`` the consumer continues from the producer's raw KV with layer ``l`` replaced by
its own exact KV; the drop in KL to its own prefill is that layer's gain (drift there, amplified by
every layer above it). The ``k`` layers with the largest gain, summed over the space's consumers,
are patched. Measured on logits, not on reconstruction error: raw error ranks layers badly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm import tqdm

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.inject import continue_with_prefix, mean_kl
from scd_store.codecs.kv_state import KVState


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
        base = mean_kl(continue_with_prefix(consumer, produced, feed), oracle)
        if gains is None:
            gains = [0.0] * produced.num_layers
        for layer in range(produced.num_layers):
            keys, values = produced.keys.clone(), produced.values.clone()
            keys[layer], values[layer] = own.keys[layer], own.values[layer]
            kl = mean_kl(continue_with_prefix(consumer, KVState(keys, values), feed), oracle)
            gains[layer] += (base - kl) / len(windows)
    return gains or []


def rank_layers(gains_per_consumer: Sequence[Sequence[float]], k: int) -> tuple[int, ...]:
    """The ``k`` layers with the largest summed gain, best first."""
    if k <= 0:
        return ()
    total = [sum(col) for col in zip(*gains_per_consumer, strict=True)]
    if k > len(total):
        raise ValueError(f"cannot patch {k} of {len(total)} layers")
    return tuple(sorted(range(len(total)), key=lambda i: -total[i])[:k])


def choose_patch_layers(gains_per_consumer: Sequence[Sequence[float]], k: int) -> tuple[int, ...]:
    """The ``k`` layers with the largest summed gain, in layer order."""
    return tuple(sorted(rank_layers(gains_per_consumer, k)))
