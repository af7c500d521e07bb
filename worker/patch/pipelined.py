"""The patch kernel on one rank of a pipeline group: the unsplit kernel's numbers, the last rank answering.

Pairs' runs and exact rows are micro-batches through worker.split.stages (rank r runs one while rank r + 1 runs
the one before; the last rank alone reads the logit differences), every hook installed once for the phase and
aimed at each micro-batch's rows as its graph is built (hooks act when the graph is built). A rank keeps the
activations of its own layers only, which are the only ones its hooks put in. What pipelining trades: an exact row
runs every block rather than starting from the corrupt state below its layer (the blocks below it are on other
ranks; worker.grid.pipelined weighs the same trade for steering grids).

Attribution runs the backward round the ring by hand, per pair: the forward goes up as hidden states (each rank
its blocks), the last rank takes the vjp of the metric and sends d metric / d (its input) down; each rank below
takes its blocks' vjp with that cotangent (its input fed back in as a primal, `_Feed`) and sends its own input's
down, as far as the lowest rank holding a cell. Each rank dots its own cells; one all_sum hands the last rank all.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..hooks import HookContext, Rows
from ..hooks.manager import point_layer
from ..spec import Batching
from ..split import stages
from ..split.pipeline import Pipe, passing
from ..split.plan import head_layers, layer_ranges
from .attribution import Nudge, pick, sums, wanted
from .exact import Row, Put, aim, batches
from .pairs import Pair, logit_diff, pair_body, pair_lds, point, recorders, settle
from .spec import PatchRequest


def run_pairs(lm, pairs: Sequence[Pair], requests: Sequence[PatchRequest]) -> None:
    """Every pair's runs as one micro-batch each: each rank keeps its layers' activations, the last rank the lds."""
    records, kept = recorders(pairs, requests), [{} for _ in pairs]
    lds: list = []
    micros = [stages.Micro(lambda p=p, k=k: pair_body(lm, p, records, k), lambda h, p=p: pair_lds(lm, p, h),
                           keep=lambda k=k: list(k.values())) for p, k in zip(pairs, kept)]  # fmt: skip
    with lm.hooks.installed(list(records.items())):
        last = stages.run(lm, micros, lambda out: lds.append(out.tolist()))
    for k, (pair, got) in enumerate(zip(pairs, kept)):
        settle(pair, got, lds[k] if last else None)


def exact(lm, rows: list[Row], requests: Sequence[PatchRequest], batching: Batching) -> dict[int, float]:
    """{request index: patched ld} on the last rank ({} on the others): a micro-batch per batch of rows."""
    plan = [batch for _, batch in batches(rows, requests, batching)]
    puts = {name: Put() for name in sorted({point(requests[i].cell) for _, i in rows})}
    values: dict[int, float] = {}
    done = iter(plan)

    def forward(batch: list[Row]) -> mx.array:
        aim(lm, puts, batch, requests)
        with lm.hooks.forward(Rows()):
            return lm.head.body(mx.array([pair.corrupt for pair, _ in batch]))

    def head(batch: list[Row], hidden: mx.array) -> mx.array:
        return logit_diff(lm, hidden, [p.correct for p, _ in batch], [p.wrong for p, _ in batch])

    micros = [stages.Micro(lambda b=b: forward(b), lambda h, b=b: head(b, h)) for b in plan]
    with lm.hooks.installed(list(puts.items())):
        stages.run(lm, micros, lambda out: values.update(zip([i for _, i in next(done)], out.tolist())))
    return values


class _Feed:
    """At this rank's first block: its input replaced by `h` (a primal of the vjp), not the hidden state received
    inside the forward (left unevaluated); None: the received one."""

    h: mx.array | None = None

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        return x if self.h is None else self.h


def attribution(lm, pairs: Sequence[Pair], requests: Sequence[PatchRequest]) -> dict[int, float]:
    """{request index: estimated patched ld} on the last rank ({} on the others)."""
    cells = [i for pair in pairs for i in wanted(pair, requests)]
    if not cells:
        return {}
    rank, size = lm.group.rank(), lm.group.size()
    names = sorted({point(requests[i].cell) for i in cells})
    lowest = min(stages.owner(lm, point_layer(name)) for name in names)
    starts = [start for start, _ in layer_ranges(lm.n_layers, size, head=head_layers(lm.config))[1:]]
    feeds, nudges = {f"resid_pre.{a}": _Feed() for a in starts}, {name: Nudge() for name in names}
    feed = feeds.get(f"resid_pre.{lm.layers[0]}")
    found: dict[int, mx.array] = {}
    with lm.hooks.installed(list(feeds.items()) + list(nudges.items())):
        for pair in pairs:
            mine = [i for i in wanted(pair, requests) if lm.hooks.owns(point(requests[i].cell))]
            own = {n: nudges[n] for n in names if lm.hooks.owns(n)}
            table = sums(lm, pair, dict(zip(own, _chain(lm, pair, feed, own, lowest))))
            found.update((i, pick(requests[i], table)) for i in mine)
    zero = mx.zeros((), mx.float32)
    total = mx.distributed.all_sum(mx.stack([found.get(i, zero) for i in cells]), group=lm.group).tolist()
    return {i: by_cell + pair.corrupt_ld for i, by_cell, pair in zip(cells, total, _pair_of(pairs, cells))} if rank == size - 1 else {}


def _pair_of(pairs: Sequence[Pair], cells: list[int]) -> list[Pair]:
    owner = {i: pair for pair in pairs for i in pair.requests}
    return [owner[i] for i in cells]


def _through(lm, pair: Pair, last: bool) -> tuple[mx.array, mx.array | None]:
    """This rank's lazy forward of the corrupt prompt (pipelined hand-over): (the metric on the last rank, else the
    output of this rank's last block; the hidden state it receives, None on rank 0)."""
    pipe = Pipe()
    with passing(lm.model, pipe), lm.hooks.forward(Rows()):
        hidden = lm.head.body(mx.array([pair.corrupt]))
    return (logit_diff(lm, hidden, [pair.correct], [pair.wrong]) if last else pipe.out), pipe.received


def _aim(feed: _Feed | None, nudges: list[Nudge], args: Sequence[mx.array | None]) -> None:
    """The feed's input and the nudges' deltas for the next forward (None: the forward as it is)."""
    if feed is not None:
        feed.h, args = args[0], args[1:]
    for nudge, delta in zip(nudges, args):
        nudge.delta = delta


def _chain(lm, pair: Pair, feed: _Feed | None, nudges: dict[str, Nudge], lowest: int) -> list[mx.array]:
    """This rank's part of the pair's forward up the ring and backward down it: d metric / d activation at each of
    `nudges`' points (its own), [T, width] float32."""
    group, rank, size = lm.group, lm.group.rank(), lm.group.size()
    last = rank == size - 1
    _aim(feed, list(nudges.values()), [None] * (len(nudges) + (feed is not None)))
    out, received = _through(lm, pair, last)
    if not last:
        mx.eval(mx.distributed.send(out, rank + 1, group=group))  # evaluates the receive and this rank's blocks
    if rank < lowest:
        return []
    if received is not None:
        mx.eval(received)
    cotangent = mx.ones((1,), mx.float32) if last else mx.distributed.recv_like(out, rank + 1, group=group)
    zeros = [mx.zeros(pair.corrupt_acts[name].shape, mx.float32)[None] for name in nudges]
    primals = ([received] if feed is not None else []) + zeros

    def local(*args: mx.array) -> mx.array:
        _aim(feed, list(nudges.values()), args)
        return _through(lm, pair, last)[0]

    _, grads = mx.vjp(local, primals, [cotangent])
    mx.eval(grads)
    _aim(feed, list(nudges.values()), [None] * len(primals))
    if rank > lowest:
        mx.eval(mx.distributed.send(grads[0], rank - 1, group=group))
    return [g[0] for g in grads[1 if feed is not None else 0 :]]
