"""An engine's worker talking to a real ``lmcache server``, in its own OS process, through LMCache's
own multiprocess client code (``ServerBenchClient``: the server-driven transfer over POSIX shared
memory, vLLM's paged KV layout ``(2, blocks, block_size, heads, head_dim)`` per layer, on CPU).

``python -m integration_tests.lmcache_mp_client --rpc-url U --http-url H --model M`` prints
``{"ready": M}``, then answers one JSON command per line:

- ``{"store": {"seq": S, "seed": K, "start": T0, "count": N}}``: the request of sequence ``S`` (64
  tokens) with synthetic producer KV (``tests.bundles.correlated_state``) in its blocks, ``N`` tokens
  stored from token ``T0`` (default: all from 0);
- ``{"retrieve": {"seq": S, "out": PATH, "wait_s": W, "want": N}}``: lookup (retried for up to ``W``
  s until ``N`` chunks hit: the server's L2 fills asynchronously) and retrieve; the request's KV
  goes to ``PATH`` (``[2, L, T, H, D]``);
- ``{"exit": true}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from integration_tests.processes import serve  # noqa: E402
from tests.bundles import LAYOUT, correlated_state  # noqa: E402

TOKENS, BLOCK = 64, 16
SHAPE_SPEC = f"(2,64,{BLOCK},{LAYOUT.kv_heads},{LAYOUT.head_dim}):float16:{LAYOUT.num_layers}"


def producer_kv(seed: int) -> torch.Tensor:
    """``[2, L, T, H, D]`` fp16 synthetic KV of a 64-token request."""
    state = correlated_state(TOKENS, seed=seed)
    return torch.stack([state.keys, state.values]).permute(0, 1, 3, 2, 4).half()


def block_rows(request, tokens: int) -> torch.Tensor:
    """The (block, offset) of each token of ``request``, as flat rows of a ``(blocks * BLOCK)`` view."""
    t = torch.arange(tokens)
    return (request.block_offset + t // BLOCK) * BLOCK + t % BLOCK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rpc-url", required=True)
    parser.add_argument("--http-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--transfer-mode", default="lmcache_driven")
    parser.add_argument("--cache-salt", default="", help="the tenant salt every key of this engine carries")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lmcache.cli.commands.bench.server_bench import helpers
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    helpers._MODEL_NAME = args.model  # the engine's model name in its keys and its registration
    helpers._INSTANCE_ID_BASE = 1000 + os.getpid() % 100_000  # one server registration per engine process
    if args.cache_salt:
        import dataclasses

        make_key = helpers._make_key
        helpers._make_key = lambda *a, **k: dataclasses.replace(make_key(*a, **k), cache_salt=args.cache_salt)
    config = BenchConfig(rpc_url=args.rpc_url, http_url=args.http_url, mode="cpu", transfer_mode=args.transfer_mode,
                         tp_size=1, use_mla=False, num_tokens=TOKENS - 1, kvcache_shape_spec=SHAPE_SPEC,
                         num_blocks=64, block_size=BLOCK)
    client = ServerBenchClient(config, log=lambda line: None)
    client.start()
    caches = client._workers[0].kv_caches  # layer name -> (2, blocks, BLOCK, heads, dim)
    layers = [caches[f"layer.{i}"] for i in range(LAYOUT.num_layers)]
    print(json.dumps({"ready": args.model}), flush=True)

    def store(c: dict) -> dict:
        request = client.create_request(c["seq"], f"store-{c['seq']}-{time.monotonic_ns()}", "store")
        kv, rows = producer_kv(c["seed"]), block_rows(request, TOKENS)
        for i, layer in enumerate(layers):
            layer.view(2, -1, LAYOUT.kv_heads, LAYOUT.head_dim)[:, rows] = kv[:, i]
        start = c.get("start", 0)
        result = client.store(request, start, c.get("count", TOKENS - start))
        client.end_session(request)
        return {"stored": bool(result and result.succeeded)}

    def retrieve(c: dict) -> dict:
        for layer in layers:
            layer.zero_()
        deadline = time.monotonic() + c.get("wait_s", 0)
        while True:
            request = client.create_request(c["seq"], f"get-{c['seq']}-{time.monotonic_ns()}", "retrieve")
            hit = client.lookup(request).hit_chunks
            if hit >= c.get("want", 1) or time.monotonic() > deadline:
                break
            client.end_session(request)
            time.sleep(0.2)
        ok = bool(hit) and client.retrieve(request, 0, hit * BLOCK).succeeded
        client.end_session(request)
        rows = block_rows(request, TOKENS)
        got = torch.stack([layer.view(2, -1, LAYOUT.kv_heads, LAYOUT.head_dim)[:, rows] for layer in layers], 1)
        save_file({"kv": got.contiguous()}, c["out"])
        return {"hit_chunks": hit, "retrieved": ok}

    serve({"store": store, "retrieve": retrieve}, client.close)


if __name__ == "__main__":
    main()
