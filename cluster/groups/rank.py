"""One rank of a worker group: a worker actor that joins its group's `mx.distributed` ring and loads only its share.

The constructor loads nothing: the head first asks every rank for an address (`address`), then hands all of
them the same hostfile (`form`). Every rank gets the same calls in the same order (the lockstep rule of
notes/GROUPS.md); the answering rank (worker.split.answering_rank: the last under pipeline, the one rank that
computes a pipelined kernel's numbers; rank 0 under tensor) returns the group's results, the others
`(indices, None)` or only their steering notes.
A rank is never restarted: a process keeps its first ring for life; a lost group is re-formed from fresh ranks
(cluster.groups.reform).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.jobs import Results, run
from worker.load import load, resolve
from worker.spec import Batching, Grouping, Job, ModelSpec
from worker.split import answering_rank, peak_memory_gb
from worker.split.stages import CLOCK

from ..actor import WorkerActor


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class GroupRank(WorkerActor):
    """Rank `rank_in_group` of group `group`; `rank` is its place among all ranks of the run; `formation`: 0 for
    the run's first group in this slot, n for its n-th re-forming (fresh processes: `restarted`)."""

    def __init__(self, spec: ModelSpec, batching: Batching, rank: int = 0, group: int = 0, rank_in_group: int = 0,
                 formation: int = 0):  # fmt: skip
        self.rank, self.batching, self.spec = rank, batching, spec
        self.group, self.rank_in_group, self.formation = group, rank_in_group, formation
        self.restarted, self.error, self.lm = formation > 0, None, None
        self.grouping: Grouping | None = None

    def address(self) -> str:
        """'host:port' where this rank listens in the ring: this node's address and a free port."""
        from worker.split.ring import free_address

        return free_address(_node_ip())

    def form(self, hostfile: list[str], grouping: Grouping, timeout: float) -> dict:
        """Join the ring with the group's other ranks, load this rank's share; this rank's facts."""
        from worker.split.ring import join

        self.grouping = grouping
        folder = resolve(self.spec.model, self.spec.revision, self.spec.adapter_path)
        self.check_fits(folder, grouping.size)
        ring = join(hostfile, self.rank_in_group, timeout)
        self.lm = load(self.spec.model_copy(update={"model": str(folder)}), group=ring, grouping=grouping)
        return self.facts()

    def facts(self) -> dict:
        if self.lm is None:  # asked before form (or after it failed): nothing to tell yet
            return {"rank": self.rank, "group": self.group, "rank_in_group": self.rank_in_group}
        layers = getattr(self.lm, "layers", None)
        return {
            **super().facts(),
            "group": self.group,
            "rank_in_group": self.rank_in_group,
            "formation": self.formation,
            "group_size": self.grouping.size if self.grouping else 1,
            "split": self.grouping.split if self.grouping else None,
            "layers": list(layers) if layers is not None else None,
            "peak_memory_gb": peak_memory_gb(),
        }

    def peak_memory(self) -> dict:
        """What a rank tells after the work: its peak memory, and the seconds it spent in pipelined jobs computing
        (busy) and waiting on transfers (issue 26: a balanced pipeline keeps every rank's busy share high)."""
        fraction = CLOCK.busy_fraction()
        return {"peak_memory_gb": peak_memory_gb(), "busy_s": round(CLOCK.busy, 3), "wait_s": round(CLOCK.wait, 3),
                "busy_fraction": None if fraction is None else round(fraction, 3)}  # fmt: skip

    def run(self, job: Job, indices: Sequence[int], requests: Sequence[Any]) -> tuple[Sequence[int], list | None]:
        """The answering rank: the group's results. The others: None, or only their steering notes (a note is made
        by the rank that owns the steered layer)."""
        results = run(self.lm, job, requests, self.batching)
        if self.rank_in_group == answering_rank(self.grouping):
            return indices, results
        notes = getattr(results, "notes", ())
        return indices, (Results((), notes) if notes else None)
