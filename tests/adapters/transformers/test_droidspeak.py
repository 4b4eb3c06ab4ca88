import pytest
import torch

from scd_store.adapters.transformers import prefill_capture
from scd_store.adapters.transformers.droidspeak import DroidSpeakCodec, LayerGroup, recompute_group, select_group
from scd_store.codecs.tensor_pack import PayloadError
from tests.conftest import tiny_llama


def test_recomputing_a_group_from_the_models_own_residual_reproduces_its_kv(tiny_model, device):
    ids = torch.randint(0, 128, (20,), device=device)
    state, _ = prefill_capture(tiny_model, ids, residual_layers=[1])
    keys, values = recompute_group(tiny_model, state.residual[1], LayerGroup(1, 3))
    torch.testing.assert_close(keys, state.keys[1:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, state.values[1:3], atol=1e-5, rtol=1e-5)
    # the model is left whole
    assert len(tiny_model.model.layers) == 3


def test_codec_mixes_producer_kv_with_the_consumers_recomputed_group():
    producer, consumer = tiny_llama(seed=0), tiny_llama(seed=1)
    ids = torch.randint(0, 128, (24,))
    produced, _ = prefill_capture(producer, ids, residual_layers=[1])
    codec = DroidSpeakCodec(consumer, LayerGroup(1, 2))
    payload = codec.encode(produced)
    # payload: two raw layers and one residual, in fp16
    assert len(payload) > 2 * produced.keys[0].numel() * 2 * 2 + produced.residual[1].numel() * 2
    state = codec.decode(payload)
    for layer in (0, 2):
        torch.testing.assert_close(state.keys[layer], produced.keys[layer], atol=1e-2, rtol=1e-2)
    expected_keys, _ = recompute_group(consumer, produced.residual[1], LayerGroup(1, 2))
    torch.testing.assert_close(state.keys[1], expected_keys[0], atol=1e-2, rtol=1e-2)
    assert (state.keys[1] - produced.keys[1]).abs().max() > 0.1  # really the consumer's, not the producer's


def test_codec_refuses_states_without_the_residual_and_foreign_payloads():
    consumer = tiny_llama(seed=1)
    state, _ = prefill_capture(consumer, torch.randint(0, 128, (8,)))
    with pytest.raises(ValueError, match="residual entering layer 1"):
        DroidSpeakCodec(consumer, LayerGroup(1, 2)).encode(state)
    state, _ = prefill_capture(consumer, torch.randint(0, 128, (8,)), residual_layers=[0])
    payload = DroidSpeakCodec(consumer, LayerGroup(0, 1)).encode(state)
    with pytest.raises(PayloadError, match="recomputes layers"):
        DroidSpeakCodec(consumer, LayerGroup(1, 2)).decode(payload)
    with pytest.raises(ValueError, match="exceeds"):
        DroidSpeakCodec(consumer, LayerGroup(2, 4))


def test_group_selection_prefers_the_group_that_matters():
    producer, consumer = tiny_llama(seed=0), tiny_llama(seed=0)
    with torch.no_grad():  # the consumer differs from the producer only in layer 2's value projection
        consumer.model.layers[2].self_attn.v_proj.weight.mul_(3.0)
    windows = [torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    group, kl = select_group(producer, consumer, windows, prefix_tokens=16, size=1)
    assert group == LayerGroup(2, 3)
    assert kl[2] < 1e-6 < min(kl[0], kl[1])
