"""Probe: a non-linear decoder map. Today's dense affine map plus a residual MLP per group
(y = x + x W + b + gelu(rms(x) A + a) B, rank R, B starting at 0), trained from scratch with the default
recipe (same space, teacher windows, steps and seed as the default map), against the bundle's default map
on fresh windows."""
import sys

import torch
import torch.nn.functional as F
from map_probe import Pair, compare, train_map

# usage: mlp_map_probe.py BUNDLE CONSUMER STEPS RANK SEEDS(0,1) WINDOWS
bundle, consumer_name, steps, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seeds, n = sys.argv[5], int(sys.argv[6])
pair = Pair(bundle, consumer_name)
G, C = pair.space.layout.groups, pair.space.layout.width
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


trained = train_map(pair, steps, initial, mlp_map)
compare(pair, "mlp", mlp_map, trained, seeds, n)
