"""Engine stand-ins in their own OS processes, driven over stdin / stdout with JSON lines (no pickle).

``python -m integration_tests.engine_processes ROLE --settings JSON`` opens the process's scd-store
service exactly as an engine adapter does (:func:`acquire_service`), prints ``{"ready": ...}`` and
then answers one command per line:

- ``{"put": {"model": M, "tokens": T, "seed": S, "chunk": C}}``: a producer's chunks of synthetic KV
  (``tests.bundles.correlated_state``) submitted like an engine's put, then drained;
- ``{"get": {"model": M, "tokens": T, "chunk": C, "out": PATH}}``: a consumer's lookup and get; the
  decoded KV goes to ``PATH`` as safetensors;
- ``{"exit": true}``: release the service (drains and writes the process's stats) and exit.
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import save_file

from integration_tests.processes import serve
from scd_store.service import EngineSettings, acquire_service, release_service
from scd_store.store.keys import chunk_hashes
from tests.bundles import correlated_state


def chunks_of(tokens: int, chunk: int, seed: int):
    state = correlated_state(tokens, seed=seed)
    return [type(state)(state.keys[:, :, i:i + chunk].contiguous(), state.values[:, :, i:i + chunk].contiguous(),
                        start=i) for i in range(0, tokens - tokens % chunk, chunk)]


def token_ids(tokens: int) -> list[int]:
    return list(range(1000, 1000 + tokens))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role")
    parser.add_argument("--settings", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    service = acquire_service(EngineSettings.from_mapping(json.loads(args.settings)))
    print(json.dumps({"ready": args.role, "models": service.models()}), flush=True)

    def put(c: dict) -> dict:
        parts = chunks_of(c["tokens"], c["chunk"], c["seed"])
        hashes = chunk_hashes(token_ids(c["tokens"]), c["chunk"])
        queued = service.submit_put(c["model"], hashes, lambda: parts)
        return {"queued": queued, "drained": service.drain(timeout=60)}

    def get(c: dict) -> dict:
        hashes = chunk_hashes(token_ids(c["tokens"]), c["chunk"])
        found = service.contains(c["model"], hashes, tokens=len(hashes) * c["chunk"])
        states = service.get(c["model"], hashes)
        if states:
            save_file({"keys": torch.cat([s.keys for s in states], 2).contiguous(),
                       "values": torch.cat([s.values for s in states], 2).contiguous()}, c["out"])
        by_tier = {t.name: service.store.stats.value("hit_chunks", tier=t.name) for t in service.store.tiers}
        return {"found": found, "chunks": len(states), "starts": [s.start for s in states], "hits_by_tier": by_tier}

    serve({"put": put, "get": get}, lambda: release_service(service))


if __name__ == "__main__":
    main()
