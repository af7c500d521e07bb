"""Running a job's micro-batches through a pipeline group as worker.split.schedule plans it (issue 26).

Every rank runs the same list of micro-batches (cut from the same job, so every rank knows every shape and a
receive needs no header) through `rank_steps`: receive m from the rank before, run this rank's layers on m,
send m on; the last rank alone runs the head and collects the numbers. A rank thus computes micro-batch m + 1
while the rank after it computes m. No collective, and no B x T x V logits over a link. A capture's micro-batches
carry their rows forward instead of a head (`Riding`), and the hidden state stops at the rank the job `reach`es.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .pipeline import Pipe, passing
from .plan import head_layers, layer_ranges
from .schedule import Step, rank_steps


@dataclass(frozen=True)
class Riding:
    """Captured rows riding forward to the last rank (worker.split.schedule): `empty()` the rows before any rank
    filled its points in (rank 0's start; its shape and dtype are what a receive expects), `add(rows)` the rows
    received with this rank's points filled in (lazy). Both are asked after the micro-batch's forward is built."""

    empty: Callable[[], mx.array]
    add: Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class Micro:
    """One micro-batch: `forward()` builds this rank's lazy forward (its body output); `head(hidden)` the lazy
    numbers (last rank only; None: nothing to read, e.g. a prefix pass); `keep()` arrays every rank evaluates
    with its forward (a prefix pass's KV cache, a capture's rows of the points this rank owns); `rows`: the
    micro-batch's numbers are captured rows riding forward (the last rank reads them instead of a head)."""

    forward: Callable[[], mx.array]
    head: Callable[[mx.array], Any] | None = None
    keep: Callable[[], list] = lambda: []
    rows: Riding | None = None


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


def owner(lm: Any, layer: int) -> int:
    """The rank of `lm`'s pipeline group whose blocks hold global `layer`, from the plan the split was made by
    (worker.split.pipeline.split), which every rank knows."""
    ranges = layer_ranges(lm.n_layers, lm.group.size(), head=head_layers(lm.config))
    if ranges[lm.group.rank()] != tuple(lm.layers):
        raise RuntimeError(f"rank {lm.group.rank()} holds layers {lm.layers}, not the plan's {ranges[lm.group.rank()]}")
    return next(r for r, (start, end) in enumerate(ranges) if start <= layer < end)


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
    """One rank's run of the plan: the micro-batch built now (its body output, what its blocks handed over, the
    rows received), and whether this rank sends its hidden states on (`sends`: every micro-batch's or none)."""

    group: Any
    micros: list
    collect: Callable[[Any], None]
    sends: bool
    pipe: Pipe = field(default_factory=Pipe)
    built: int = -1
    hidden: Any = None
    kept: list = field(default_factory=list)
    rows: Any = None  # the captured rows received for the micro-batch built now (rank 0: empty)
    sending: Any = None  # the send in flight (OVERLAP)

    def build(self, m: int) -> None:
        """Micro-batch m's lazy graph, once, at its first step (a receive is built from the first block's input);
        every rank builds it, so every rank's hooks see the same forwards. The one before is let go (its caches)."""
        if self.built != m:
            if self.built >= 0:
                self.micros[self.built] = None
            self.pipe.received = self.pipe.out = None
            self.built, self.hidden = m, self.micros[m].forward()
            self.kept = self.micros[m].keep()
            self.rows = self.micros[m].rows.empty() if self.micros[m].rows is not None else None

    def step(self, step: Step) -> None:
        self.build(step.micro)
        micro, pipe = self.micros[step.micro], self.pipe
        if step.op == "recv":
            timed("wait", [pipe.received])
        elif step.op == "recv_rows":
            self.rows = mx.distributed.recv_like(self.rows, step.peer, group=self.group)
            timed("wait", [self.rows])
        elif step.op == "forward":  # the layers as far as the plan needs them: to the send, or the kept arrays
            timed("busy", [pipe.out] * self.sends + self.kept)
        elif step.op == "send" and OVERLAP:
            self.drain()
            self.sending = mx.distributed.send(pipe.out, step.peer, group=self.group, stream=_comm_stream())
            mx.async_eval(self.sending)
        elif step.op == "send":
            timed("wait", [mx.distributed.send(pipe.out, step.peer, group=self.group)])
        elif step.op == "send_rows":
            self.drain()  # after the hidden state in flight (OVERLAP): the next rank receives them in this order
            timed("wait", [mx.distributed.send(micro.rows.add(self.rows), step.peer, group=self.group)])
        else:  # "head", the last rank: the numbers, read back here
            self.answer(micro)

    def answer(self, micro: Micro) -> None:
        """The last rank's numbers: the head's, or the captured rows (their own points' computed by "forward": only
        a stack is left, not counted as busy, so a rank past the job's reach shows no busy time)."""
        if micro.rows is not None:
            self.collect(micro.rows.add(self.rows))
        elif micro.head is not None:
            out = micro.head(self.hidden)
            timed("busy", [out])
            self.collect(out)
        else:
            return
        CLOCK.micros += 1

    def drain(self) -> None:
        """Wait for the send in flight, if any (a send nobody evaluates never happens: this one was started)."""
        if self.sending is not None:
            timed("wait", [self.sending])
            self.sending = None


def run(lm: Any, micros: list[Micro], collect: Callable[[Any], None], reach: int | None = None) -> bool:
    """Run `micros` through this rank's stage of the pipeline; `collect(numbers)` per micro-batch on the last rank.
    `reach`: the last rank whose layers the job needs (capture: the deepest point's; default the last rank); rows
    ride forward when the micro-batches carry them (all alike: a job is scoring or capture). Consumes `micros`:
    each entry is let go (None) once done, so its caches go with it. Returns whether this rank is the last (the
    one holding the numbers)."""
    group = lm.group
    rank, size = group.rank(), group.size()
    rows = any(m.rows is not None for m in micros)
    steps = rank_steps(rank, size, len(micros), rows=rows, reach=reach)
    state = _Rank(group, micros, collect, any(s.op == "send" for s in steps))
    with passing(lm.model, state.pipe):
        for step in steps:
            state.step(step)
        state.drain()
    return rank == size - 1
