"""One replica of a cluster: a loaded model, its engine service and the unchanged server app over
it, as a Ray Serve deployment (serve.py deploys it).

A thread of its own loads the model and then drives the engine (server/worker.py says why torch
work stays on the thread that loaded the model); requests reach the app through `forward`
(asgi.py), the router learns what the prefix cache holds from `record_routing_stats` (Ray Serve
polls it), the front reads `report` for /health and /metrics, and Ray restarts a replica whose
`check_health` fails or whose process dies. On a node bound to the loopback, Ray Serve's own gRPC
server in the replica binds the loopback too (serve_grpc_on_loopback).
"""
from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from starlette.types import Message

from quickdraft import kernels
from quickdraft.cluster.asgi import HttpCall, call_app
from quickdraft.cluster.digests import held_digests
from quickdraft.cluster.ingress import REPLICA_HEADER
from quickdraft.engine.service import loaded_objects_frozen
from quickdraft.server.app import ServerConfig


@dataclass(frozen=True)
class ReplicaSetup:
    """What a replica needs to build what `quickdraft serve` builds in one process."""
    server: ServerConfig
    model: dict[str, Any] = field(default_factory=dict)  # quickdraft.load's keyword arguments
    threads: int = 1             # torch's and the kernels' threads (the replica's CPUs in Ray)
    bind: str = "127.0.0.1"      # the address the front serves: decides the Host names answered
    policy: str = "goodput"
    measure_cost: bool = True    # the forward-cost curve at start-up (serve's --no-measure-cost)


def serve_grpc_on_loopback() -> None:
    """Ray Serve 2.60 starts each replica's gRPC server for calls between deployments on "[::]:0", every
    interface, whatever the node's address, where Ray's own servers bind the loopback on a node whose
    address is a loopback one (a cluster `quickdraft serve` started): there, the loopback too. Ray Serve
    looks the function up when it starts that server, after this replica's constructor."""
    if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
        return
    from ray.serve._private import replica
    bind = replica.add_port_to_grpc_server
    replica.add_port_to_grpc_server = lambda server, address: bind(server, address.replace("[::]", "127.0.0.1"))


class EngineReplica:
    def __init__(self, setup: ReplicaSetup) -> None:
        serve_grpc_on_loopback()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.app: Any = None
        self._error: BaseException | None = None
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(setup, loaded), name="quickdraft-engine",
                                        daemon=True)
        self._thread.start()
        loaded.wait()
        if self._error is not None:
            raise self._error

    def _run(self, setup: ReplicaSetup, loaded: threading.Event) -> None:
        from quickdraft.api import load
        from quickdraft.engine.startup import start_serving
        from quickdraft.server import create_app
        try:
            llm, cost = start_serving(setup.threads, lambda: load(**setup.model), setup.policy, setup.measure_cost)
            self.app = create_app(llm, setup.server, cost, engine_thread=False, bind=setup.bind)
            self.prefix = llm.prefix
            self.runtime = {"weights": llm.model.weight_format, "threads": setup.threads,
                            "context": self.app.state.served.context,
                            "kernel": kernels.kernel_info().isa or "none (torch path)",
                            "node": ray.util.get_node_ip_address(),
                            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        except BaseException as e:  # noqa: BLE001 - raised by __init__: Ray reports the deployment failed with it
            self._error = e
            return
        finally:
            loaded.set()
        with loaded_objects_frozen():
            self.app.state.worker.run()

    async def forward(self, call: HttpCall, digests: Sequence[int] = ()) -> AsyncIterator[Message]:
        """The app's answer to `call`, message by message, its head naming this replica. `digests`
        are the prompt's, read by the router before this replica was chosen."""
        async for message in call_app(self.app, call):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(),
                                                                                 self.name.encode())]}
            yield message

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (Ray Serve polls it): the digests of every prefix cached here."""
        return {"prefix": held_digests(self.prefix)}

    def report(self) -> dict[str, Any]:
        """For the front's /health and /metrics: this replica's name, its metrics text, how it runs."""
        return {"replica": self.name, "metrics": self.app.state.metrics.render(), "runtime": self.runtime}

    def close(self, reason: str) -> None:
        """End every request here with a 503 (or an error event) saying `reason` (a shutdown's deadline)."""
        self.app.state.worker.close(reason)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine thread has stopped."""
        if not self._thread.is_alive():
            raise RuntimeError("the replica's engine thread has stopped")

    def __del__(self) -> None:  # Ray's graceful shutdown of the replica, once its requests are done
        if self.app is not None:
            self.app.state.worker.stop()
