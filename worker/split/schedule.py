"""The pipeline schedule of a job's micro-batches across the ranks of a pipeline group: a pure plan of steps.

Forward-only GPipe, as DeepSpeed's `InferenceSchedule`: at step t stage s runs micro-batch t - s, so once the
pipe is full every rank works, each on another micro-batch. Per rank that is, for every micro-batch m in order:
receive m from the rank before (not rank 0), run this rank's layers on m, then send m to the rank after or, on
the last rank only, run the head (final norm, vocabulary head, log-softmax, the numbers a request needs).
Transfers go to ring neighbours only and need no header: every rank cuts the same micro-batches from the job.
No step is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal["recv", "forward", "send", "head"]


@dataclass(frozen=True)
class Step:
    """One thing a rank does: `op` on micro-batch `micro`; recv/send name the neighbour (`peer`)."""

    op: Op
    micro: int
    peer: int | None = None


def rank_steps(rank: int, size: int, micros: int) -> list[Step]:
    """Rank `rank`'s steps, in order, for `micros` micro-batches through `size` stages."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a pipeline of {size}: give a rank in 0..{size - 1}")
    steps: list[Step] = []
    for m in range(micros):
        if rank > 0:
            steps.append(Step("recv", m, rank - 1))
        steps.append(Step("forward", m))
        steps.append(Step("send", m, rank + 1) if rank < size - 1 else Step("head", m))
    return steps


def timeline(size: int, micros: int) -> list[list[int | None]]:
    """Per clock step t, the micro-batch each stage runs (t - s), None while it waits for the pipe to fill or
    drain: `size + micros - 1` steps in all."""
    return [[t - s if 0 <= t - s < micros else None for s in range(size)] for t in range(size + micros - 1)]


def efficiency(size: int, micros: int) -> float:
    """Share of stage-steps busy with equal stages (fill and drain idle): micros / (micros + size - 1)."""
    return micros / (micros + size - 1) if micros else 0.0
