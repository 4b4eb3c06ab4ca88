"""scd-store inside vLLM: a native v1 KV connector (:mod:`scd_store.adapters.vllm.connector`)."""
