"""Distil one consumer's decoder end to end on the consumer's own next-token distribution.

The decoder's affine maps (``y = x + x W + b``; W starts at 0, b at the mean shift) and any PATCH
aligners train to minimise KL(consumer on its own prefill || consumer on the decoded cache) over
the continuation after a random cut of each coded prefix, the consumer frozen, gradients only into
the maps (Adam, cosine decay).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scd_store.adapters.transformers.calibration.config import CalibrationConfig
from scd_store.adapters.transformers.calibration.feature_cache import cache_from_features
from scd_store.adapters.transformers.calibration.teacher import TeacherData, collect_teacher, through_space
from scd_store.adapters.transformers.compat import cache_kwarg
from scd_store.adapters.transformers.loading import LoadedModel
from scd_store.codecs.scd.decoder import MAP_DTYPE, PairDecoder, apply_map, choose_structure, map_shape
from scd_store.codecs.scd.layout import KVLayout
from scd_store.codecs.scd.patch import PatchAligner, apply_patches
from scd_store.codecs.scd.space import CodeSpace
from scd_store.models.windows import Corpus


def map_structure(consumer: LoadedModel, layout: KVLayout, requested: str) -> str:
    """The decoder map a pair trains: ``requested``, or for ``"auto"`` dense where it stays within 2% of the
    consumer's own weight bytes as served (bf16), whatever dtype calibration loaded it in."""
    consumer_bytes = 2 * sum(p.numel() for p in consumer.model.parameters())
    return choose_structure(layout.groups, layout.kv_heads, layout.head_dim, consumer_bytes, requested)


def initial_map(layout: KVLayout, structure: str, device: torch.device | str) -> torch.Tensor:
    """A zero map of ``structure`` (``y = x`` before training), trainable."""
    return torch.zeros(map_shape(layout.groups, layout.kv_heads, layout.head_dim, structure), device=device,
                       requires_grad=True)


def distil_decoder(producer: LoadedModel, consumer: LoadedModel, space: CodeSpace, corpus: Corpus,
                   config: CalibrationConfig, progress: bool = True, patch_layers: tuple[int, ...] = (),
                   teacher: TeacherData | None = None) -> tuple[PairDecoder, dict]:
    """Train ``consumer``'s decoder for ``space`` end to end; returns it with training stats.

    A PATCH space's patch layers always get "hidden" aligners; ``patch_layers`` adds "kv" aligners
    (payload-free) at those layers of a REUSE space. ``teacher`` (from :func:`collect_teacher`)
    is reused when given, so a sweep runs the models over the windows once. Runs ``config.distill_steps``
    steps on the consumer's device (the teacher data stays on the host; each batch is moved)."""
    recipe = config.recipe
    start_time = time.perf_counter()
    if teacher is None:
        teacher = collect_teacher(producer, consumer, corpus, config, space.patch_layers, progress)
    data = through_space(space, teacher, recipe.sink_tokens)
    collect_seconds = time.perf_counter() - start_time
    device = consumer.device
    structure = map_structure(consumer, space.layout, config.map_request)
    weight = initial_map(space.layout, structure, device)
    bias = data.mean_shift.to(device).requires_grad_(True)
    layers = consumer.model.model.layers
    patches = [PatchAligner.initial(layer, "hidden", layers[layer].self_attn, recipe.patch_units, config.seed)
               for layer in space.patch_layers]
    patches += [PatchAligner.initial(layer, "kv", layers[layer].self_attn, recipe.patch_units, config.seed)
                for layer in patch_layers if layer not in space.patch_layers]
    patches = [patch.to(device) for patch in patches]
    patch_params = [t.requires_grad_(True) for patch in patches for t in patch.trainable()]
    groups = [{"params": [weight], "lr": recipe.lr_weight}, {"params": [bias], "lr": recipe.lr_bias}]
    if patch_params:
        groups.append({"params": patch_params, "lr": recipe.lr_patch})
    base_lrs = [group["lr"] for group in groups]
    optimizer = torch.optim.Adam(groups)
    generator = torch.Generator().manual_seed(config.seed)
    for param in consumer.model.parameters():
        param.requires_grad_(False)
    losses = []
    n = data.xhat.shape[0]
    prefix = data.xhat.shape[1] + recipe.sink_tokens  # the teacher's prefix length
    first_cut = data.first_cut
    total = config.distill_steps
    bar = tqdm(total=total, desc=f"distil {consumer.name}: train", unit="step", disable=not progress)
    step = 0
    while step < total:
        idx = torch.randint(0, n, (recipe.batch_size,), generator=generator)
        cut = prefix
        if first_cut < prefix:
            cut = int(torch.randint(first_cut, prefix + 1, (1,), generator=generator))
        coded = cut - recipe.sink_tokens
        xhat = data.xhat[idx, :coded].to(device).float()
        y = xhat + apply_map(xhat, weight) + bias
        hidden = data.hidden[idx, :coded].to(device).float() if data.hidden is not None else None
        if patches:
            per_group = list(y.unbind(2))
            apply_patches(per_group, patches, hidden, space.patch_layers)
            y = torch.stack(per_group, dim=2)
        cache = cache_from_features(consumer.model, y, data.sink_keys[idx].to(device),
                                    data.sink_values[idx].to(device), space.layout, recipe.sink_tokens)
        feed = data.tokens[idx, cut:cut + config.continuation_tokens].to(device)
        logits = consumer.model(input_ids=feed, **{cache_kwarg(consumer.model): cache}, use_cache=True).logits
        rows = slice(cut - first_cut, cut - first_cut + config.continuation_tokens)
        target = F.log_softmax(data.teacher[idx, rows].to(device).float(), -1)
        student = F.log_softmax(logits, -1)
        kl = F.kl_div(student, target, log_target=True, reduction="none").sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        kl.backward()
        # cosine decay over the run keeps the last steps from jittering
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * 0.5 * (1 + math.cos(math.pi * step / max(1, total)))
        optimizer.step()
        losses.append(float(kl.detach()))
        if step % 10 == 0:
            bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
        bar.update(1)
        step += 1
    bar.close()
    for patch in patches:
        for t in patch.trainable():
            t.requires_grad_(False)
    patches = [patch.to("cpu") for patch in patches]
    decoder = PairDecoder(consumer.name, space.fingerprint, weight.detach().cpu().to(MAP_DTYPE),
                          bias.detach().cpu().clone(), consumer.fingerprint, patches)
    stats = {
        "windows": n,
        "steps": total,
        "device": str(device),
        "decoder": structure,
        "shortest_prefix": recipe.shortest_prefix,
        "collect_seconds": round(collect_seconds, 1),
        "train_seconds": round(time.perf_counter() - start_time - collect_seconds, 1),
        "kl_first": round(sum(losses[:20]) / max(1, len(losses[:20])), 5) if losses else None,
        "kl_last": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 5) if losses else None,
    }
    return decoder, stats
