"""Engine settings and the process-shared service: what every engine adapter reads."""

from __future__ import annotations

import pytest

from scd_store.service import EngineSettings, SettingsError, acquire_service, release_service
from tests.bundles import PRODUCER, write_tiny_bundle
from tests.conftest import skip_where_the_store_cannot_sign


@pytest.fixture
def bundle(tmp_path):
    write_tiny_bundle(tmp_path / "bundle")
    return tmp_path / "bundle"


def test_settings_read_their_prefix_and_refuse_unknown_keys(bundle):
    settings = EngineSettings.from_mapping({"scd.bundles": f"{bundle}, {bundle}", "scd.aliases": {"b": "a"},
                                            "other.key": 1}, prefix="scd.")
    assert settings.bundles == (str(bundle), str(bundle)) and settings.aliases == (("b", "a"),)
    assert (settings.put_queue_chunks, settings.get_deadline_s, settings.lookup_deadline_s) == (256, 5.0, 2.0)
    assert (settings.models, settings.discovery_interval_s) == (None, 2.0)
    assert EngineSettings.from_mapping({"models": "a, b"}).models == ("a", "b")  # no bundles: the registry's
    assert (settings.register_bundles, settings.max_positions) == (True, 32768)
    assert (settings.load_workers, settings.load_deadline_s) == (0, 5.0)  # 0: derived from the engine
    assert EngineSettings.from_mapping({"load_workers": "4", "load_deadline_s": "0.5"}).load_workers == 4
    read_only = EngineSettings.from_mapping({"register_bundles": "false", "max_positions": "4096"})
    assert (read_only.register_bundles, read_only.max_positions) == (False, 4096)
    with pytest.raises(SettingsError, match=r"unknown scd-store settings \['scd.colour'\]"):
        EngineSettings.from_mapping({"scd.bundles": str(bundle), "scd.colour": "blue"}, prefix="scd.")


@pytest.mark.parametrize("values, match", [
    ({"models": "", "discovery_interval_s": -1}, "discovery_interval_s must be >= 0"),
    ({"models": [""]}, "models must be a list of model names"),
    ({"bundles": ["/nowhere"]}, "not a calibration bundle"),
    ({"bundles": [1]}, "list of paths"),
    ({"aliases": ["a"]}, "aliases must be a mapping"),
    ({"positions": "batch"}, "positions come from the engine"),
    ({"put_queue_chunks": -1}, "put_queue_chunks must be a positive int"),
    ({"get_deadline_s": 0}, "get_deadline_s must be positive"),
    ({"get_deadline_s": "soon"}, "get_deadline_s must be a number"),
    ({"lookup_deadline_s": -1}, "lookup_deadline_s must be positive"),
    ({"load_deadline_s": 0}, "load_deadline_s must be positive"),
    ({"load_workers": -1}, "load_workers must be an int >= 0"),
    ({"load_workers": "many"}, "load_workers must be an int"),
    ({"serves_adapters": "sometimes"}, "serves_adapters must be true or false"),
    ({"model_tag": ""}, "model_tag must be a non-empty string"),
    ({"register_bundles": "maybe"}, "register_bundles must be true or false"),
    ({"max_positions": 0}, "max_positions must be a positive int"),
    ({"max_positions": "long"}, "max_positions must be an int"),
    ({"store_config": "/nowhere.yaml"}, "is not a file"),
])
def test_bad_settings_name_the_problem(bundle, values, match):
    values = {"bundles": [str(bundle)], **values} if "bundles" not in values and values else values
    with pytest.raises(SettingsError, match=match):
        EngineSettings.from_mapping(values)


def test_engines_with_the_same_settings_share_one_service(bundle, tmp_path, monkeypatch):
    skip_where_the_store_cannot_sign()  # the default store's disk tier signs with the host keyring
    monkeypatch.setenv("SCD_STORE_HOME", str(tmp_path / "home"))
    settings = EngineSettings.from_mapping({"bundles": [str(bundle)]})
    first = acquire_service(settings)
    second = acquire_service(settings)
    try:
        assert first is second and first.models()[PRODUCER] == "producer"
    finally:
        release_service(second)
    assert not first.store._closed  # one reference left
    release_service(first)
    assert first.store._closed


def test_absent_keys_take_the_fields_defaults():
    from scd_store.service import defaults

    settings = EngineSettings.from_mapping({})
    assert settings == EngineSettings()
    assert (settings.put_queue_chunks, settings.get_deadline_s, settings.discovery_interval_s) == (
        defaults.PUT_QUEUE_CHUNKS, defaults.GET_DEADLINE_S, defaults.DISCOVERY_INTERVAL_S)
    assert (settings.max_positions, settings.model_tag) == (defaults.MAX_POSITIONS, defaults.MODEL_TAG)


@pytest.mark.parametrize("text, value", [("yes", True), ("ON", True), ("1", True), ("off", False), ("0", False),
                                         (False, False)])
def test_boolean_settings_follow_the_one_rule(text, value):
    settings = EngineSettings.from_mapping({"serves_adapters": text, "register_bundles": text})
    assert (settings.serves_adapters, settings.register_bundles) == (value, value)


def test_service_kwargs_are_the_kvservice_keywords():
    import inspect

    from scd_store.service import KVService

    keywords = {name for name, p in inspect.signature(KVService).parameters.items() if p.kind is p.KEYWORD_ONLY}
    kwargs = EngineSettings.from_mapping({"aliases": {"b": "a"}, "models": "a", "max_positions": 64}).service_kwargs()
    assert set(kwargs) == keywords - {"replace_registrations"}
    assert (kwargs["aliases"], kwargs["models"], kwargs["max_positions"]) == ({"b": "a"}, ("a",), 64)


def test_engines_differing_only_in_adapter_keys_share_a_key():
    plain = EngineSettings.from_mapping({"models": "a"})
    tagged = EngineSettings.from_mapping({"models": "a", "serves_adapters": True, "model_tag": "who"})
    assert plain != tagged and hash(plain.shared_key()) == hash(tagged.shared_key())
    assert plain.shared_key() == tagged.shared_key() == plain
    assert EngineSettings.from_mapping({"models": "b"}).shared_key() != plain.shared_key()


def test_decode_device_is_cpu_or_cuda_and_stays_with_the_adapter():
    assert EngineSettings().decode_device == "cpu"
    assert EngineSettings.from_mapping({"decode_device": " CUDA:1 "}).decode_device == "cuda:1"
    settings = EngineSettings.from_mapping({"decode_device": "cuda"})
    assert "decode_device" not in settings.service_kwargs() and settings.shared_key() == EngineSettings()
    for bad in ("gpu", "cuda:x", "mps", 0):
        with pytest.raises(SettingsError, match="decode_device must be cpu, cuda or cuda:N"):
            EngineSettings.from_mapping({"decode_device": bad})


def test_put_queue_bytes_reads_sizes_and_reaches_the_service():
    assert EngineSettings().put_queue_bytes == 2 << 30
    settings = EngineSettings.from_mapping({"put_queue_bytes": "512MiB"})
    assert settings.put_queue_bytes == 512 << 20 and settings.service_kwargs()["put_queue_bytes"] == 512 << 20
    for bad in ("lots", 0, -5, True):
        with pytest.raises(SettingsError, match="put_queue_bytes must be a positive size|put_queue_bytes must be a "
                                                "size"):
            EngineSettings.from_mapping({"put_queue_bytes": bad})


def test_async_loads_is_on_by_default_and_stays_with_the_adapter():
    assert EngineSettings().async_loads is True
    settings = EngineSettings.from_mapping({"async_loads": "false"})
    assert settings.async_loads is False and "async_loads" not in settings.service_kwargs()
    assert settings.shared_key() == EngineSettings()
