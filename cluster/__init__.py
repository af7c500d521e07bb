"""Ray for Orchard: connect, find the `mlx` nodes, place one worker actor per node, its lifecycle, node facts."""

from .actor import Pool, WorkerActor, held_files, launch, ready, revive, start, stop
from .connect import LOCAL, ClusterError, Connection, connect
from .facts import collect, mismatch
from .place import RESOURCE, mlx_nodes, node_facts, parse_workers, place, worker_count

__all__ = [
    "Pool",
    "WorkerActor",
    "held_files",
    "launch",
    "ready",
    "revive",
    "start",
    "stop",
    "LOCAL",
    "RESOURCE",
    "ClusterError",
    "Connection",
    "collect",
    "connect",
    "mismatch",
    "mlx_nodes",
    "node_facts",
    "parse_workers",
    "place",
    "worker_count",
]
