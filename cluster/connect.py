"""Connect to Ray: a running cluster of Macs (`auto`, `HOST:PORT`), or an embedded Ray on this machine (`local`)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

LOCAL = "local"
START_HINT = "start one with `ray start --head --resources='{\"mlx\": 1}'`, or pass --address local"


class ClusterError(RuntimeError):
    """A cluster problem stated in one line, naming the fix."""


@dataclass
class Connection:
    address: str  # "local" for the embedded Ray, else the cluster's GCS address
    embedded: bool  # started here: close() stops it

    def close(self) -> None:
        import ray

        if self.embedded and ray.is_initialized():
            ray.shutdown()


def _reachable(address: str, timeout: float = 3.0) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"bad --address {address!r}: use auto, local or HOST:PORT (e.g. 10.0.0.2:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ClusterError(f"cannot reach a Ray cluster at {address} ({reason}): {START_HINT}") from None


def connect(address: str | None = None, *, local_workers: int = 1, dashboard: bool = False) -> Connection:
    """Join the cluster at `address` (None: $RAY_ADDRESS, else embedded), or reuse this process's Ray connection.

    The embedded Ray binds 127.0.0.1 and offers `local_workers` units of the `mlx` resource, so N workers run on
    this machine exactly as they would on N Macs.
    """
    import ray

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto", current):  # one process holds one Ray connection
            if address != LOCAL and not address.startswith("ray://"):
                _reachable(address)
            raise ClusterError(f"this process is already connected to Ray at {current}: it cannot also join {address}")
        return Connection(current, embedded=False)
    address = address or os.environ.get("RAY_ADDRESS") or LOCAL
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address == LOCAL:
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=dashboard,
            resources={"mlx": local_workers},
            **quiet,
        )
        return Connection(LOCAL, embedded=True)
    target = address
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            target = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError):
            target = None
        if target is None:
            raise ClusterError(f"--address auto found no running Ray cluster on this machine: {START_HINT}")
    if not target.startswith("ray://"):
        _reachable(target)
    try:
        ray.init(address=target, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ClusterError(f"cannot connect to Ray at {target}: {first}") from None
    return Connection(target, embedded=False)
