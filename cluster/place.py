"""Find the `mlx` nodes and place one worker actor on each (every Mac runs `ray start --resources='{"mlx": 1}'`)."""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

from .connect import ClusterError
from .facts import fast_blas

RESOURCE = "mlx"
MLX_HINT = "start each Mac with `ray start --address HEAD:6379 --resources='{\"mlx\": 1}'`"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def parse_workers(value: int | str) -> int | str:
    """`--workers`: a positive count, or "all" (every `mlx` node)."""
    if str(value).strip().lower() == "all":
        return "all"
    text = str(value).strip()
    if not (isinstance(value, (int, str)) and not isinstance(value, bool) and re.fullmatch(r"[+-]?[0-9]+", text)):
        # ASCII digits only, as driver.checks.settings.integer: int() would read `1_0` as 10 and "٣" as 3
        raise ClusterError(f"--workers {value!r} is not a number: pass a count such as 4 (ASCII digits), or all")
    n = int(text)
    if n < 1:
        raise ClusterError(f"--workers {n}: at least 1 worker is needed (or pass all for every mlx node)")
    return n


def mlx_nodes() -> list[dict]:
    """Alive nodes offering the `mlx` resource, as `ray.nodes()` describes them."""
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(RESOURCE, 0) >= 1]


def worker_count(requested: int | str, wait: float = 10.0) -> int:
    """How many workers to start: checked against the `mlx` units the cluster has, and has free within `wait` s."""
    import ray

    nodes = mlx_nodes()
    units = sum(math.floor(n["Resources"][RESOURCE]) for n in nodes)
    if units == 0:
        raise ClusterError(f"the Ray cluster has no node with the `{RESOURCE}` resource: {MLX_HINT}")
    n = units if requested == "all" else requested
    if n > units:
        raise ClusterError(
            f"--workers {n} needs {n} `{RESOURCE}` nodes but the cluster has {units} "
            f"({len(nodes)} node{'s' * (len(nodes) != 1)}): {MLX_HINT}, or pass --workers {units}"
        )
    deadline = time.monotonic() + wait  # a previous run's workers free their units shortly after they exit
    while (free := math.floor(ray.available_resources().get(RESOURCE, 0))) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    if n > free:
        raise ClusterError(
            f"--workers {n}: only {free} of the cluster's {units} `{RESOURCE}` units are free "
            f"(another run holds the rest): wait for it or pass --workers {free}"
        )
    return n


def worker_env(threads: int | None = None) -> dict | None:
    """The runtime_env of a worker process: thread caps, and on Linux a fast BLAS preloaded when there is one."""
    env_vars = {v: str(threads) for v in THREAD_VARS} if threads else {}
    preload = fast_blas()
    if preload and "LD_PRELOAD" not in os.environ:
        env_vars["LD_PRELOAD"] = preload
    return {"env_vars": env_vars} if env_vars else None


def place(
    cls: type, n: int, *args: Any, max_restarts: int = 3, threads: int | None = None, per_worker: list[dict] | None = None,
    placement: Any = None,
) -> list:
    """Start `n` actors of `cls`, each holding one `mlx` unit, so no two share a Mac.

    `per_worker[i]` adds keyword arguments for worker i (its rank). A crashed actor is restarted (its
    constructor runs again) up to `max_restarts` times; its calls are never retried by Ray: the scheduler
    re-queues them. `threads` caps the BLAS/OpenMP threads of each actor (several workers on one machine).
    On Linux the actors preload a fast BLAS when this machine has one (`cluster.facts.fast_blas`): the
    variable must be set before the process starts, so it travels in the actor's runtime_env. `placement`: a
    placement group of n bundles (a worker group, cluster.groups): actor i takes bundle i.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(cls)
    options = dict(resources={RESOURCE: 1}, num_cpus=0, max_restarts=max_restarts, max_task_retries=0, runtime_env=worker_env(threads))
    on = [{} if placement is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=i)} for i in range(n)]
    return [actor.options(**options, **on[i]).remote(*args, **(per_worker[i] if per_worker else {})) for i in range(n)]


def node_facts() -> list[dict]:
    """`cluster.facts.collect()` run on every `mlx` node (no model loaded, no `mlx` unit held)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .facts import collect

    task, env = ray.remote(collect), worker_env()  # the BLAS a worker there would run with
    on = [task.options(num_cpus=0, runtime_env=env, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)) for n in mlx_nodes()]
    return ray.get([t.remote() for t in on])
