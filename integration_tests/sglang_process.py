"""SGLang's HiCache backend built by SGLang's own factory in its own OS process, driven over JSON lines.

``python -m integration_tests.sglang_process --model M --bundle B --store-yaml Y`` builds the backend
(``StorageBackendFactory.create_backend("dynamic", ...)`` with ``hicache_storage_pass_prefix_keys``),
registers a host pool and prints ``{"ready": ...}``, then answers:

- ``{"write": {"keys": [...], "prefix": [...], "seed": S}}``: synthetic pages written back as SGLang's
  cache controller does (``batch_set_v1`` with ``prefix_keys``), then drained;
- ``{"prefetch": {"keys": [...], "out": PATH}}``: ``batch_exists`` then ``batch_get_v1`` into the
  host pool; the pages go to ``PATH`` (safetensors, ``[2, L, H, tokens, D]``);
- ``{"exit": true}``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from integration_tests.processes import serve
from integration_tests.sglang_harness import PAGE, HostPool, fill_producer, make_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--store-yaml", required=True)
    parser.add_argument("--page-size", type=int, default=PAGE, help="the engine's page size (hashing)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    backend = make_backend(args.model, args.bundle, args.store_yaml)
    pool = HostPool("layer_first")
    pool.page_size = args.page_size
    try:
        backend.register_mem_pool_host(pool)
    except Exception as exc:  # SGLang fails to start the cache then; report it and stop
        print(json.dumps({"ready": args.model, "error": str(exc)}), flush=True)
        backend.close()
        os._exit(0)
    print(json.dumps({"ready": args.model}), flush=True)

    def write(c: dict) -> dict:
        fill_producer(pool, host_base=0, seed=c["seed"], pages=len(c["keys"]), first_page=len(c["prefix"]))
        done = backend.batch_set_v1(c["keys"], torch.arange(len(c["keys"]) * PAGE),
                                    HiCacheStorageExtraInfo(prefix_keys=c["prefix"]))
        return {"queued": all(done), "drained": backend.drain(timeout=60)}

    def prefetch(c: dict) -> dict:
        pool.kv_buffer.zero_()
        hit = backend.batch_exists(c["keys"])
        got = backend.batch_get_v1(c["keys"][:hit], torch.arange(hit * PAGE)) if hit else []
        pages = torch.cat([pool.state_tokens(p * PAGE) for p in range(hit)], dim=3) if hit else torch.zeros(0)
        save_file({"pages": pages.contiguous()}, c["out"])
        return {"hit": hit, "got": sum(got)}

    serve({"write": write, "prefetch": prefetch}, backend.close)


if __name__ == "__main__":
    main()
