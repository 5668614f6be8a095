"""`quickdraft serve --replicas N`: engine replicas as a Ray Serve application, this process their
HTTP front.

Joins the Ray cluster at --ray-address, or starts a local one; deploys N replicas (replica.py),
each with --threads CPUs, routed by a request router (router.py); then serves the ingress
(ingress.py) with the same connection limits and shutdown as one process (server.HttpFront):
on SIGTERM no new connections, in-flight requests get --shutdown-timeout to finish, the replicas
then end the rest with a 503, and the application is deleted (Ray drains and stops its replicas).
A cluster started here listens on the loopback only and asks for a token of this launch's
(docs/cluster.md, "What listens where").
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve
from ray._private import ray_constants
from ray._raylet import AuthenticationTokenLoader, Config
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.types import Message

from quickdraft.cluster.asgi import HttpCall
from quickdraft.cluster.ingress import Ingress, ReplicaLost
from quickdraft.cluster.placement import replica_threads
from quickdraft.cluster.replica import EngineReplica, ReplicaSetup
from quickdraft.cluster.router import ROUTERS, ROUTING_STATS_S
from quickdraft.errors import QuickdraftError
from quickdraft.server import HttpFront
from quickdraft.server.guards import HostCheck, answered_hosts
from quickdraft.server.prompts import Prompts
from quickdraft.weights import load_tokenizer, resolve_model

log = logging.getLogger("quickdraft.cluster")

APP = "quickdraft"
DEPLOYMENT = "engine"
HEALTH_CHECK_S = 2.0    # how often Ray asks each replica whether its engine runs
REPORT_TIMEOUT_S = 2.0  # a replica slower than this to report is not counted healthy by /health
HEADROOM = 8            # calls a replica takes beyond its rows and queue (reports, routing probes)
REACH_TIMEOUT_S = 10.0  # --ray-address must accept a connection within this
LOOPBACK = "127.0.0.1"
RAY_INIT = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}


@dataclass(frozen=True)
class ClusterPlan:
    replicas: int
    threads: int | None = None     # CPUs per replica; None: the cluster's CPUs shared out
    address: str | None = None     # a Ray cluster to join; None: start one on this machine
    router: str = "prefix"


class RayReplicas:
    """The ingress's `Replicas` over a Ray Serve deployment handle. `cached`: whether the replicas
    keep a prefix cache; without one a prompt's digests name nothing a replica holds, and are not
    passed to the router (it would send prompts that start alike to the replica they went to last)."""

    def __init__(self, handle: Any, wanted: int, cached: bool = True) -> None:
        self._streaming = handle.options(stream=True)
        self._handle = handle
        self._wanted = wanted
        self._cached = cached

    async def stream(self, call: HttpCall, digests: list[int]) -> AsyncIterator[Message]:
        answer = self._streaming.forward.remote(call, digests=digests if self._cached else [])
        finished = False
        try:
            async for message in answer:
                yield message
            finished = True
        except (RayActorError, ActorUnavailableError) as e:
            finished = True
            raise ReplicaLost(f"{type(e).__name__}: {e}") from None
        finally:
            if not finished:  # the client left: the replica's app hears it and cancels the request
                answer.cancel()

    async def reports(self) -> list[dict[str, Any]]:
        """Those of the replicas that answer within REPORT_TIMEOUT_S (none if one of them is slower)."""
        try:
            answers = await self._handle.broadcast("report").results_async(timeout_s=REPORT_TIMEOUT_S,
                                                                           return_exceptions=True)
        except TimeoutError:
            return []
        return [a for a in answers if isinstance(a, dict)]

    def wanted(self) -> int:
        return self._wanted

    def close(self, reason: str) -> None:
        """On a thread of its own (the shutdown's deadline): every replica ends its requests with `reason`."""
        self._handle.broadcast("close", reason).results(timeout_s=REPORT_TIMEOUT_S * 5, return_exceptions=True)


def reach(address: str) -> None:
    """A cluster's host:port must answer a connection: Ray's own client retries an address nobody
    listens on for ever, a warning every few seconds. Other forms (`auto`, `ray://`) go to Ray as given."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise QuickdraftError(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e}); start one "
                              f"with `ray start --head --port PORT` on that machine, or check the address") from None


@contextmanager
def token_auth() -> Iterator[None]:
    """Ray's token authentication on, with a random token of this launch's, for the block: the cluster's
    processes inherit it from this one's environment (never ~/.ray/auth_token, which every local cluster
    of this user would share), and every call into the cluster without it is refused."""
    wanted = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    reload_auth()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_auth()


def reload_auth() -> None:
    """Ray reads the mode and the token once per process and keeps them: read them again (as
    Ray's own token set-up does), or a second cluster in this process would get the first's."""
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def loopback_node() -> Iterator[None]:
    """While ray.init starts a node of address 127.0.0.1. Ray 2.60 binds its processes' servers to the
    loopback where the node's address is a loopback one, to every interface otherwise; and it turns
    127.0.0.1 given as the node's address into the machine's outward one unless clusters of several
    machines are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as on macOS, read into this flag when ray is
    imported). The node's processes get its address as an argument: the flag matters only here."""
    several = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = several


@contextmanager
def ray_cluster(plan: ClusterPlan) -> Iterator[int]:
    """Joined at --ray-address, or started here for the block ("local": never one that Ray would find by
    itself, a `ray start` on this machine or RAY_ADDRESS) and shut down after it; the threads each
    replica gets. A cluster started here listens on the loopback and asks for its token; one joined is
    bound as whoever started it chose."""
    if plan.address is None and not ray.is_initialized():
        with token_auth():
            with loopback_node():
                ray.init(address="local", _node_ip_address=LOOPBACK, **RAY_INIT)
            try:
                yield cluster_threads(plan)
            finally:
                ray.shutdown()
        return
    if plan.address is not None:
        reach(plan.address)
    try:  # without --ray-address: the cluster this process is connected to already (never one found elsewhere)
        ray.init(address=plan.address or "local", ignore_reinit_error=True, **RAY_INIT)
    except ConnectionError as e:
        raise QuickdraftError(f"the Ray cluster at {plan.address}: {e} (a cluster started by `ray start --head` asks "
                              f"for its token: RAY_AUTH_MODE=token here, with that token; docs/cluster.md)") from None
    yield cluster_threads(plan)


def cluster_threads(plan: ClusterPlan) -> int:
    node_cpus = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node["Alive"]]
    return replica_threads(node_cpus, plan.replicas, plan.threads)


def deploy(setup: ReplicaSetup, plan: ClusterPlan) -> Any:
    """Deploy the replicas and wait until every one has loaded its model; their deployment handle."""
    serve.start(proxy_location="Disabled")  # this process is the HTTP front
    server = setup.server
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT, num_replicas=plan.replicas,
        ray_actor_options={"num_cpus": setup.threads},
        max_ongoing_requests=server.engine.max_batch + server.max_waiting + HEADROOM,
        health_check_period_s=HEALTH_CHECK_S, graceful_shutdown_timeout_s=60.0, max_constructor_retry_count=1,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[plan.router],
                                                  request_routing_stats_period_s=ROUTING_STATS_S))
    return serve.run(deployment.bind(setup), name=APP, route_prefix=None)


@contextmanager
def running(setup: ReplicaSetup, plan: ClusterPlan, model: str, sock: socket.socket,
            shutdown_timeout_s: float = 30.0, log_level: str = "warning") -> Iterator[HttpFront]:
    """The replicas deployed and the front serving on `sock`, until the block ends: then the front
    stops (HttpFront.stop), the application is deleted and a cluster started here shut down."""
    tokenizer = load_tokenizer(resolve_model(model))  # a model that is not there fails here, not in N replicas
    with ray_cluster(plan) as threads:
        try:
            setup = replace(setup, threads=threads)
            handle = deploy(setup, plan)
            context = handle.report.remote().result()["runtime"]["context"]  # every replica's: one model, one config
            replicas = RayReplicas(handle, plan.replicas, cached=setup.model.get("prefix_cache_mb") != 0)
            ingress = Ingress(replicas, Prompts(tokenizer), setup.server.max_body_bytes, context)
            hosts = answered_hosts(setup.bind, setup.server.allowed_hosts)
            front = HttpFront(ingress if hosts is None else HostCheck(ingress, hosts), setup.server.connections,
                              ingress.count_error, replicas.close, setup.bind, sock, shutdown_timeout_s, log_level)
            try:
                yield front
            finally:
                front.stop()
        finally:
            serve.delete(APP)


def serve_cluster(setup: ReplicaSetup, plan: ClusterPlan, model: str, sock: socket.socket,
                  shutdown_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (server.serve's shutdown, over every replica)."""
    with running(setup, plan, model, sock, shutdown_timeout_s, log_level) as front:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: front.request_stop())
        while front.thread.is_alive():
            front.thread.join(0.5)
