"""Start and stop real ``redis-server`` processes on free loopback ports, for tests and benchmarks.

Only 127.0.0.1 is ever bound; every server runs in its own temp directory without persistence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from integration_tests.processes import stop_process

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port (and, for cluster nodes, a free bus port at +10000)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1. ``kill`` / ``restart`` keep the port (for outage tests)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 cluster: bool = False, extra: tuple[str, ...] = (), tls: Path | None = None) -> None:
        self.dir = Path(directory or tempfile.mkdtemp(prefix="scd-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.port = port or free_port(cluster)
        self.extra = extra
        self.tls = tls  # a directory from make_tls_certs: TLS only (no plain port), client certs optional
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls / 'ca.crt'}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        ports = ["--port", str(self.port)] if self.tls is None else [
            "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls / "server.crt"),
            "--tls-key-file", str(self.tls / "server.key"), "--tls-ca-cert-file", str(self.tls / "ca.crt"),
            "--tls-auth-clients", "optional"]
        args = [REDIS_SERVER, *ports, "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
                "--loglevel", "warning", "--logfile", str(self.dir / "redis.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen([*args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}")
            if self.cli("PING", check=False).strip() == "PONG":
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def cli(self, *args: str, check: bool = True) -> str:
        tls = [] if self.tls is None else ["--tls", "--cacert", str(self.tls / "ca.crt")]
        result = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *tls, *args], capture_output=True,
                                text=True, timeout=10, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)
        self.proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_tls_certs(directory: Path) -> Path:
    """A self-signed CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=scd-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=scd-test-{name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.crt")
    return directory


class RedisCluster:
    """``n`` cluster-enabled masters on loopback, joined with ``redis-cli --cluster create``."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, n: int = 3) -> None:
        root = Path(directory or tempfile.mkdtemp(prefix="scd-redis-cluster-"))
        self.nodes = [RedisServer(root / f"node{i}", cluster=True) for i in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            result = subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                                     "--cluster-yes"], capture_output=True, text=True, timeout=60, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {result.stdout[-500:]} {result.stderr}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in self.nodes):
                    return self
                time.sleep(0.1)
            raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
