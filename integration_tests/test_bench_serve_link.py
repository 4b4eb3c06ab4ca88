"""``scd-store bench serve --link``: producer and consumer on two hosts (network namespaces) joined by a shaped
veth, real vLLM servers in each, every route loading across the link (Redis and NIXL over TCP)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vLLM stack is installed by `make test`")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="--link needs root and tc")]
ROUTES = ("own", "scd-redis", "scd-peer", "raw-redis", "raw-peer")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_every_route_loads_across_a_shaped_link(tiny_bundle, tmp_path):
    out = tmp_path / "link.json"
    subprocess.run([sys.executable, "-m", "scd_store.cli.main", "bench", "serve", "--link", "1gbit",
                    "--bundle", str(tiny_bundle), "--prefix-tokens", "512", "--concurrency", "1", "--requests", "2",
                    "--no-model", "--root", str(tmp_path / "deployment"), "--json", str(out)],
                   check=True, timeout=1200)
    report = json.loads(out.read_text())
    assert report["kind"] == "measured"
    cells = {r["route"]: r for r in report["rows"]}
    assert set(cells) == set(ROUTES) and all(r["link"] == "1gbit" for r in report["rows"])
    payload = report["payload_bytes_per_request"]["512"]
    assert 0 < payload["scd"] < payload["raw"]
    for route in ROUTES[1:]:
        row = cells[route]
        assert row["loaded"], row  # the blobs crossed the veth: its counters saw at least the payload
        assert row["link_bytes_to_consumer"] >= row["payload_bytes"] > 0
    assert cells["own"]["link_bytes_to_consumer"] < payload["scd"]  # no load, only the HTTP exchange
    assert (tmp_path / "link.md").is_file() and (tmp_path / "link.png").is_file()
    assert "scdlink-" not in _namespaces()  # the hosts are gone
