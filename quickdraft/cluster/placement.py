"""How many CPUs each replica asks Ray for, from the CPUs of the cluster's nodes. A replica's threads
run in one process, so on one node: the question is how many replicas fit node by node, not
whether the cluster's total covers them (2 nodes of 1 CPU hold no replica of 2 threads, and Ray
would leave it pending for ever). Knows nothing of Ray: launch.py reads the nodes.
"""
from __future__ import annotations

from quickdraft.errors import QuickdraftError


def fitting(node_cpus: list[int], threads: int) -> int:
    """Replicas of `threads` CPUs that the nodes hold."""
    return sum(cpus // threads for cpus in node_cpus)


def replica_threads(node_cpus: list[int], replicas: int, threads: int | None) -> int:
    """`threads`, checked to fit; None: the most that still fits every replica (at least 1)."""
    if threads is None:
        threads = max((t for t in range(1, max(node_cpus, default=0) + 1) if fitting(node_cpus, t) >= replicas),
                      default=1)
    if fitting(node_cpus, threads) < replicas:
        raise QuickdraftError(
            f"--replicas {replicas} x --threads {threads} needs {replicas} replicas of {threads} CPUs, each on one "
            f"node; the Ray cluster's nodes have {sorted(node_cpus, reverse=True)} CPUs and hold "
            f"{fitting(node_cpus, threads)} (add machines with `ray start --address`, or ask for fewer)")
    return threads
