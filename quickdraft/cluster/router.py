"""Ray Serve request routers for engine replicas (its custom request router API): prefix affinity
balanced against queues (affinity.py decides), and plain round robin to compare it with.

A router lives in the front's deployment handle; Ray Serve asks it to rank the replicas for each
request and sends the request to the first of them that accepts. The prompt's digests come as the
`digests` argument of the replica call; what each replica holds comes from its routing stats
(replica.py's `record_routing_stats`, polled every ROUTING_STATS_S) and from the prompts routed to
it since.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from quickdraft.cluster.affinity import SLACK, Candidate, PrefixMap, rank

ROUTING_STATS_S = 1.0  # how often Ray Serve polls each replica's routing stats
HORIZON_S = 10.0       # a prompt routed to a replica counts as cached there this long (then its stats say)


def _digests(request: PendingRequest | None) -> Sequence[int]:
    return () if request is None else request.kwargs.get("digests", ())


def _name(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class Turns:
    """One turn per request, however often Ray asks to rank the replicas for it: it asks again for
    the same request when the replica ranked first could not take it (a queue probe timed out,
    its queue was full), and a turn counted per question alternated such a request's first choice,
    so round robin sent runs of requests to one replica on a loaded machine."""

    def __init__(self, remembered: int = 1024) -> None:
        self._turns: OrderedDict[str, int] = OrderedDict()
        self._next = 0
        self._remembered = remembered

    def of(self, request: PendingRequest | None) -> int:
        key = request.metadata.request_id if request is not None else None
        if key is None or key not in self._turns:
            self._next += 1
            if key is None:
                return self._next
            self._turns[key] = self._next
            if len(self._turns) > self._remembered:
                self._turns.popitem(last=False)
        return self._turns[key]


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, slack: int = SLACK, horizon_s: float = HORIZON_S) -> None:
        self.slack = slack
        self.prefixes = PrefixMap(horizon_s)
        self._advertised: dict[str, object] = {}  # the routing stats last read, per replica
        self._turns = Turns()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        digests = _digests(pending_request)
        loads = await self._loads(candidate_replicas)
        candidates = []
        for replica in candidate_replicas:
            name = _name(replica.replica_id)
            stats = replica.routing_stats
            if stats and self._advertised.get(name) is not stats:
                self._advertised[name] = stats
                self.prefixes.advertise(name, stats.get("prefix", ()))
            matched = self.prefixes.matched(name, digests)
            candidates.append(Candidate(name, loads[name], matched, self.prefixes.continued(name, digests[:matched])))
        by_name = {_name(r.replica_id): r for r in candidate_replicas}
        return [[by_name[n] for n in names]
                for names in rank(candidates, self.slack, self._turns.of(pending_request), len(digests))]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests on each replica: the router's cache of queue lengths, a probe where it has none."""
        loads, unknown = {}, []
        for replica in replicas:
            known = self.replica_queue_len_cache.get(replica.replica_id)
            if known is None:
                unknown.append(replica)
            else:
                loads[_name(replica.replica_id)] = known
        if unknown:
            for replica, length in await self._probe_queue_lens(unknown, 0):
                loads[_name(replica.replica_id)] = length if length is not None else 0
        return {_name(r.replica_id): loads.get(_name(r.replica_id), 0) for r in replicas}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self.prefixes.routed(_name(replica_id), _digests(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(_name(replica_id))
        self._advertised.pop(_name(replica_id), None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {_name(r.replica_id) for r in replicas}
        for name in self.prefixes.replicas() - current:
            self.prefixes.forget(name)
            self._advertised.pop(name, None)


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, whatever the prompt (the baseline prefix affinity is measured against)."""

    def initialize_state(self) -> None:
        self._turns = Turns()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: _name(r.replica_id))
        if not ordered:
            return []
        start = self._turns.of(pending_request) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]


ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter}
