"""A fine-tune from outside the catalog, as a user would bring it: a short LoRA fine-tune of the producer
on some text, saved both as a merged Hugging Face checkpoint and as a PEFT LoRA adapter (the same
weights), plus held-apart calibration and evaluation text as plain files and JSONL."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from scd_store.adapters.transformers import LoadedModel
from scd_store.models import lora
from scd_store.models.corpora import documents
from scd_store.models.finetune import FinetuneRecipe, token_stream, train_adapter

RECIPE = FinetuneRecipe(corpus="shakespeare", seed=7, rank=8, alpha=16.0, lr=3e-3, seq_len=128, batch_size=2,
                        steps=40, warmup_steps=4, full=())


def write_texts(root: Path) -> dict[str, Path]:
    """Calibration text (a folder of .txt plays) and evaluation text (other plays, as .txt and JSONL)."""
    calib, evaluation = root / "calib-text", root / "eval-text"
    calib.mkdir(parents=True)
    evaluation.mkdir(parents=True)
    for doc in documents("shakespeare", "calib"):
        (calib / f"{doc.name}.txt").write_text(doc.text)
    plays = documents("shakespeare", "eval")
    (evaluation / f"{plays[0].name}.txt").write_text(plays[0].text)
    with open(evaluation / "more.jsonl", "w") as f:
        for doc in plays[1:]:
            f.write(json.dumps({"text": doc.text}) + "\n")
    return {"calib": calib, "eval": evaluation}


def make_finetune(producer: LoadedModel, root: Path) -> dict[str, Path]:
    """Train :data:`RECIPE` on the producer; write ``root/checkpoint`` (merged) and ``root/adapter`` (PEFT)."""
    model = copy.deepcopy(producer.model)
    stream = token_stream(producer.tokenizer, RECIPE.corpus, "train")[:200_000]
    train_adapter(model, producer.tokenizer, RECIPE, root / "adapter.safetensors", {"by": "byo test"}, stream=stream)
    wrapped = {name: module for name, module in model.named_modules() if isinstance(module, lora.LoRALinear)}
    tensors, targets = {}, set()
    for name, module in wrapped.items():
        # the bf16 tensors the project's adapter file holds, so the checkpoint and the adapter agree
        tensors[f"base_model.model.{name}.lora_A.weight"] = module.lora_a.detach().to(torch.bfloat16).float()
        tensors[f"base_model.model.{name}.lora_B.weight"] = module.lora_b.detach().to(torch.bfloat16).float()
        targets.add(name.rsplit(".", 1)[-1])
    adapter = root / "adapter"
    adapter.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RECIPE.rank, "lora_alpha": RECIPE.alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(targets), "base_model_name_or_path": "base"}))
    merged = copy.deepcopy(producer.model)
    lora.merge_adapter(merged, root / "adapter.safetensors", RECIPE.scale)
    checkpoint = root / "checkpoint"
    merged.save_pretrained(str(checkpoint))
    producer.tokenizer.save_pretrained(str(checkpoint))
    return {"checkpoint": checkpoint, "adapter": adapter}
