"""Re-forming a lost worker group from fresh processes (a process keeps its first ring for life): a fresh
placement group, fresh rank actors, a fresh hostfile with fresh free ports.

It runs in steps inside the scheduler's loop, never blocking it: each step's refs sit among the pool's `reviving`
refs that cluster.schedule.dispatch waits on with the results, so the other groups go on meanwhile. Each step has
the first formation's timeout; a step that fails or runs past it leaves the slot lost, in one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.spec import Batching, Grouping, ModelSpec

from ..connect import ClusterError
from ..place import RESOURCE
from .form import (ADDRESS, ADDRESS_TIMEOUT, FORM_TIMEOUT, JOIN_TIMEOUT, PLACE_TIMEOUT, START, START_TIMEOUT, _failure, _where,
                   joining, place_ranks, started, unplaced)
from .rank import GroupRank


def _timeouts() -> dict[str, float]:
    return {"place": PLACE_TIMEOUT, "start": START_TIMEOUT, "address": ADDRESS_TIMEOUT, "form": FORM_TIMEOUT}


@dataclass
class Recipe:
    """How the run's groups are made, kept to make one again. `actors` and `placements` are the executor's lists
    (what it stops and frees at close): a re-formed group's are added there, so they are released with the rest."""

    spec: ModelSpec
    batching: Batching
    grouping: Grouping
    actor_cls: type = GroupRank
    threads: int | None = None
    how: str = "STRICT_SPREAD"  # the first formation's placement strategy (a node gone does not make it PACK)
    join_timeout: float = JOIN_TIMEOUT
    actors: list = field(default_factory=list)
    placements: list = field(default_factory=list)
    timeouts: dict[str, float] = field(default_factory=_timeouts)  # s per step: place, start, address, form


class Reform:
    """Slot g formed again, step by step: "place" (its units free), "start" (Ray started every rank's process),
    "address" (every rank's ring address), "form" (every rank joined the ring and loaded its share). `pending`: the
    step's refs not landed yet."""

    def __init__(self, recipe: Recipe, g: int, formation: int) -> None:
        from ray.util.placement_group import placement_group

        self.recipe, self.g, self.formation = recipe, g, formation
        self.how = recipe.how
        self.pg = placement_group([{RESOURCE: 1}] * recipe.grouping.size, strategy=self.how)
        recipe.placements.append(self.pg)
        self.ranks: list = []
        self._step("place", [self.pg.ready()])

    def _step(self, name: str, refs: list) -> None:
        self.step, self.refs, self.pending = name, refs, list(refs)
        self.restart_clock()

    def restart_clock(self) -> None:
        """The step's timeout counted from now."""
        self.deadline = time.monotonic() + self.recipe.timeouts[self.step]

    def landed(self, ref: Any) -> list[dict] | None:
        """Take one of the step's refs; start the next step once all landed. Every rank's facts once the group
        holds its model, else None; a failure raises ClusterError (one line)."""
        import ray

        self.pending.remove(ref)
        try:
            ray.get(ref)
        except Exception as e:
            raise ClusterError(self._failed(ref, e)) from None
        if self.pending:
            return None
        r = self.recipe
        if self.step == "place":
            self.ranks = place_ranks(r.actor_cls, r.spec, r.batching, self.g, r.grouping.size, self.pg, r.threads, self.formation)
            r.actors.extend(self.ranks)
            self._step("start", started(self.ranks))
        elif self.step == "start":
            self._step("address", [a.address.remote() for a in self.ranks])
        elif self.step == "address":
            hosts = ray.get(self.refs)
            self._step("form", [a.form.remote(hosts, r.grouping, r.join_timeout) for a in self.ranks])
        else:
            return ray.get(self.refs)
        return None

    def _doing(self) -> str:
        return {"start": START, "address": ADDRESS}.get(self.step) or joining(self.recipe.spec)

    def _failed(self, ref: Any, error: BaseException) -> str:
        if self.step == "place":
            return f"its placement failed: {error}"
        r = self.refs.index(ref)
        return _failure(self.g, r, self.ranks[r], error, self._doing()).removeprefix(f"group g{self.g} ")

    def overdue(self) -> str | None:
        """Why the step ran past its timeout (None while it has time, or while a ref it waits on has landed)."""
        import ray

        timeout = self.recipe.timeouts[self.step]
        if time.monotonic() < self.deadline or ray.wait(self.pending, num_returns=1, timeout=0)[0]:
            return None
        if self.step == "place":
            return f"{unplaced(self.recipe.grouping.size, self.how, timeout)} (a node gone, or another run holds them)"
        r = self.refs.index(self.pending[0])
        return f"rank {r} on {_where(self.ranks[r])} did not {self._doing()} within {timeout:.0f} s"

    def abandon(self) -> None:
        """Kill its ranks, free its placement group."""
        import ray

        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        free(self.recipe.placements, self.pg)


def free(placements: list, pg: Any) -> None:
    """Remove a placement group (its `mlx` units free again) and forget it, so nothing removes it twice."""
    from ray.util.placement_group import remove_placement_group

    if pg in placements:
        placements.remove(pg)
        remove_placement_group(pg)
