"""How much each direction of a model's cached K / V features matters to its next-token distribution.

For each calibration window the producer prefills the prefix, then runs the continuation on a
cache rebuilt from the prefix's (pre-RoPE) features with gradients on; a label is sampled from the
model's own next-token distribution at every continuation position and the gradient of its
log-likelihood is taken with respect to every prefix feature. Summing ``g g^T`` per group over
tokens and windows gives the Fisher information ``F`` [G, C, C]: quantisation noise ``e`` on a
group's features raises the expected KL to the model's own distribution by about ``e^T F e / 2``.
The code space spends bits where that is largest (``CodeSpace.from_statistics(sensitivity=F)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.feature_cache import cache_from_features
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.layout import KVLayout, to_features


def feature_fisher(model: torch.nn.Module, layout: KVLayout, windows: list[torch.Tensor], prefix_tokens: int,
                   sink_tokens: int, seed: int = 0, progress: bool = True) -> torch.Tensor:
    """Fisher information ``[G, C, C]`` (float64, per prefix token) of ``model``'s continuation
    distribution with respect to its own prefix features (sinks excluded) over ``windows``."""
    g, c = layout.groups, layout.width
    fisher = torch.zeros(g, c, c, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    tokens = 0
    try:
        for window in tqdm(windows, desc="code space: sensitivity", unit="window", disable=not progress):
            if window.numel() < prefix_tokens + 2:
                raise ValueError(f"sensitivity windows need more than {prefix_tokens + 1} tokens")
            state, _ = prefill_capture(model, window[:prefix_tokens])
            rest = KVState(state.keys[:, :, sink_tokens:], state.values[:, :, sink_tokens:], start=sink_tokens)
            features = to_features(rest, layout).unsqueeze(0).requires_grad_(True)
            with torch.enable_grad():
                cache = cache_from_features(model, features, state.keys[None, :, :, :sink_tokens],
                                            state.values[None, :, :, :sink_tokens], layout, sink_tokens)
                feed = window[prefix_tokens:].to(features.device)[None]
                logits = model(input_ids=feed, **{cache_kwarg(model): cache}, use_cache=True).logits[0].float()
                probs = F.softmax(logits.detach(), -1)
                labels = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)
                F.cross_entropy(logits, labels, reduction="sum").backward()
            grad = features.grad[0].double().transpose(0, 1)  # [G, T, C]
            fisher += grad.transpose(1, 2) @ grad
            tokens += grad.shape[1]
    finally:
        for param in frozen:
            param.requires_grad_(True)
    return fisher / max(1, tokens)
