"""Forming N worker groups of K ranks: count the `mlx` units, place each group (a placement group of K bundles,
STRICT_SPREAD so its ranks sit on distinct nodes; packed where one node offers every unit, as the embedded local
Ray does), wait for Ray to start every rank's process, ask every rank for its ring address, hand all of a group's
ranks the same hostfile and let them join and load concurrently, each step within its bounded wait. A failure is one ClusterError line naming the group, rank and node;
every actor and placement group made is then released."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from worker.load import ModelLoadError
from worker.spec import Batching, Grouping, ModelSpec

from ..connect import ClusterError
from ..failures import _actor_id, _actor_record, _death, node_label
from ..place import MLX_HINT, RESOURCE, mlx_nodes, place
from .rank import GroupRank

JOIN_TIMEOUT = 30.0  # s for every rank of a group to join its ring
FORM_TIMEOUT = 900.0  # s for a group to join and load its shares (a large model from disk)
PLACE_TIMEOUT = 30.0  # s for a group's units to be free
# s for Ray to start every rank's process: a fresh Python importing MLX, mlx-lm and transformers takes seconds on an
# idle Mac and minutes on a machine busy with other work (a process that fails to start is Ray's error at once)
START_TIMEOUT = 600.0
ADDRESS_TIMEOUT = 60.0  # s for every started rank to give its ring address (its process is up: no start in it)
START, ADDRESS = "start", "give its ring address"


@dataclass
class Formed:
    """What forming left standing: the rank actors per group, their placement groups, and each rank's facts."""

    ranks: list[list] = field(default_factory=list)
    placements: list = field(default_factory=list)
    facts: list[list[dict]] = field(default_factory=list)

    def actors(self) -> list:
        return [a for group in self.ranks for a in group]


def group_count(requested: int | str, size: int) -> int:
    """How many groups of `size` to form: all the cluster's `mlx` units hold (or `requested`), checked."""
    nodes = mlx_nodes()
    units = sum(math.floor(n["Resources"][RESOURCE]) for n in nodes)
    fits = units // size
    if units == 0:
        raise ClusterError(f"the Ray cluster has no node with the `{RESOURCE}` resource: {MLX_HINT}")
    n = fits if requested == "all" else int(requested)
    if n < 1 or n > fits:
        raise ClusterError(
            f"--workers {requested} --group-size {size} needs {max(n, 1) * size} `{RESOURCE}` nodes but the cluster has "
            f"{units} ({len(nodes)} node{'s' * (len(nodes) != 1)}): pass --workers {fits} or a smaller --group-size"
            if fits else f"--group-size {size} needs {size} `{RESOURCE}` nodes but the cluster has {units}: {MLX_HINT}"
        )
    return n


def strategy(size: int) -> str:
    """STRICT_SPREAD (one rank per node) where there are enough `mlx` nodes; else one node holds every unit (the
    embedded local Ray): its ranks are K processes on this machine, ring over 127.0.0.1."""
    return "STRICT_SPREAD" if len(mlx_nodes()) >= size else "PACK"


def _placement(size: int, how: str, g: int, timeout: float) -> Any:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{RESOURCE: 1}] * size, strategy=how)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(f"group g{g}: {unplaced(size, how, timeout)} (another run holds them?): wait for it or pass fewer --workers")
    return pg


def unplaced(size: int, how: str, timeout: float) -> str:
    """'K `mlx` units on distinct nodes were not free within T s'."""
    return f"{size} `{RESOURCE}` units on {'distinct nodes' if how == 'STRICT_SPREAD' else 'one node'} were not free within {timeout:.0f} s"


def _where(actor: Any) -> str:
    address = _actor_record(_actor_id(actor)).get("Address") or {}
    return node_label(address.get("NodeID"), address.get("IPAddress"))


def _failure(g: int, r: int, actor: Any, error: BaseException, doing: str) -> str:
    """One line: which group and rank, on which node, what went wrong while `doing`."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError) and isinstance(error.cause, ModelLoadError):
        what = f"cannot {doing}: {error.cause}"
    elif isinstance(error, RayTaskError):
        cause = error.cause if error.cause is not None else error
        what = f"failed to {doing}: {(str(cause).strip().splitlines() or [type(cause).__name__])[0]}"
    elif isinstance(error, RayActorError):
        what = f"{_death(_actor_record(_actor_id(actor)))[0]} while trying to {doing}"
    else:
        what = f"failed to {doing}: {error}"
    return f"group g{g} rank {r} on {_where(actor)} {what}"


def _gather(formed: Formed, refs: list[list], doing: str, timeout: float) -> list[list]:
    """Every group's answers, each group within `timeout` s; the first failure as one ClusterError line."""
    import ray

    answers = []
    deadline = time.monotonic() + timeout
    for g, (ranks, group_refs) in enumerate(zip(formed.ranks, refs)):
        pending = list(group_refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                r = group_refs.index(pending[0])
                raise ClusterError(f"group g{g} rank {r} on {_where(ranks[r])} did not {doing} within {timeout:.0f} s")
            try:
                ray.get(ready[0])
            except Exception as e:
                r = group_refs.index(ready[0])
                raise ClusterError(_failure(g, r, ranks[r], e, doing)) from None
        answers.append(ray.get(group_refs))
    return answers


def place_ranks(cls: type, spec: ModelSpec, batching: Batching, g: int, size: int, pg: Any, threads: int | None,
                formation: int = 0) -> list:  # fmt: skip
    """Group g's rank actors in its placement group; `formation`: how many times the group was formed before."""
    per = [{"rank": g * size + r, "group": g, "rank_in_group": r, "formation": formation} for r in range(size)]
    return place(cls, size, spec, batching, max_restarts=0, threads=threads, per_worker=per, placement=pg)


def started(ranks: list) -> list:
    """A ref per rank that lands once Ray has started its process (the constructor ran)."""
    return [a.__ray_ready__.remote() for a in ranks]


def launch(spec: ModelSpec, batching: Batching, n: int, grouping: Grouping, *, actor_cls: type = GroupRank,
           threads: int | None = None, join_timeout: float = JOIN_TIMEOUT) -> tuple[Formed, list[list]]:  # fmt: skip
    """Place N groups of `grouping.size` ranks and start each rank joining its ring and loading its share while
    the caller goes on; (what was formed, refs to each rank's facts): pass both to `ready`."""
    formed, how = Formed(), strategy(grouping.size)
    try:
        for g in range(n):
            formed.placements.append(_placement(grouping.size, how, g, PLACE_TIMEOUT))
            formed.ranks.append(place_ranks(actor_cls, spec, batching, g, grouping.size, formed.placements[-1], threads))
        _gather(formed, [started(ranks) for ranks in formed.ranks], START, START_TIMEOUT)
        hostfiles = _gather(formed, [[a.address.remote() for a in ranks] for ranks in formed.ranks], ADDRESS, ADDRESS_TIMEOUT)
        refs = [[a.form.remote(hosts, grouping, join_timeout) for a in ranks] for ranks, hosts in zip(formed.ranks, hostfiles)]
    except BaseException:
        release(formed)
        raise
    return formed, refs


def ready(formed: Formed, refs: list[list], spec: ModelSpec, timeout: float = FORM_TIMEOUT) -> list[list[dict]]:
    """Each rank's facts once every group holds its model; a failure is one line, and every group is released."""
    try:
        formed.facts = _gather(formed, refs, joining(spec), timeout)
    except BaseException:
        release(formed)
        raise
    return formed.facts


def joining(spec: ModelSpec) -> str:
    return f"join its ring and load {spec.model}"


def form(spec: ModelSpec, batching: Batching, n: int, grouping: Grouping, **options: Any) -> Formed:
    """`launch` then `ready`: N groups holding their shares of the model."""
    formed, refs = launch(spec, batching, n, grouping, **options)
    ready(formed, refs, spec)
    return formed


def release(formed: Formed) -> None:
    """Kill every rank and free the groups' placement groups (their `mlx` units)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from ..actor import stop

    if not ray.is_initialized():
        return
    stop(formed.actors())
    for pg in formed.placements:
        remove_placement_group(pg)
    formed.placements.clear()  # the executor holds the same list: nothing is removed twice


def ready_groups(formed: Formed, refs: list[list], spec: ModelSpec, files: dict | None = None) -> list[dict]:
    """`ready`, then the checks every run makes (the same versions and model files on every rank, the head's
    files); the facts per group: rank 0's, with every rank's under "ranks"."""
    import sys

    from ..actor import _other_files, held_files
    from ..facts import mismatch, slow_blas

    ranks = [f for group in ready(formed, refs, spec) for f in group]
    problem = mismatch(ranks, who="ranks")
    if problem is None and files is not None:
        problem = _other_files(held_files(ranks[0]), files, ranks[0]["hostname"], spec.model)
    if problem:
        release(formed)
        raise ClusterError(problem)
    warning = slow_blas(ranks)
    if warning:
        print(warning, file=sys.stderr)
    return [{**group[0], "ranks": [rank_row(f) for f in group]} for group in formed.facts]


def rank_row(facts: dict) -> dict:
    """What the summary keeps of one rank: where it runs, the layers it holds, its peak memory, and its group's
    formation (0: the run's first; n: re-formed n times)."""
    keys = ("rank_in_group", "node_id", "hostname", "layers", "peak_memory_gb", "formation")
    return {k: facts.get(k) for k in keys}


def names(facts: list[dict]) -> list[str]:
    """'g0@host1+host2' per group (the progress bar's and the summary's worker names)."""
    return [f"g{f['group']}@{'+'.join(r['hostname'] for r in f['ranks'])}" for f in facts]
