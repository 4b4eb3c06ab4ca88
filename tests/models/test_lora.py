import pytest
import torch

from scd_store.models import lora
from tests.conftest import tiny_llama


def test_merged_adapter_equals_the_adapted_model(tmp_path):
    adapted = tiny_llama(seed=0)
    wrapped = lora.attach(adapted, rank=4, alpha=8.0, seed=0)
    assert set(name.rsplit(".", 1)[-1] for name in wrapped) == set(lora.TARGETS)
    with torch.no_grad():
        for layer in wrapped.values():
            layer.lora_b.normal_(std=0.05)
            # round through bf16 as the saved adapter does, so both sides see the same numbers
            layer.lora_a.copy_(layer.lora_a.bfloat16().float())
            layer.lora_b.copy_(layer.lora_b.bfloat16().float())
    path = tmp_path / "adapter.safetensors"
    lora.save_adapter(path, wrapped, {"note": "test"})

    merged = tiny_llama(seed=0)
    assert lora.merge_adapter(merged, path, scale=2.0) == len(wrapped)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        assert (merged(input_ids=ids).logits - tiny_llama(seed=0)(input_ids=ids).logits).abs().max() > 1e-3


def test_only_adapter_parameters_train():
    model = tiny_llama()
    wrapped = lora.attach(model, rank=2, alpha=4.0, seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    assert len(trainable) == 2 * len(wrapped)


def test_full_rank_deltas_merge_with_the_low_rank_part(tmp_path):
    adapted = tiny_llama(seed=0)
    wrapped = lora.attach(adapted, rank=2, alpha=4.0, seed=0, full=("k_proj", "v_proj", "norm"))
    assert not any(name.endswith(("k_proj", "v_proj")) for name in wrapped)
    full = lora.unfreeze_full(adapted, ("k_proj", "v_proj", "norm"))
    assert any(name.endswith("input_layernorm.weight") for name in full)
    assert any(name.endswith("self_attn.k_proj.weight") for name in full)
    with torch.no_grad():
        for layer in wrapped.values():
            layer.lora_b.copy_((torch.randn_like(layer.lora_b) * 0.05).bfloat16().float())
        for param, initial in full.values():
            param.copy_(initial + (torch.randn_like(param) * 0.05).bfloat16().float())
    path = tmp_path / "adapter.safetensors"
    lora.save_adapter(path, wrapped, {"note": "test"}, full)

    merged = tiny_llama(seed=0)
    assert lora.merge_adapter(merged, path, scale=2.0) == len(wrapped) + len(full)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=2e-3, rtol=2e-3)


def test_full_rank_targets_can_stop_at_the_first_layers():
    model = tiny_llama(seed=0, layers=3)
    lora.attach(model, rank=0, alpha=1.0, seed=0)
    targets = (*lora.TARGETS, "norm")
    full = lora.unfreeze_full(model, targets, first_layers=2)
    layers = {int(name.split(".")[2]) for name in full}
    assert layers == {0, 1}  # layer 2, the final norm and the embeddings stay frozen
    assert len(full) == 2 * (len(lora.TARGETS) + 2)  # every linear and both norms of each layer
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(full)
    assert len(lora.unfreeze_full(tiny_llama(seed=0, layers=3), targets)) == 3 * (len(lora.TARGETS) + 2) + 1
    with pytest.raises(ValueError, match="3 decoder layers"):
        lora.unfreeze_full(tiny_llama(seed=0, layers=3), targets, first_layers=4)


def test_full_layers_needs_full_rank_targets():
    from scd_store.models.finetune import FinetuneRecipe

    with pytest.raises(ValueError, match="full_layers"):
        FinetuneRecipe(corpus="python", full_layers=6)
    assert FinetuneRecipe(corpus="python", rank=0, full=("q_proj",), full_layers=6).full_layers == 6


def test_unknown_full_rank_target_is_refused():
    import pytest

    from scd_store.models.finetune import FinetuneRecipe

    with pytest.raises(ValueError, match="full-rank targets"):
        FinetuneRecipe(corpus="python", full=("q_porj",))


def test_int8_deltas_round_trip_within_a_step_per_row(tmp_path):
    model = tiny_llama(seed=0)
    lora.attach(model, rank=2, alpha=4.0, seed=0, full=("k_proj", "norm"))
    full = lora.unfreeze_full(model, ("k_proj", "norm"))
    with torch.no_grad():
        for param, initial in full.values():
            param.copy_(initial + torch.randn_like(param) * 0.05)
    state = lora.adapter_state({}, full, delta_format="int8")
    assert any(k.endswith(".delta_int8") for k in state) and any(k.endswith("norm.weight.delta") for k in state)
    path = tmp_path / "a.safetensors"
    lora.save_adapter(path, {}, {"note": "int8"}, full, delta_format="int8")
    merged = tiny_llama(seed=0)
    lora.merge_adapter(merged, path, scale=1.0)
    params = dict(merged.named_parameters())
    for name, (param, initial) in full.items():
        if param.dim() == 2:
            step = (param - initial).abs().amax(dim=1, keepdim=True) / 127
            assert ((params[name] - param).abs() <= step * 0.51 + 1e-6).all()


def test_train_adapter_reports_every_step_and_writes_a_mergeable_adapter(tmp_path):
    from scd_store.models.finetune import FinetuneRecipe, train_adapter

    model = tiny_llama(seed=0)
    recipe = FinetuneRecipe("python", seed=3, rank=2, alpha=4.0, lr=1e-2, seq_len=32, batch_size=2, steps=4,
                            warmup_steps=1)
    seen = []
    stream = torch.randint(0, 128, (512,), generator=torch.Generator().manual_seed(0))
    stats = train_adapter(model, None, recipe, tmp_path / "a.safetensors", {"consumer": "t"},
                          on_step=lambda step, loss: seen.append((step, loss)), stream=stream)
    assert [s for s, _ in seen] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in seen)
    assert stats["tokens"] == 4 * 2 * 32 and not model.training
    merged = tiny_llama(seed=0)
    assert lora.merge_adapter(merged, tmp_path / "a.safetensors", recipe.scale) > 0


def test_train_adapter_refuses_a_stream_shorter_than_a_sequence(tmp_path):
    import pytest

    from scd_store.models.finetune import FinetuneRecipe, train_adapter

    recipe = FinetuneRecipe("python", rank=2, seq_len=32, steps=1)
    with pytest.raises(ValueError, match="cannot fill a 32-token sequence"):
        train_adapter(tiny_llama(), None, recipe, tmp_path / "a.safetensors", {}, stream=torch.arange(32))
    assert not (tmp_path / "a.safetensors").exists()
