"""`quickdraft serve --replicas 2` (a Ray cluster of its own) as a process of its own: started on a
free port and stopped (test_cluster_ray's)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

MODEL = "smollm2-135m"


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def serve_replicas(*flags: str) -> tuple[subprocess.Popen, str]:
    """`quickdraft serve --replicas 2 --threads 1` of SmolLM2 on a free port, /health ok (both replicas up)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft", "serve", "--model", MODEL, "--replicas", "2",
                             "--threads", "1", "--port", str(port), "--served-model-name", "smollm2", "--spec", "none",
                             "--no-measure-cost", "--max-batch", "4", "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # two model loads beside Ray's start; minutes on a loaded machine
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the cluster did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok":
                    return proc, url
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops the Ray cluster it started), SIGKILL if it is still there after a minute."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
