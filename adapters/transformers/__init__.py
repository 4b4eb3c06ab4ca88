"""The Hugging Face transformers runner: producer capture and consumer cache injection."""

from scd_store.adapters.transformers.capture import prefill_capture
from scd_store.adapters.transformers.inject import build_cache, continue_with_prefix, generate_greedy, greedy_logprobs
from scd_store.adapters.transformers.loading import LoadedModel, load_model

__all__ = ["LoadedModel", "build_cache", "continue_with_prefix", "generate_greedy", "greedy_logprobs", "load_model",
           "prefill_capture"]
