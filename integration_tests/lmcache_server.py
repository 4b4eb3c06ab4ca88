"""A real ``lmcache server`` (LMCache's multiprocess server) on free loopback ports, with scd-store's
L2 adapter, as a context manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from integration_tests.processes import ROOT, stop_process
from scd_store.bench.vllm_server import free_port


class LMCacheServer:
    """``lmcache server`` with ``--l2-adapter`` of type ``plugin`` naming ``ScdL2Adapter``."""

    def __init__(self, work: Path, adapter_params: dict, chunk: int = 16, env: dict | None = None,
                 host: str = "127.0.0.1") -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.rpc_url, self.http_url = f"tcp://127.0.0.1:{self.rpc_port}", f"http://127.0.0.1:{self.http_port}"
        adapter = {"type": "plugin", "module_path": "scd_store.adapters.lmcache.l2_adapter",
                   "class_name": "ScdL2Adapter", "adapter_params": adapter_params}
        self.args = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", host,
                     "--port", str(self.rpc_port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                     "--chunk-size", str(chunk), "--l1-size-gb", "0.1", "--eviction-policy", "LRU",
                     "--supported-transfer-mode", "auto", "--disable-metrics", "--l2-adapter", json.dumps(adapter)]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "LMCACHE_TRACK_USAGE": "false",
                    "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": "WARNING", **(env or {})}
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "lmcache-server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LMCacheServer:
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited: {self.log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(self.http_url + "/docs", timeout=1)
                return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"lmcache server did not come up: {self.log.read_text()[-4000:]}")

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc, timeout=30)
