"""Probe: retrain one consumer's decoder on an existing space (as ``calibrate --reuse-space``) with a changed
optimiser recipe: the map's learning rate and a decoupled weight decay on the map (towards y = x + b).

usage: recipe_probe.py BUNDLE_COPY CONSUMER BUDGET STEPS WINDOWS LR_WEIGHT WEIGHT_DECAY
"""
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from scd_store.adapters.transformers.calibration import CalibrationConfig, Recipe, calibrate, distillation

bundle, consumer = Path(sys.argv[1]), sys.argv[2]
budget, steps, windows = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lr_weight, weight_decay = float(sys.argv[6]), float(sys.argv[7])


def adam_with_map_decay(groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW with the decay on the first group (the map's weight) only: the bias starts at the mean shift."""
    groups = [dict(group, weight_decay=weight_decay if i == 0 else 0.0) for i, group in enumerate(groups)]
    return torch.optim.AdamW(groups)


if weight_decay > 0:
    distillation.torch.optim.Adam = adam_with_map_decay  # the probe's only change to the recipe's optimiser
base = CalibrationConfig(packing="ans-1", recipe=replace(Recipe(), lr_weight=lr_weight))
print(json.dumps(calibrate("smollm2-135m-instruct", [consumer], bundle, budget=budget, steps=steps,
                           windows=windows, reuse_space=True, base_config=base), indent=2))
