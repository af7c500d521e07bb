"""Ray for Orchard: connect, find the `mlx` nodes, place one worker actor per node, its lifecycle, node facts.

The actor's names are imported on first use (PEP 562): `from cluster import ClusterError` checks a command line
without importing MLX and mlx-lm (cluster.actor's worker kernels, seconds), so `driver` says its first word fast.
"""

from __future__ import annotations

import importlib

from .connect import LOCAL, ClusterError, Connection, connect
from .facts import collect, mismatch
from .place import RESOURCE, mlx_nodes, node_facts, parse_workers, place, worker_count

_LAZY = dict.fromkeys(("Pool", "WorkerActor", "held_files", "launch", "ready", "revive", "start", "stop"), "actor")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")  # a submodule: the import system finds it
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [*_LAZY, "LOCAL", "ClusterError", "Connection", "connect", "collect", "mismatch", "RESOURCE", "mlx_nodes",
           "node_facts", "parse_workers", "place", "worker_count"]  # fmt: skip
