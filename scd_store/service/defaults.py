"""The service's defaults, defined once: the engine settings (:mod:`scd_store.service.settings`) and
:class:`~scd_store.service.kv_service.KVService` both take them from here."""

from __future__ import annotations

PUT_QUEUE_CHUNKS = 256  # chunks a producer may have waiting to be encoded; more are dropped and counted
PUT_QUEUE_BYTES = 2 << 30  # bytes of the engine's KV those chunks may hold (pinned host memory on a GPU)
LOOKUP_DEADLINE_S = 2.0  # vLLM: how long a new consumer request may wait for its lookup before it computes its prompt
LOAD_WORKERS = 0  # vLLM: fetch threads for asynchronous loads (0: derived from the engine's max_num_seqs)
LOAD_DEADLINE_S = 5.0  # vLLM: how long an asynchronous load may take, queued and running, before it is recomputed
GET_DEADLINE_S = 5.0  # how long a consumer's get may decode before it returns what it has
DISCOVERY_INTERVAL_S = 2.0  # how often unbound models are looked up in the registry (0: never)
MAX_POSITIONS = 32768  # the engine's context length when it does not say
MODEL_TAG = "scd_model"  # LMCache: the request tag naming the adapter a request reads as
DECODE_DEVICE = "cpu"  # LMCache / SGLang: where codes are decoded before the engine copies the KV in
