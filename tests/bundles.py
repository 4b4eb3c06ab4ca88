"""A tiny calibration bundle on disk (a code space fitted to correlated random KV, identity-like decoders)."""

from __future__ import annotations

from pathlib import Path

import torch

from scd_store.codecs import KVState
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.codecs.scd.decoder import PairDecoder
from scd_store.codecs.scd.layout import KVLayout, to_features
from scd_store.codecs.scd.space import CodeSpace

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, rope_theta=1e4)
PRODUCER = "producer-a"


def correlated_state(tokens: int, start: int = 0, seed: int = 0) -> KVState:
    """KV with the structure a code space can compress (a shared mixing matrix over 16 latent dims)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(16, 16, generator=torch.Generator().manual_seed(99))
    keys = (torch.randn(2, 2, tokens, 16, generator=g) @ mix)[..., :8]
    values = (torch.randn(2, 2, tokens, 16, generator=g) @ mix)[..., 8:]
    return KVState(keys.contiguous(), values.contiguous(), start=start)


def chunked(count: int, size: int, seed: int = 0) -> list[KVState]:
    """:func:`correlated_state` of ``count * size`` tokens cut into chunks at their positions."""
    state = correlated_state(count * size, seed=seed)
    return [KVState(state.keys[:, :, i * size:(i + 1) * size].contiguous(),
                    state.values[:, :, i * size:(i + 1) * size].contiguous(), start=i * size) for i in range(count)]


def tiny_space(budget: float = 0.4, space_id: str = "tiny-space", sinks: int = 2,
               producer_fingerprint: str = "producer-fp") -> CodeSpace:
    """A code space fitted to :func:`correlated_state` KV."""
    feats = torch.cat([to_features(correlated_state(64, seed=s), LAYOUT) for s in range(4)])
    x = feats.transpose(0, 1).double()
    mean = x.mean(1)
    cov = torch.einsum("gtc,gtd->gcd", x - mean[:, None], x - mean[:, None]) / x.shape[1]
    return CodeSpace.from_statistics(space_id, LAYOUT, mean, cov, budget, sink_tokens=sinks,
                                     producer_fingerprint=producer_fingerprint)


def write_tiny_bundle(path: Path, consumers: tuple[str, ...] = ("consumer-a",), budget: float = 0.4,
                      space_id: str = "tiny-space", fingerprint_suffix: str = "-fp") -> CodeSpace:
    """Write a bundle for ``PRODUCER`` and ``consumers`` (weights fingerprints: name + ``fingerprint_suffix``):
    consumer i's decoder scales the identity by 1 + i/10."""
    space = tiny_space(budget, space_id)
    save_space(path, space, extra={"producer": PRODUCER})
    for i, name in enumerate(consumers):
        g, c = space.layout.groups, space.layout.width
        weight = torch.eye(c).expand(g, c, c) * (i / 10)  # the decoder is residual: out = x + x W + b
        fingerprint = name + fingerprint_suffix
        decoder = PairDecoder(name, space.fingerprint, weight.contiguous(), torch.zeros(g, c), fingerprint)
        save_pair(path, decoder)
    return space


def tiny_ecsq_space(bits_per_component: float = 2.0, packing: str = "ans-1", sinks: int = 2) -> CodeSpace:
    """:func:`tiny_space`'s basis with entropy-coded scalar quantisers fitted on more correlated KV."""
    from scd_store.codecs.scd.ecsq import fit

    space = tiny_space(0.4, "tiny-ecsq", sinks, "producer-fp")
    feats = torch.cat([to_features(correlated_state(64, seed=s), LAYOUT) for s in range(8)])
    z = space.project(feats).reshape(feats.shape[0], -1)
    weights = torch.ones(LAYOUT.groups, LAYOUT.width)
    weights[0::2] = 4.0
    return space.with_ecsq(fit(z, space.sigma.flatten(), weights.flatten(), bits_per_component), packing)
