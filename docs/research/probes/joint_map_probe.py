"""Probe: a joint K|V map per layer (y_l = x_l + x_l W_l + b, x_l = [K_l | V_l] pre-RoPE, W_l [2C, 2C]) against
today's dense per-group map (W_g [C, C] for K and V apart), same space, teacher windows, steps and seed."""
import sys

import torch
from map_probe import Pair, compare, train_map
from safetensors.torch import save_file

# usage: joint_map_probe.py BUNDLE CONSUMER STEPS SEEDS(0,1) WINDOWS
bundle, consumer_name, steps, seeds, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
pair = Pair(bundle, consumer_name)
L, C = pair.space.layout.num_layers, pair.space.layout.width


def joint(x, w):
    lead = x.shape[:-2]
    return torch.einsum("...lc,lcd->...ld", x.reshape(*lead, L, 2 * C), w).reshape(x.shape)


def initial(layout, structure, device):
    return torch.zeros(L, 2 * C, 2 * C, device=device, requires_grad=True)


trained = train_map(pair, steps, initial, joint)
save_file({k: v.contiguous() for k, v in trained.items()}, f"joint-map-{consumer_name}.safetensors")
compare(pair, "joint", joint, trained, seeds, n)
