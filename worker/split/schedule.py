"""The pipeline schedule of a job's micro-batches across the ranks of a pipeline group: a pure plan of steps.

Forward-only GPipe, as DeepSpeed's `InferenceSchedule`: at step t stage s runs micro-batch t - s, so once the
pipe is full every rank works, each on another micro-batch. Per rank that is, for every micro-batch m in order:
receive m from the rank before (not rank 0), run this rank's layers on m, then send m to the rank after or, on
the last rank only, run the head (final norm, vocabulary head, log-softmax, the numbers a request needs).
Transfers go to ring neighbours only and need no header: every rank cuts the same micro-batches from the job.
No step is a collective.

Capture (`rows=True`, `reach`) answers from the last rank too (worker.split.plan.answering_rank: the one place that
says which rank's results are the group's): the captured rows ride forward to it. Each rank receives the rows
gathered so far, fills in the points its layers own, and sends them on (recv_rows / send_rows: [rows, points,
width] float32, small beside a hidden state); the last rank's "head" reads them. The hidden state goes only as
far as the rank owning the deepest point (`reach`): the ranks past it run no layers, as the unsplit capture runs
no block past its deepest point, and only pass the rows on.

Decoding (`round_opening`, `round_steps`) goes round the whole ring instead: a round of a micro-batch is one
forward of its live rows (the prefill, then one new token a round); the last rank samples and sends the new ids
to rank 0 (its ring neighbour), which feeds them to the next round. The ids travel on from rank 0 towards the
last rank ahead of the hidden state, one int per row of the micro-batch (-1: the row is done), so every rank
drops the same rows and derives the next shapes from them; a round whose ids are all done closes the
micro-batch on every rank. Every live micro-batch takes its round in turn, so with M >= K micro-batches every
rank has work while the others run theirs. A micro-batch's prefill round runs one forward per part (its rows'
prompts, or their suffixes after one shared few-shot prefix), each sent on as it is done; the last rank samples
once all are in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal["recv", "forward", "send", "head", "recv_ids", "send_ids", "sample", "recv_rows", "send_rows"]


@dataclass(frozen=True)
class Step:
    """One thing a rank does: `op` on micro-batch `micro`; recv/send name the neighbour (`peer`); `forward`: which
    of the round's forwards a recv, forward or send belongs to (a decoding micro-batch's prefill runs one per part)."""

    op: Op
    micro: int
    peer: int | None = None
    forward: int = 0


def rank_steps(rank: int, size: int, micros: int, *, rows: bool = False, reach: int | None = None) -> list[Step]:
    """Rank `rank`'s steps, in order, for `micros` micro-batches through `size` stages. `rows`: captured rows ride
    forward to the last rank; `reach`: the last rank whose layers the job needs (default: the last rank)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a pipeline of {size}: give a rank in 0..{size - 1}")
    reach = size - 1 if reach is None else reach
    if not 0 <= reach < size:
        raise ValueError(f"reach {reach} is outside a pipeline of {size}: give a rank in 0..{size - 1}")
    steps: list[Step] = []
    for m in range(micros):
        if 0 < rank <= reach:
            steps.append(Step("recv", m, rank - 1))
        if rows and rank > 0:
            steps.append(Step("recv_rows", m, rank - 1))
        if rank <= reach:
            steps.append(Step("forward", m))
        if rank < reach:
            steps.append(Step("send", m, rank + 1))
        if rows and rank < size - 1:
            steps.append(Step("send_rows", m, rank + 1))
        if rank == size - 1:
            steps.append(Step("head", m))
    return steps


def timeline(size: int, micros: int) -> list[list[int | None]]:
    """Per clock step t, the micro-batch each stage runs (t - s), None while it waits for the pipe to fill or
    drain: `size + micros - 1` steps in all."""
    return [[t - s if 0 <= t - s < micros else None for s in range(size)] for t in range(size + micros - 1)]


def efficiency(size: int, micros: int) -> float:
    """Share of stage-steps busy with equal stages (fill and drain idle): micros / (micros + size - 1)."""
    return micros / (micros + size - 1) if micros else 0.0


def round_opening(rank: int, size: int, micro: int, *, first: bool) -> list[Step]:
    """A decoding round's first step on `rank`: receive micro-batch `micro`'s ids (rank 0 from the last rank),
    none in the prefill round (the rows are the prompts) and none on the last rank (it sampled them)."""
    return [] if first or rank == size - 1 else [Step("recv_ids", micro, (rank - 1) % size)]


def round_steps(rank: int, size: int, micro: int, *, first: bool, done: bool = False, forwards: int = 1) -> list[Step]:
    """The rest of the round on `rank`, once its ids are known: pass the ids on (ranks before the last but one;
    not in the prefill round); then, unless the round closes the micro-batch (`done`: every row finished), per
    forward of the round (`forwards`: a prefill runs one per part of the micro-batch, each its rows' prompts or
    their suffixes after one shared prefix), receive the hidden state (ranks > 0), run this rank's layers, and
    send the hidden state on; the last rank then samples the new ids and sends them to rank 0."""
    steps = [] if first or rank >= size - 2 else [Step("send_ids", micro, rank + 1)]
    if done:
        return steps
    for k in range(forwards):
        if rank > 0:
            steps.append(Step("recv", micro, rank - 1, k))
        steps.append(Step("forward", micro, forward=k))
        if rank < size - 1:
            steps.append(Step("send", micro, rank + 1, k))
    return steps if rank < size - 1 else [*steps, Step("sample", micro), Step("send_ids", micro, 0)]


def decode_steps(rank: int, size: int, rounds: list[int], prefills: list[int] | None = None) -> list[Step]:
    """Rank `rank`'s whole decode when micro-batch m runs `rounds[m]` rounds (then one closing round), its prefill
    round `prefills[m]` forwards (default 1), every live micro-batch taking its round in turn: what the runner
    (worker.split.decode) does, as a plan."""
    steps: list[Step] = []
    for t in range(max(rounds, default=0) + 1):
        for m, n in enumerate(rounds):
            if t <= n:
                forwards = prefills[m] if prefills and t == 0 else 1
                steps += round_opening(rank, size, m, first=t == 0)
                steps += round_steps(rank, size, m, first=t == 0, done=t == n, forwards=forwards)
    return steps


def simulate(stages: list[float], link: float, micros: int, rounds: int = 1) -> float:
    """Efficiency of the decoding ring from per-stage compute seconds per micro-batch and one link's seconds per
    hand-over: the ideal time (each stage's mean share of the work) over the simulated makespan. Each stage runs
    its micro-batches in order; a micro-batch's next round starts once the last stage's ids are back at stage 0."""
    size = len(stages)
    free = [0.0] * size  # when each stage is next free
    ready = [0.0] * micros  # when each micro-batch's input is at stage 0
    for _ in range(rounds):
        for m in range(micros):
            t = ready[m]
            for s in range(size):
                t = max(t, free[s]) + stages[s]
                free[s] = t
                t += link
            ready[m] = t
    span = max(free)
    return sum(stages) * micros * rounds / size / span if span else 0.0
