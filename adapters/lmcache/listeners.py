"""Who can reach this process: the addresses its listening sockets are bound to.

A producer's ``lmcache server`` holds the space's private key and signs whatever its clients store as the
producer's model, so it must be reachable by the producer engine alone: bound to the loopback address, on
a host (or network namespace, pod) the producer engine has to itself. :func:`remote_listeners` names the
sockets that break this.
"""

from __future__ import annotations

import ipaddress


def remote_listeners() -> list[str] | None:
    """``host:port`` of each TCP socket this process listens on beyond the loopback address; None when that
    cannot be told (no ``psutil``, or the platform will not say)."""
    try:
        import psutil

        connections = psutil.Process().net_connections(kind="inet")
    except Exception:  # noqa: BLE001 - ImportError, AccessDenied, an unsupported platform: unknown
        return None
    remote = []
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        host = conn.laddr.ip.split("%", 1)[0]
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        mapped = getattr(address, "ipv4_mapped", None)
        loopback = address is not None and (address.is_loopback or (mapped is not None and mapped.is_loopback))
        if not loopback:
            remote.append(f"{conn.laddr.ip}:{conn.laddr.port}")
    return sorted(remote)
