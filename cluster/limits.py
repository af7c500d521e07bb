"""How many workers this machine can hold when Ray runs embedded here (`--address local`), checked before Ray starts.

Every worker is a process of its own holding a full copy of the model's weights, so N workers on one machine need
N copies in memory and share its CPU cores. Measured on Linux (mlx[cpu], the 1 MB stories260K model, --threads 1):
a worker process holds ~300 MB (proportional set size; 417 MB resident) before its weights, and Ray's own
processes (GCS, raylet, agents) ~0.9 GB. Beyond a few workers per core they only take turns: no faster, slower to
start, and past the memory they are killed one by one while the machine swaps.
"""

from __future__ import annotations

import os
import sys

from .connect import LOCAL, ClusterError, source_of

WORKER_OVERHEAD = 400 << 20  # bytes per worker process beyond its weights (measured ~300 MB, rounded up)
RAY_OVERHEAD = 1 << 30  # bytes for Ray's own processes on this machine (measured ~0.9 GB)
WORKERS_PER_CORE = 4  # beyond this, workers only take turns on the cores


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def local_problem(workers: int, *, cores: int, available: int, weights: int, size: int = 1) -> str | None:
    """Why `workers` workers (groups of `size` processes, each holding 1/size of the weights) do not fit on this
    machine (its `cores` and `available` bytes of memory, the model's `weights` bytes per copy), as one line naming
    the limit and the fix; None when they fit."""
    by_cores = max(1, cores * WORKERS_PER_CORE) // size
    per_worker = size * (-(-weights // size) + WORKER_OVERHEAD)
    by_memory = max(0, (available - RAY_OVERHEAD) // per_worker)
    grouped = f" --group-size {size} ({workers * size} worker processes)" if size > 1 else ""
    where = f"--workers {workers}{grouped} with Ray on this machine (--address local)"
    if workers > by_cores:
        fit = f"pass --workers {by_cores} or fewer" if by_cores else "pass a smaller --group-size"
        return (
            f"{where}: it has {cores} CPU core{'s' * (cores != 1)}, room for at most {max(1, cores * WORKERS_PER_CORE)} "
            f"worker processes ({WORKERS_PER_CORE} per core): {fit}, or --address a cluster with more Macs"
        )
    if workers > by_memory:
        need = RAY_OVERHEAD + workers * per_worker
        fit = f"pass --workers {by_memory} or fewer" if by_memory else "free memory or use a smaller model"
        copies = f"{workers} copies of the model ({_gb(weights)} of weights each)"
        return (
            f"{where}: {copies} plus {_gb(WORKER_OVERHEAD)} per worker process and {_gb(RAY_OVERHEAD)} for "
            f"Ray need {_gb(need)}, but {_gb(available)} of memory is available: {fit}, or --address a cluster with more Macs"
        )
    return None


def machine() -> tuple[int, int]:
    """(CPU cores this process may use, bytes of memory available now)."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, psutil.virtual_memory().available


def model_weights(model: str) -> int:
    """Bytes of a local model folder's weights; 0 when not known here (a Hub repo id)."""
    from pathlib import Path

    from worker.load import is_local, weights_bytes

    try:
        return weights_bytes(Path(model).expanduser()) if is_local(model) else 0
    except OSError:
        return 0


def check_local(workers: int | str, address: str | None, model: str, size: int = 1) -> None:
    """ClusterError (one line) when `workers` workers (groups of `size`) of `model` cannot run on this machine's
    embedded Ray; nothing when the address is a cluster, or this process is already connected to a Ray (its
    resources rule)."""
    ray = sys.modules.get("ray")
    if workers == "all" or source_of(address)[0] != LOCAL or (ray is not None and ray.is_initialized()):
        return
    cores, available = machine()
    problem = local_problem(int(workers), cores=cores, available=available, weights=model_weights(model), size=size)
    if problem:
        raise ClusterError(problem)
