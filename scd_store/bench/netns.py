"""Two hosts on one machine: :class:`HostPair`, two network namespaces joined by a veth pair whose both ends
are shaped with ``tc`` (a token bucket for the rate, ``netem`` for a delay where the kernel has it).

The producer's host is ``10.213.0.1``, the consumer's ``10.213.0.2``; each namespace has its own loopback.
Processes go into a namespace with :meth:`HostPair.argv` (``ip netns exec``); this process's calling thread
enters one with :func:`entered` (``setns``), and threads it starts there inherit it. The pair is removed on
exit, also on an exception or SIGTERM; pairs left by a process that died are removed the next time a pair
is made. Needs root and iproute2 (``ip``, ``tc``): without them, :class:`LinkError` says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scd_store.errors import ScdStoreError

PRODUCER_ADDR, CONSUMER_ADDR = "10.213.0.1", "10.213.0.2"
NAME_PREFIX = "scdlink"
CLONE_NEWNET = 0x40000000
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class LinkError(ScdStoreError, RuntimeError):
    """The link cannot be made here (not root, no iproute2, a qdisc the kernel lacks)."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link's shape: ``rate_bps`` (bits per second; None: unshaped) and a one-way ``delay_s``."""

    rate_bps: float | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.rate_bps is not None and not 1e3 <= self.rate_bps <= 1e12) or not 0 <= self.delay_s <= 1.0:
            raise ValueError("a link rate is 1kbit..1tbit and a delay 0..1s")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``RATE[:DELAY]``, e.g. ``1gbit``, ``100mbit:0.2ms``, ``unshaped``."""
        rate_text, _, delay_text = text.strip().lower().partition(":")
        rate = None
        if rate_text not in ("unshaped", "none", ""):
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)", rate_text)
            if not m:
                raise ValueError(f"link rate {rate_text!r}: use e.g. 100mbit, 1gbit, 10gbit or unshaped")
            rate = float(m.group(1)) * _UNITS[m.group(2)]
        delay = 0.0
        if delay_text:
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)", delay_text)
            if not m:
                raise ValueError(f"link delay {delay_text!r}: use e.g. 0.2ms, 5ms")
            delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
        return cls(rate, delay)

    @property
    def label(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps / 1e9:g}gbit"
        return rate + (f":{self.delay_s * 1e3:g}ms" if self.delay_s else "")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def require_root_tools() -> None:
    """Raise :class:`LinkError` naming what is missing to make a link here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"--link needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2")
    if os.geteuid() != 0:
        raise LinkError("--link makes network namespaces and shapes a veth pair with tc: it needs root "
                        "(CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root or without --link")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of pairs whose making process is gone; their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{NAME_PREFIX}-[pc]-(\d+)", name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


class HostPair:
    """Two namespaces and a shaped veth between them; a context manager that always removes them."""

    def __init__(self) -> None:
        require_root_tools()
        pid = os.getpid()
        self.producer, self.consumer = f"{NAME_PREFIX}-p-{pid}", f"{NAME_PREFIX}-c-{pid}"
        self.producer_dev, self.consumer_dev = f"scdp{pid}"[:15], f"scdc{pid}"[:15]
        self.spec = LinkSpec()
        self._made = False
        self._old_term = None

    def __enter__(self) -> HostPair:
        remove_stale()
        try:
            for ns in (self.producer, self.consumer):
                _run("ip", "netns", "add", ns)
            self._made = True
            _run("ip", "link", "add", self.producer_dev, "type", "veth", "peer", "name", self.consumer_dev)
            for dev, ns, addr in ((self.producer_dev, self.producer, PRODUCER_ADDR),
                                  (self.consumer_dev, self.consumer, CONSUMER_ADDR)):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        if self._old_term is None:
            self._old_term = signal.getsignal(signal.SIGTERM)
            with contextlib.suppress(ValueError):  # not the main thread: the caller's handler stays
                signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
        if self._old_term is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def remove(self) -> None:
        """Delete both namespaces (the veth pair goes with them); safe to call twice."""
        if self._made:
            for ns in (self.producer, self.consumer):
                _run("ip", "netns", "del", ns, check=False)
            self._made = False

    def argv(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``side``'s namespace (``producer`` or ``consumer``)."""
        return ["ip", "netns", "exec", self._ns(side), *argv]

    def _ns(self, side: str) -> str:
        if side not in ("producer", "consumer"):
            raise ValueError(f"side is producer or consumer, not {side!r}")
        return self.producer if side == "producer" else self.consumer

    def shape(self, spec: LinkSpec) -> None:
        """Set both directions of the link to ``spec`` (replacing the previous shape)."""
        for dev, ns in ((self.producer_dev, self.producer), (self.consumer_dev, self.consumer)):
            _run("ip", "-n", ns, "link", "set", dev, "qlen", "1000")
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if spec.delay_s:
                self._netem(ns, dev, spec)
            elif spec.rate_bps is not None:
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(spec.rate_bps))
        self.spec = spec

    def _netem(self, ns: str, dev: str, spec: LinkSpec) -> None:
        netem = ["netem", "delay", f"{spec.delay_s * 1e6:.0f}us", "limit", "100000"]
        done = _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False)
        if done.returncode != 0:
            raise LinkError(f"a link delay needs the kernel's netem qdisc (sch_netem), which this kernel "
                            f"({os.uname().release}) lacks: {done.stderr.strip()}; shape the rate only "
                            f"(--link RATE)")
        if spec.rate_bps is not None:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *_tbf(spec.rate_bps))

    def counters(self) -> dict[str, int]:
        """Bytes each way across the link so far, from the veth's interface counters."""
        out = json.loads(_run("ip", "-n", self.producer, "-j", "-s", "link", "show", self.producer_dev).stdout)
        stats = out[0]["stats64"]
        return {"producer_to_consumer": int(stats["tx"]["bytes"]), "consumer_to_producer": int(stats["rx"]["bytes"])}


def _tbf(rate_bps: float) -> list[str]:
    """A token bucket at ``rate_bps``: a burst of 1 ms at that rate (at least 32 KiB), 50 ms of queue."""
    burst = max(32 << 10, int(rate_bps / 8 / 1000))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms"]


def _exit_on_term(signum: int, frame: object) -> None:
    """The first SIGTERM unwinds the stack (servers stopped, the pair removed on the way out); later ones are
    ignored, so that a second signal (``timeout``, a supervisor) cannot cut that clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def entered(pair: HostPair, side: str) -> Iterator[None]:
    """Move the calling thread into ``side``'s namespace for the block (threads started inside inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(str(Path("/run/netns") / pair._ns(side)), os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise LinkError(f"setns into {pair._ns(side)}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise LinkError(f"setns back: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(target)
        os.close(own)
