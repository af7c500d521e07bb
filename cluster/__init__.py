"""Ray for Orchard: connect, find the `mlx` nodes, place one worker actor per node, describe the nodes."""

from .connect import LOCAL, ClusterError, Connection, connect
from .facts import collect, mismatch
from .place import RESOURCE, mlx_nodes, node_facts, parse_workers, place, worker_count

__all__ = [
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
