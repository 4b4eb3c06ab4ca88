"""vLLM's cache_salt on the LMCache route: LMCacheCpuConnector and LMCacheGpuConnector tag a salted request's
LMCache configs before LMCache reads them (its own reader, on vLLM's own request objects); a client's tag is
never trusted."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

from lmcache.integration.vllm.utils import extract_request_configs_from_sampling_params as lmcache_configs  # noqa: E402
from lmcache.integration.vllm.vllm_v1_adapter import RequestTracker  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from scd_store.adapters.vllm.lmcache_cpu import SALT_CONFIG, LMCacheCpuConnector, salt_tag, tag_cache_salt  # noqa: E402
from scd_store.adapters.vllm.lmcache_gpu import LMCacheGpuConnector  # noqa: E402


def request(salt: str | None = None, transfer: dict | None = None) -> Request:
    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    return Request("r-1", [1, 2, 3], SamplingParams(max_tokens=4, extra_args=extra), None, cache_salt=salt)


def test_a_salted_request_carries_its_salt_tag_and_a_clients_tag_is_overwritten():
    sent = {"lmcache.tag.tenant": "acme", SALT_CONFIG: salt_tag("victim")}  # a client copying another salt's tag
    salted = request("mine", dict(sent))
    tag_cache_salt(salted)
    assert lmcache_configs(salted.sampling_params) == {"lmcache.tag.tenant": "acme", SALT_CONFIG: salt_tag("mine")}
    assert salt_tag("mine") != salt_tag("victim") and len(salt_tag("mine")) == 32 and "mine" not in salt_tag("mine")
    bare = request("mine")  # no kv_transfer_params at all
    tag_cache_salt(bare)
    assert lmcache_configs(bare.sampling_params) == {SALT_CONFIG: salt_tag("mine")}


def test_an_unsalted_request_loses_a_client_sent_salt_tag_and_is_otherwise_untouched():
    forged = request(None, {SALT_CONFIG: salt_tag("victim"), "lmcache.tag.tenant": "acme"})
    original = forged.sampling_params.extra_args["kv_transfer_params"]
    tag_cache_salt(forged)
    assert lmcache_configs(forged.sampling_params) == {"lmcache.tag.tenant": "acme"}
    assert SALT_CONFIG in original  # the client's object is replaced, not mutated
    plain = request(None, {"lmcache.tag.tenant": "acme"})
    before = plain.sampling_params.extra_args
    tag_cache_salt(plain)
    assert plain.sampling_params.extra_args is before
    empty = request("")  # vLLM treats an empty salt as none
    tag_cache_salt(empty)
    assert lmcache_configs(empty.sampling_params) is None


class Recorder:
    """Stands for LMCache's connector implementation: what its configs reader sees when each hook runs."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict | None]] = []

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        self.seen.append(("lookup", lmcache_configs(req.sampling_params)))
        return 0

    def update_state_after_alloc(self, req, num_external_tokens):
        self.seen.append(("alloc", lmcache_configs(req.sampling_params)))


@pytest.mark.parametrize("connector_class", [LMCacheCpuConnector, LMCacheGpuConnector])
def test_the_connector_tags_before_lmcaches_lookup_and_its_request_tracker_read_the_configs(connector_class):
    connector = object.__new__(connector_class)  # the scheduler-side hooks only
    connector._lmcache_engine = recorder = Recorder()
    salted = request("tenant-secret", {SALT_CONFIG: "forged"})
    assert connector.get_num_new_matched_tokens(salted, 0) == (0, False)
    connector.update_state_after_alloc(salted, None, 0)
    want = {SALT_CONFIG: salt_tag("tenant-secret")}
    assert recorder.seen == [("lookup", want), ("alloc", want)]
    # the tracker LMCache builds for the worker's stores reads the scheduled request's configs
    new = NewRequestData.from_request(salted, ([0],))
    tracker = RequestTracker.from_new_request(LMCacheEngineConfig.from_defaults(chunk_size=16), new, 3, 0, False)
    assert tracker.request_configs == want


def test_the_connector_tags_salts_with_the_tag_the_plugin_refuses():
    from scd_store.adapters.lmcache.identity import SALT_TAG, TAG

    assert SALT_CONFIG == TAG + SALT_TAG
