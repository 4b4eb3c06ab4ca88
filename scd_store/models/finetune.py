"""The project's own fine-tuning script: a seeded LoRA (+ full-rank parts) fine-tune of the producer on one corpus."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from scd_store.models import lora
from scd_store.models.corpora import documents


@dataclass(frozen=True, slots=True)
class FinetuneRecipe:
    """Everything that determines a consumer's weights, given the producer's."""

    corpus: str
    seed: int = 0
    rank: int = 16
    alpha: float = 32.0
    lr: float = 2e-3
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 160
    warmup_steps: int = 5
    # modules trained at full rank instead of LoRA ("k_proj", "v_proj", ...; "norm" = every RMSNorm gain)
    full: tuple[str, ...] = ()
    full_lr: float = 3e-4
    # > 0: full-rank targets only in the first full_layers decoder layers (moving early layers shifts the
    # representation every later layer's KV is computed from; 0 = every layer)
    full_layers: int = 0
    delta_format: str = "bf16"  # how full-rank deltas are stored: "bf16" or per-row "int8"

    def __post_init__(self) -> None:
        if self.rank < 0 or (self.rank == 0 and not self.full):
            raise ValueError(f"a recipe needs LoRA (rank > 0) or full-rank targets: {self}")
        if self.steps <= 0 or self.batch_size <= 0 or self.seq_len < 16:
            raise ValueError(f"invalid fine-tune recipe: {self}")
        if not 0 < self.lr < 1 or not 0 < self.full_lr < 1:
            raise ValueError(f"learning rate out of range: {self.lr}, {self.full_lr}")
        if self.full_layers < 0 or (self.full_layers and not self.full):
            raise ValueError(f"full_layers needs full-rank targets and must be >= 0: {self}")
        if self.delta_format not in lora.DELTA_FORMATS:
            raise ValueError(f"delta_format must be one of {lora.DELTA_FORMATS}, got {self.delta_format!r}")
        unknown = set(self.full) - set(lora.TARGETS) - {"norm"}
        if unknown:
            raise ValueError(f"unknown full-rank targets {sorted(unknown)}; known: {', '.join(lora.TARGETS)}, norm")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def token_stream(tokenizer, corpus: str, split: str) -> torch.Tensor:
    """All documents of a split, tokenised and joined with the end-of-text token."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in documents(corpus, split):
        ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def train_adapter(model, tokenizer, recipe: FinetuneRecipe, out: Path, metadata: dict[str, str],
                  device: str = "cpu", on_step: Callable[[int, float], None] | None = None,
                  stream: torch.Tensor | None = None) -> dict:
    """Fine-tune ``model`` (modified in place) per ``recipe``; save the adapter to ``out``.

    On CUDA the forward runs under bf16 autocast (the adapter's parameters stay fp32).
    ``on_step(step, loss)`` runs after every optimiser step (e.g. to watch drift while training);
    it must leave the model's weights alone. ``stream`` replaces the corpus's training tokens.
    """
    torch.manual_seed(recipe.seed)
    if stream is None:
        stream = token_stream(tokenizer, recipe.corpus, "train")
    if len(stream) <= recipe.seq_len:
        raise ValueError(f"{len(stream)} training tokens cannot fill a {recipe.seq_len}-token sequence")
    generator = torch.Generator().manual_seed(recipe.seed)
    wrapped = lora.attach(model, recipe.rank, recipe.alpha, recipe.seed, full=recipe.full)
    model.to(device)
    full = lora.unfreeze_full(model, recipe.full, recipe.full_layers)
    low_rank = [p for layer in wrapped.values() for p in (layer.lora_a, layer.lora_b)]
    groups = [{"params": low_rank, "lr": recipe.lr}] if low_rank else []
    if full:
        groups.append({"params": [p for p, _ in full.values()], "lr": recipe.full_lr})
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(recipe.steps), desc=f"fine-tune {recipe.corpus}", unit="step")
    for step in bar:
        starts = torch.randint(0, len(stream) - recipe.seq_len, (recipe.batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + recipe.seq_len] for s in starts.tolist()]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if on_step is not None:
            on_step(step + 1, losses[-1])
            model.train()
    model.eval()
    meta = dict(metadata, recipe=recipe.to_json(), final_loss=f"{sum(losses[-10:]) / len(losses[-10:]):.4f}")
    lora.save_adapter(out, wrapped, meta, full, recipe.delta_format)
    return {
        "tokens": recipe.steps * recipe.batch_size * recipe.seq_len,
        "seconds": time.perf_counter() - start,
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
    }
