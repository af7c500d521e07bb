"""Running a job's micro-batches through a pipeline group as worker.split.schedule plans it (issue 26).

Every rank runs the same list of micro-batches (cut from the same job, so every rank knows every shape and a
receive needs no header) through `rank_steps`: receive m from the rank before, run this rank's layers on m,
send m on; the last rank alone runs the head and collects the numbers. A rank thus computes micro-batch m + 1
while the rank after it computes m. No collective, and no B x T x V logits over a link.

With OVERLAP (ORCHARD_PIPELINE_OVERLAP=1) a send runs on a stream of its own (mx.async_eval) while this rank
computes the next micro-batch, one send in flight; off by default: the ring busy-polls its socket while a send
waits, which on a rank given one core takes that core from the compute (bench/README.md, bench_pipeline).

A transfer is evaluated on its own (its time counted as waiting on `CLOCK`), so a dead peer fails it at once
("[ring] ..."), and a hung one is caught by the group deadline as before (cluster.groups.pool). Unsplit and
tensor-split models never come here (`pipelined`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .pipeline import Pipe, passing
from .schedule import Step, rank_steps


@dataclass(frozen=True)
class Micro:
    """One micro-batch: `forward()` builds this rank's lazy forward (its body output); `head(hidden)` the lazy
    numbers (last rank only; None: nothing to read, e.g. a prefix pass); `keep()` arrays every rank evaluates
    with its forward (a prefix pass's KV cache)."""

    forward: Callable[[], mx.array]
    head: Callable[[mx.array], Any] | None = None
    keep: Callable[[], list] = lambda: []


@dataclass
class Clock:
    """Seconds this process spent in pipelined jobs: computing (its layers, the head) and in transfers."""

    busy: float = 0.0
    wait: float = 0.0
    micros: int = 0

    def busy_fraction(self) -> float | None:
        total = self.busy + self.wait
        return self.busy / total if total > 0 else None


CLOCK = Clock()
OVERLAP = os.environ.get("ORCHARD_PIPELINE_OVERLAP") == "1"
_COMM: list = []  # the stream sends run on under OVERLAP, made on first use


def _comm_stream() -> Any:
    if not _COMM:
        _COMM.append(mx.new_stream(mx.cpu))
    return _COMM[0]


def pipelined(lm: Any) -> bool:
    """Whether `lm` is one rank of a pipeline group of 2 or more (the pipelined kernels' case)."""
    grouping, group = getattr(lm, "grouping", None), getattr(lm, "group", None)
    return group is not None and grouping is not None and grouping.split == "pipeline" and group.size() > 1


def timed(what: str, arrays: list) -> None:
    start = time.perf_counter()
    mx.eval(arrays)
    elapsed = time.perf_counter() - start
    if what == "wait":
        CLOCK.wait += elapsed
    else:
        CLOCK.busy += elapsed


@dataclass
class _Rank:
    """One rank's run of the plan: the micro-batch built now (its body output and what its blocks handed over)."""

    group: Any
    micros: Sequence[Micro]
    collect: Callable[[Any], None]
    pipe: Pipe = field(default_factory=Pipe)
    built: int = -1
    hidden: Any = None
    kept: list = field(default_factory=list)
    sending: Any = None  # the send in flight (OVERLAP)

    def build(self, m: int) -> None:
        """Micro-batch m's lazy graph, once, at its first step (a receive is built from the first block's input)."""
        if self.built != m:
            self.pipe.received = self.pipe.out = None
            self.built, self.hidden = m, self.micros[m].forward()
            self.kept = self.micros[m].keep()

    def step(self, step: Step) -> None:
        self.build(step.micro)
        micro, pipe = self.micros[step.micro], self.pipe
        if step.op == "recv":
            timed("wait", [pipe.received])
        elif step.op == "forward":
            timed("busy", [pipe.out if pipe.out is not None else self.hidden, *self.kept])
        elif step.op == "send" and OVERLAP:
            self.drain()
            self.sending = mx.distributed.send(pipe.out, step.peer, group=self.group, stream=_comm_stream())
            mx.async_eval(self.sending)
        elif step.op == "send":
            timed("wait", [mx.distributed.send(pipe.out, step.peer, group=self.group)])
        elif micro.head is not None:  # "head", the last rank: the numbers, read back here
            out = micro.head(self.hidden)
            timed("busy", [out])
            self.collect(out)
            CLOCK.micros += 1


    def drain(self) -> None:
        """Wait for the send in flight, if any (a send nobody evaluates never happens: this one was started)."""
        if self.sending is not None:
            timed("wait", [self.sending])
            self.sending = None


def run(lm: Any, micros: Sequence[Micro], collect: Callable[[Any], None]) -> bool:
    """Run `micros` through this rank's stage of the pipeline; `collect(numbers)` per micro-batch on the last rank.
    Returns whether this rank is the last (the one holding the numbers)."""
    group = lm.group
    rank, size = group.rank(), group.size()
    state = _Rank(group, micros, collect)
    with passing(lm.model, state.pipe):
        for step in rank_steps(rank, size, len(micros)):
            state.step(step)
        state.drain()
    return rank == size - 1
