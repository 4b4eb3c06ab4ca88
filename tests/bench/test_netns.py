"""The link spec parser, the root check, and (as root with iproute2) a real shaped pair that is always removed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from scd_store.bench import netns
from scd_store.bench.netns import HostPair, LinkError, LinkSpec, entered


@pytest.mark.parametrize(("text", "rate", "delay", "label"), [
    ("1gbit", 1e9, 0.0, "1gbit"), ("100mbit", 1e8, 0.0, "0.1gbit"), ("10Gbit", 1e10, 0.0, "10gbit"),
    ("unshaped", None, 0.0, "unshaped"), ("1gbit:0.2ms", 1e9, 2e-4, "1gbit:0.2ms"),
])
def test_parse(text: str, rate: float | None, delay: float, label: str) -> None:
    spec = LinkSpec.parse(text)
    assert (spec.rate_bps, spec.delay_s, spec.label) == (rate, pytest.approx(delay), label)


@pytest.mark.parametrize("text", ["fast", "1gb", "1gbit:5", "1gbit:2h", "0.1bit", "1gbit:5s"])
def test_parse_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        LinkSpec.parse(text)


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkError, match="needs root"):
        HostPair()


def test_missing_iproute2_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/bin/" + tool)
    with pytest.raises(LinkError, match="iproute2 \\(tc not found\\)"):
        HostPair()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _send_across(pair: HostPair, nbytes: int) -> None:
    """``nbytes`` over TCP from the producer's host to the consumer's, each end a thread in its namespace."""
    ready, got = threading.Event(), []

    def receive() -> None:
        with entered(pair, "consumer"), socket.create_server((netns.CONSUMER_ADDR, 0)) as server:
            got.append(server.getsockname()[1])
            ready.set()
            conn, _ = server.accept()
            with conn:
                while sum(got[1:]) < nbytes and (chunk := conn.recv(65536)):
                    got.append(len(chunk))

    thread = threading.Thread(target=receive)
    thread.start()
    assert ready.wait(10)
    with entered(pair, "producer"), socket.create_connection((netns.CONSUMER_ADDR, got[0]), timeout=10) as conn:
        conn.sendall(b"x" * nbytes)
    thread.join(10)
    assert sum(got[1:]) == nbytes


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")


@needs_root
def test_shaped_pair_carries_bytes_and_is_removed() -> None:
    with HostPair() as pair:
        pair.shape(LinkSpec.parse("1gbit"))
        qdisc = subprocess.run(["tc", "-n", pair.producer, "qdisc", "show", "dev", pair.producer_dev],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc
        before = pair.counters()
        _send_across(pair, 200_000)
        after = pair.counters()
        assert after["producer_to_consumer"] - before["producer_to_consumer"] >= 200_000
        assert after["consumer_to_producer"] - before["consumer_to_producer"] > 0  # the acks
        pair.shape(LinkSpec())
        assert pair.producer in _namespaces()
    assert pair.producer not in _namespaces() and pair.consumer not in _namespaces()


@needs_root
def test_pair_is_removed_on_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), HostPair() as pair:
        raise RuntimeError("boom")
    assert pair.producer not in _namespaces()


@needs_root
def test_a_dead_process_pair_is_removed_next_time() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.NAME_PREFIX}-p-{dead.pid}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netns.remove_stale()
    assert name not in _namespaces()


@needs_root
def test_a_delay_without_netem_is_a_clear_error_or_works() -> None:
    with HostPair() as pair:
        try:
            pair.shape(LinkSpec.parse("1gbit:1ms"))
        except LinkError as exc:
            assert "netem" in str(exc)
        else:
            qdisc = subprocess.run(["tc", "-n", pair.consumer, "qdisc", "show", "dev", pair.consumer_dev],
                                   capture_output=True, text=True).stdout
            assert "netem" in qdisc


_TERMINATED = """
import sys, time
from pathlib import Path
from scd_store.bench.netns import HostPair
out = Path(sys.argv[1])
with HostPair() as pair:
    out.write_text(pair.producer)
    try:
        time.sleep(60)
    finally:
        time.sleep(1.0)  # a clean-up that takes a while, as stopping servers does
        out.write_text("cleaned up")
"""


@needs_root
def test_a_second_sigterm_does_not_cut_the_clean_up_short(tmp_path) -> None:
    out = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", _TERMINATED, str(out)])
    deadline = time.monotonic() + 30
    while not (out.is_file() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    name = out.read_text()
    assert name in _namespaces()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # during the clean-up
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert out.read_text() == "cleaned up" and name not in _namespaces()
