"""A small real calibration: code space + distilled decoder on the real pair, bundle round trip."""

import pytest
import torch

from scd_store.adapters.transformers import continue_with_prefix, prefill_capture
from scd_store.adapters.transformers.calibration import CalibrationConfig, Recipe, distil_decoder, fit_space
from scd_store.bench.quality import load_scd_codec
from scd_store.codecs.scd.bundle import BundleError, load_space, save_pair, save_space
from scd_store.models.windows import eval_windows

pytestmark = pytest.mark.slow


def test_small_calibration_round_trip(producer, shakespeare, tmp_path):
    config = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8,
                               distill_windows=4, distill_steps=6)
    space = fit_space(producer, ["shakespeare"], config, "it-space", progress=False)
    assert abs(space.payload_ratio() - 0.25) < 0.01
    decoder, stats = distil_decoder(producer, shakespeare, space, "shakespeare", config, progress=False)
    assert stats["steps"] == 6 and stats["kl_last"] is not None and stats["device"] == "cpu"
    save_space(tmp_path, space)
    save_pair(tmp_path, decoder)
    codec = load_scd_codec(tmp_path, producer, shakespeare)

    window = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 80, seed=9)[0]
    produced, _ = prefill_capture(producer.model, window[:64])
    payload = codec.encode(produced)
    assert len(payload) < 0.3 * produced.fp16_bytes()
    decoded = codec.decode(payload)
    assert decoded.keys.shape == produced.keys.shape
    assert torch.equal(decoded.keys[:, :, :4], produced.keys[:, :, :4].half().float())  # sinks raw
    logits = continue_with_prefix(shakespeare.model, decoded, window[64:])
    assert torch.isfinite(logits).all()

    with pytest.raises(BundleError, match="producer"):
        load_space(tmp_path, producer_fingerprint=shakespeare.fingerprint)


def test_small_patch_calibrations(producer, shakespeare, tmp_path):
    from scd_store.adapters.transformers.calibration.patch_select import choose_patch_layers, layer_gains

    window = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 72, seed=11, split="calib")
    gains = layer_gains(producer.model, shakespeare.model, window, prefix_tokens=64)
    assert len(gains) == 30 and max(gains) > 0
    layers = choose_patch_layers([gains], 2)
    assert len(layers) == 2 and all(gains[i] >= sorted(gains)[-2] for i in layers)

    config = CalibrationConfig(budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8,
                               distill_windows=4, distill_steps=4, patch_layers=2, recipe=Recipe(patch_units=16))
    space = fit_space(producer, ["shakespeare"], config, "it-patch", progress=False, patch_layers=layers)
    assert space.patch_layers == layers and space.payload_ratio() > 0.25  # H_in is wider than K + V
    decoder, _ = distil_decoder(producer, shakespeare, space, "shakespeare", config, progress=False)
    assert [(p.layer, p.source) for p in decoder.patches] == [(layers[0], "hidden"), (layers[1], "hidden")]
    save_space(tmp_path, space)
    save_pair(tmp_path, decoder)
    codec = load_scd_codec(tmp_path, producer, shakespeare)
    test = eval_windows(shakespeare.tokenizer, "shakespeare", 1, 80, seed=9)[0]
    produced, _ = prefill_capture(producer.model, test[:64], hidden_layers=layers)
    payload = codec.encode(produced)
    decoded = codec.decode(payload)
    # the patched layers' K / V are regenerated per token from the coded H_in (their groups carry no bits)
    for layer in layers:
        v = decoded.values[layer, :, 4:]
        assert torch.isfinite(v).all() and v.std(dim=1).mean() > 0.1 * produced.values[layer, :, 4:].std(dim=1).mean()
    del produced.hidden[layers[0]]
    with pytest.raises(ValueError, match="capture H_in"):
        codec.encode(produced)

    kv_space = fit_space(producer, ["shakespeare"], CalibrationConfig(
        budget=0.25, basis_windows=3, prefix_tokens=64, continuation_tokens=8, patch_source="kv"), "it-kv",
        progress=False, patch_layers=layers)
    assert kv_space.patch_layers == ()  # the kv variant adds nothing to the payload
    kv_decoder, _ = distil_decoder(producer, shakespeare, kv_space, "shakespeare", config, progress=False,
                                   patch_layers=layers)
    assert [p.source for p in kv_decoder.patches] == ["kv", "kv"]


def test_calibrate_sweep_writes_one_bundle_per_combination(producer, shakespeare, tmp_path):
    from scd_store.adapters.transformers.calibration import calibrate

    small = CalibrationConfig(basis_windows=2, prefix_tokens=64, continuation_tokens=8, distill_windows=3,
                              distill_steps=2, recipe=Recipe(selection_windows=1, patch_units=8))
    report = calibrate("smollm2-135m-instruct", ["smollm2-135m-shakespeare"], tmp_path, budget=[0.12, 0.25],
                       patch_layers=[0, 2], base_config=small)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b0.12-k0", "b0.12-k2", "b0.25-k0", "b0.25-k2"]
    ratios = {name: entry["payload_ratio"] for name, entry in report["bundles"].items()}
    assert ratios[str(tmp_path / "b0.12-k0")] < ratios[str(tmp_path / "b0.25-k0")] < ratios[str(tmp_path / "b0.25-k2")]
    ranking = report["patch_ranking"]["layers"]
    for budget in ("0.12", "0.25"):
        space = load_space(tmp_path / f"b{budget}-k2")
        assert space.patch_layers == tuple(sorted(ranking))
        codec = load_scd_codec(tmp_path / f"b{budget}-k2", producer, shakespeare)
        assert [p.source for p in codec.decoder.patches] == ["hidden", "hidden"]
    # a consumer added later to one of them keeps its space (stored codes stay valid)
    before = load_space(tmp_path / "b0.25-k0").fingerprint
    calibrate("smollm2-135m-instruct", ["smollm2-135m-shakespeare"], tmp_path / "b0.25-k0", budget=0.25,
              reuse_space=True, base_config=small)
    assert load_space(tmp_path / "b0.25-k0").fingerprint == before


def test_patch_layers_can_be_named_instead_of_measured(producer, shakespeare, tmp_path):
    from scd_store.adapters.transformers.calibration import calibrate

    small = CalibrationConfig(basis_windows=2, prefix_tokens=64, continuation_tokens=8, distill_windows=2,
                              distill_steps=1)
    with pytest.raises(ValueError, match="not both"):
        calibrate("smollm2-135m-instruct", ["smollm2-135m-shakespeare"], tmp_path, patch_layers=2, patch_at=(0,))
    with pytest.raises(ValueError, match="outside"):
        calibrate("smollm2-135m-instruct", ["smollm2-135m-shakespeare"], tmp_path, patch_at=(0, 30), base_config=small)
    report = calibrate("smollm2-135m-instruct", ["smollm2-135m-shakespeare"], tmp_path, patch_at=(1, 0),
                       base_config=small)
    assert "patch_ranking" not in report and load_space(tmp_path).patch_layers == (0, 1)


def test_teacher_logits_cover_every_cut_and_match_the_consumer_on_a_cut_prefix(producer, shakespeare):
    """Distillation cuts prefixes at random lengths: the teacher rows it slices from the one causal
    prefill must be what the consumer predicts after that shorter prefix."""
    from scd_store.adapters.transformers.calibration import collect_teacher

    config = CalibrationConfig(prefix_tokens=64, continuation_tokens=8, distill_windows=2,
                               recipe=Recipe(shortest_prefix=0.5))
    teacher = collect_teacher(producer, shakespeare, "shakespeare", config, progress=False)
    assert teacher.first_cut == 32
    assert teacher.tokens.shape == (2, 72) and teacher.teacher.shape[:2] == (2, 72 - 32)
    cut = 40
    window = teacher.tokens[1]
    own, _ = prefill_capture(shakespeare.model, window[:cut])
    direct = continue_with_prefix(shakespeare.model, own, window[cut:cut + 8])
    sliced = teacher.teacher[1, cut - 32:cut - 32 + 8].float()
    assert torch.allclose(sliced, direct, atol=0.05)  # fp16 storage
    assert direct.argmax(-1).equal(sliced.argmax(-1))
