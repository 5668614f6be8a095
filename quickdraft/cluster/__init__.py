"""Scale-out on Ray Serve (`quickdraft serve --replicas N`): engine replicas, each the server app over
its own engine, behind one HTTP front that routes each prompt to the replica holding its longest
cached prefix. Needs the `cluster` extra (ray[serve]); only launch.py, replica.py and router.py
import Ray. docs/cluster.md has the commands for one machine and many.
"""
from __future__ import annotations

ROUTER_NAMES = ("prefix", "round-robin")  # router.ROUTERS' keys, for flags checked before Ray is imported
REPLICA_HEADER = "x-quickdraft-replica"  # names the replica that answered (the front adds it; benchmarks read it)
