"""The vLLM server tests' material and checks: a PEFT LoRA adapter of the producer, a quick bundle,
scd-store's own transformers decode path to compare the servers with, the deployment's hit count and
counters, and a server's own prefix-cache hits.

The adapter is a structural consumer (random low-rank updates of the attention projections, no
training): vLLM serves it by name on the base model's server, and the bundle's pair for it is
distilled on the merged weights, as a user's adapter would be.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file

from scd_store.adapters.transformers import LoadedModel, greedy_logprobs
from scd_store.adapters.transformers.calibration import CalibrationConfig, distil_decoder, fit_space
from scd_store.codecs.kv_state import KVState
from scd_store.codecs.scd.bundle import save_pair, save_space
from scd_store.models import catalog
from scd_store.models.fingerprint import tensors_fingerprint

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUICK = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8, distill_windows=4,
                          distill_steps=4)


def make_lora_adapter(producer: LoadedModel, directory: Path, name: str, *, rank: int = 8, alpha: float = 16.0,
                      seed: int = 0, scale: float = 0.02) -> LoadedModel:
    """Write a PEFT LoRA adapter of ``producer`` to ``directory``; return the merged model named ``name``."""
    generator = torch.Generator().manual_seed(seed)
    merged = copy.deepcopy(producer.model)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in merged.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            continue
        a = torch.randn(rank, module.in_features, generator=generator) * scale
        b = torch.randn(module.out_features, rank, generator=generator) * scale
        with torch.no_grad():
            module.weight += (alpha / rank) * b @ a
        tensors[f"base_model.model.{module_name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module_name}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(TARGETS), "base_model_name_or_path": catalog.PRODUCER}))
    return LoadedModel(name, merged, producer.tokenizer, tensors_fingerprint(merged.state_dict()))


def quick_bundle(producer: LoadedModel, consumers: list[LoadedModel], path: Path, space_id: str) -> Path:
    """A bundle with a quickly fitted space and a briefly distilled decoder per consumer (structure, not quality)."""
    space = fit_space(producer, ["shakespeare"], QUICK, space_id, progress=False)
    save_space(path, space, extra={"producer": catalog.PRODUCER})
    for consumer in consumers:
        decoder, _ = distil_decoder(producer, consumer, space, "shakespeare", QUICK, progress=False)
        save_pair(path, decoder)
    return path


def reference(model: torch.nn.Module, state: KVState, tail: list[int], new: int) -> tuple[list[int], list[float]]:
    """scd-store's transformers path: greedy tokens after the decoded prefix, and their log-probabilities."""
    return greedy_logprobs(model, state, torch.tensor(tail), new)


def hit_tokens(redis_url: str) -> int:
    """Hit tokens of every pair, as ``scd-store stats`` reports them from the deployment's Redis."""
    out = subprocess.run([sys.executable, "-m", "scd_store.cli.main", "stats", "--redis", redis_url, "--json"],
                         capture_output=True, text=True, check=True)
    return sum(row["hit_tokens"] for row in json.loads(out.stdout)["summary"]["pairs"])


def settled_hits(redis_url: str, before: int, expect: int, timeout: float = 10.0) -> int:
    """Hit tokens added since ``before`` once the servers' counters have flushed (every second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and hit_tokens(redis_url) - before < expect:
        time.sleep(0.5)
    time.sleep(1.5)  # one more flush: nothing beyond ``expect`` may arrive late
    return hit_tokens(redis_url) - before


def counter(redis_url: str, name: str, **labels: str) -> int:
    """A counter's total over the deployment's processes (from its stats in Redis), of the given labels only."""
    from scd_store.store.stats_sinks import read_redis_stats

    return sum(int(c["value"]) for c in read_redis_stats(redis_url).get("counters", [])
               if c["name"] == name and all(c.get(k) == v for k, v in labels.items()))


def prefix_cache_hits(server_url: str) -> float:
    """Tokens a vLLM server's own prefix cache has served (``vllm:prefix_cache_hits_total`` on ``/metrics``)."""
    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True
