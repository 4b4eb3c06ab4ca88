"""Each model family through the product path: small random-init checkpoints on disk (with the producer's
tokenizer), calibrated on text files and measured by ``bench quality`` on other text, as a user would.

Structural: random models say nothing about quality; the run must complete and report finite numbers
for the real payload of each family's geometry and rotation.
"""

from __future__ import annotations

import pytest
import torch

from scd_store.adapters.transformers.calibration import CalibrationConfig, calibrate
from scd_store.bench.quality import QualityConfig, run_quality
from scd_store.models.corpora import documents
from scd_store.models.user_text import UserText
from tests.adapters.transformers.test_families import FAMILIES, fine_tune_of

pytestmark = pytest.mark.slow
VOCAB = 49152  # the producer's tokenizer


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-text")
    (root / "calib").mkdir()
    (root / "eval").mkdir()
    for i, doc in enumerate(documents("shakespeare", "calib")[:2]):
        (root / "calib" / f"{i}.txt").write_text(doc.text[:60_000])
    (root / "eval" / "play.txt").write_text(documents("shakespeare", "eval")[0].text[:30_000])
    return UserText((str(root / "calib"),)), (str(root / "eval"),)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_calibrates_and_measures_from_checkpoint_directories(family, texts, producer, tmp_path):
    import transformers

    config = FAMILIES[family]()
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    for name, model in (("base", base), ("tuned", fine_tune_of(base))):
        model.save_pretrained(str(tmp_path / name))
        producer.tokenizer.save_pretrained(str(tmp_path / name))
    calib_text, eval_text = texts
    small = CalibrationConfig(basis_windows=4, prefix_tokens=64, continuation_tokens=8)
    report = calibrate(str(tmp_path / "base"), [f"tuned={tmp_path / 'tuned'}"], tmp_path / "bundle", steps=3,
                       windows=3, base_config=small, text=calib_text, progress=False)
    entry = report["bundles"][str(tmp_path / "bundle")]
    assert entry["consumers"]["tuned"]["steps"] == 3 and entry["payload_ratio"] < 0.3
    quality = run_quality(QualityConfig(f"tuned={tmp_path / 'tuned'}", producer=str(tmp_path / "base"),
                                        text=eval_text, windows=2, prefix_tokens=64, continuation_tokens=8,
                                        methods=("oracle", "raw", "rot2"), bundles=(str(tmp_path / "bundle"),),
                                        no_map=True, anchor_map=str(tmp_path / "bundle")),
                          progress=False)
    methods = {m["name"]: m for m in quality.methods}
    assert set(methods) == {"oracle", "raw", "rot2", "raw+map", "rot2+map", "scd", "scd/no-map"}
    assert methods["oracle"]["kl"] == 0
    assert methods["scd/no-map"]["payload_ratio"] == methods["scd"]["payload_ratio"]
    assert methods["rot2+map"]["payload_ratio"] == methods["rot2"]["payload_ratio"]
    assert {(p["a"], p["b"]) for p in quality.paired} == {("scd", "raw"), ("scd", "rot2"), ("scd", "raw+map"),
                                                          ("scd", "rot2+map"), ("scd", "scd/no-map")}
    ci = methods["scd"]["intervals"]["kl"]
    assert ci["low"] <= methods["scd"]["kl"] <= ci["high"] and ci["n"] == 2
    assert all(torch.isfinite(torch.tensor([m["kl"], m["ppl"]])).all() for m in methods.values())
    assert methods["scd"]["payload_ratio"] < 0.35 < methods["raw"]["payload_ratio"]  # 4 raw sinks in 64 tokens
