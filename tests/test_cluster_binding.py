"""What `quickdraft serve --replicas 2` (a Ray cluster of its own) listens on: every TCP socket that any
process it started listens on, Ray's included (GCS, raylet, object manager, metrics, dashboard and
runtime-env agents, workers, the replicas), is a loopback one, as its HTTP front is; and the cluster
asks for a token of its own, not the one in ~/.ray/auth_token.

Oracles: the listening sockets of the process tree as the kernel reports them (psutil), the
environment the replicas run with, and the cluster's GCS answering calls with that token and no others.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
import sys
from pathlib import Path

import psutil  # the test extra's accelerate requires it
import pytest

from support.replicas import serve_replicas, stop

pytestmark = pytest.mark.slow


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to the IPv4 loopback
    return address.is_loopback


def listening(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening TCP socket of `root` and all its descendants."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            # the executable's name and the command line's tail: a cut command line would lose the name
            # of a binary that sits deep in the venv (gcs_server, raylet) on a long checkout path
            name = f"{proc.name()} {' '.join(proc.cmdline())[-80:]}"
            found += [(name, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:  # a short-lived helper of Ray's that ended meanwhile
            pass
    return found


GCS_CALL = """
import sys
from ray._raylet import GcsClient
print(len(GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)))
"""


def gcs_call(address: str, mode: str, token: str | None) -> subprocess.CompletedProcess:
    """A call to the cluster's GCS (the nodes it knows) from a process of its own with this auth mode and token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = mode
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([sys.executable, "-c", GCS_CALL, address], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_cluster_started_by_serve_listens_on_the_loopback_only_and_asks_for_its_own_token() -> None:
    """Every listening socket of the process tree on the loopback (the front's, GCS's, the raylet's and
    both replicas' among them, so that an empty listing cannot pass); every replica with token auth and
    one token, not the one in ~/.ray/auth_token; the GCS answering a call with that token and refusing
    one without a token or with another."""
    proc, url = serve_replicas()
    try:
        root = psutil.Process(proc.pid)
        sockets = listening(root)
        names = " ".join(name for name, _, _ in sockets)
        assert "gcs_server" in names and "raylet" in names and names.count("ServeReplica") >= 2, sockets
        assert any(port == int(url.rsplit(":", 1)[1]) for _, _, port in sockets)  # the front's own
        exposed = [s for s in sockets if not loopback(s[1])]
        assert not exposed, exposed

        replicas = [p for p in root.children(recursive=True) if "ServeReplica" in " ".join(p.cmdline())]
        environs = [p.environ() for p in replicas]
        tokens = {env.get("RAY_AUTH_TOKEN") for env in environs}
        assert all(env.get("RAY_AUTH_MODE") == "token" for env in environs) and len(tokens) == 1, tokens
        token = tokens.pop()
        shared = Path.home() / ".ray" / "auth_token"
        assert token and len(token) == 64 and (not shared.exists() or shared.read_text().strip() != token)

        gcs = next(p for p in root.children(recursive=True) if "gcs_server" in " ".join(p.cmdline()))
        port = next(c.laddr.port for c in gcs.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN)
        address = f"127.0.0.1:{port}"
        answered = gcs_call(address, "token", token)
        assert answered.returncode == 0 and answered.stdout.strip() == "1", answered.stderr[-2000:]
        for mode, other in [("disabled", None), ("token", secrets.token_hex(32))]:
            refused = gcs_call(address, mode, other)
            assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, (mode, refused.stderr[-2000:])
    finally:
        stop(proc)
