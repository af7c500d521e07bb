"""Capture kernel: the residual stream (or a branch output: attn_out, mlp_out; or the heads' outputs side by side,
attn_head: [heads*head_dim]) at one position of each request, over token ids. No Ray, no lm-eval.

A request is `(tokens, position)`; the result is a float32 [len(points), hidden] array per request, read at
hook points such as `resid_post.3` after every hook already installed there (steering runs first). Rows
are right-padded and cut by `Batching`; the numbers do not depend on how they are cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .hooks import HookContext, Rows
from .hooks.manager import point_layer
from .spec import Batching, head_shape
from .split import stages


def _width(lm, point: str, h: mx.array) -> int:
    """What `point` holds per token: heads*head_dim at attn_head (from the config), else the hidden size."""
    heads, head_dim = head_shape(lm.config)
    return heads * head_dim if point.startswith("attn_head.") and heads and head_dim else h.shape[-1]


class _Gather:
    """Capture hook: the rows of the flattened [B*S, D] stream listed in `at` (set per forward), as float32."""

    def __init__(self, point: str = "") -> None:
        self.point = point
        self.at: mx.array | None = None
        self.out: mx.array | None = None

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        B, S, D = x.shape
        self.out = x.reshape(B * S, D)[self.at].astype(mx.float32)
        return x


def _resolve(i: int, tokens: Sequence[int], position: int, max_length: int) -> tuple[tuple[int, ...], int]:
    """(input tokens, index of the captured token in them): the last max_length tokens, position resolved."""
    tokens = tuple(int(t) for t in tokens)
    n = len(tokens)
    at = position + n if position < 0 else position
    if not 0 <= at < n:
        raise ValueError(f"request {i}: position {position} is outside its {n} tokens")
    cut = max(0, n - max_length)
    if at < cut:
        raise ValueError(
            f"request {i}: position {position} falls in the first {cut} of its {n} tokens, "
            f"cut off to fit max_length {max_length}"
        )
    return tokens[cut:], at - cut


def _batches(rows: list[tuple[int, ...]], batching: Batching) -> list[list[int]]:
    """Row indices sorted by length, cut so no forward exceeds the row and padded-token budgets."""
    out: list[list[int]] = []
    batch: list[int] = []
    for r in sorted(range(len(rows)), key=lambda r: len(rows[r])):
        size = len(batch) + 1
        if batch and (size > batching.batch_size or size * len(rows[r]) > batching.max_batch_tokens):
            out.append(batch)
            batch = []
        batch.append(r)
    if batch:
        out.append(batch)
    return out


def _layout(rows: list[tuple[int, ...]], wanted: list[list[tuple[int, int]]], batch: list[int]) -> tuple[list, list, list]:
    """One forward's (request indices, each one's row in the flattened [B*S] stream, right-padded tokens)."""
    width = max(len(rows[r]) for r in batch)
    padded = [list(rows[r]) + [0] * (width - len(rows[r])) for r in batch]
    index, flat = [], []
    for b, r in enumerate(batch):
        for i, at in wanted[r]:
            index.append(i)
            flat.append(b * width + at)
    return index, flat, padded


def _body(lm, padded: list, ends: list[int], flat: list[int], gathers: list) -> mx.array:
    """The lazy forward with every gather set to read `flat` (a gather of a layer this rank lacks stays None)."""
    for g in gathers:
        g.at, g.out = mx.array(flat), None
    with lm.hooks.forward(Rows(offset=0, ends=mx.array(ends))):
        # Only the gathered rows are evaluated: MLX never computes blocks past the deepest point, nor the head.
        return lm.head.body(mx.array(padded))


def _forward(lm, rows: list[tuple[int, ...]], wanted: list[list[tuple[int, int]]], batch: list[int], gathers: list):
    """One right-padded forward; returns (request indices, lazy [R, points, hidden] float32 array)."""
    index, flat, padded = _layout(rows, wanted, batch)
    _body(lm, padded, [len(rows[r]) for r in batch], flat, gathers)
    return index, mx.stack([g.out for g in gathers], axis=1)


def _inputs(lm, requests: Sequence[tuple[Sequence[int], int]], points: Sequence[str]) -> tuple[list, list]:
    """The distinct inputs and, per input, its (request index, captured position) pairs."""
    if not points:
        raise ValueError("capture needs at least one hook point, e.g. resid_post.0")
    rows: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, (tokens, position) in enumerate(requests):
        inp, at = _resolve(i, tokens, int(position), lm.max_length)
        rows.setdefault(inp, []).append((i, at))
    return list(rows), list(rows.values())


def capture(
    lm, requests: Sequence[tuple[Sequence[int], int]], points: Sequence[str], batching: Batching | None = None
) -> list[np.ndarray]:
    """Per request, in order: a float32 [len(points), hidden] array of the residual stream at its position
    (attn_head points: [len(points), heads*head_dim]; one job's points must all have the same width).

    `position` indexes the request's tokens, negative from the end (-1: the last token); one outside them
    is a ValueError. Tokens longer than `lm.max_length` keep their last max_length tokens (left-truncation,
    as lm-eval does with contexts), so a non-negative position must fall in those. Capture hooks are
    appended after any hooks already installed at the same points (e.g. steering), so they see the
    steered stream. Requests with the same tokens share one row.
    """
    batching = batching or Batching()
    points = list(points)
    keys, wanted = _inputs(lm, requests, points)
    results: list[np.ndarray | None] = [None] * len(requests)

    def collect(index: list[int], out: mx.array) -> None:
        for i, a in zip(index, np.array(out)):  # the one host sync of the batch
            results[i] = a

    gathers = [_Gather(point) for point in points]
    pending = None
    with lm.hooks.installed(list(zip(points, gathers))):
        for batch in _batches(keys, batching):
            out = _forward(lm, keys, wanted, batch, gathers)
            mx.async_eval(out[1])  # this batch computes while the previous one is read back
            if pending is not None:
                collect(*pending)
            pending = out
    if pending is not None:
        collect(*pending)
    return results


# --- the same kernel on a pipeline group: micro-batches through worker.split.stages (issue 26) ------------


def _riding(lm, rows: list[tuple[int, ...]], wanted: list, batch: list[int], gathers: list) -> tuple[list[int], stages.Micro]:
    """One batch as a micro-batch whose captured rows ride forward: each rank fills in the points its layers own."""
    index, flat, padded = _layout(rows, wanted, batch)
    own: list = []  # per point, this rank's rows (None: another rank's layer), once the forward is built
    width: list[int] = []

    def forward() -> mx.array:
        h = _body(lm, padded, [len(rows[r]) for r in batch], flat, gathers)
        own[:], width[:] = [g.out for g in gathers], [_width(lm, gathers[0].point, h)]
        return h

    def add(got: mx.array) -> mx.array:
        return mx.stack([o if o is not None else got[:, p] for p, o in enumerate(own)], axis=1)

    empty = lambda: mx.zeros((len(flat), len(gathers), width[0]), mx.float32)  # noqa: E731
    return index, stages.Micro(forward, keep=lambda: [o for o in own if o is not None], rows=stages.Riding(empty, add))


def pipelined_capture(lm, requests: Sequence[tuple[Sequence[int], int]], points: Sequence[str],
                      batching: Batching | None = None) -> list[np.ndarray | None]:  # fmt: skip
    """`capture` on one rank of a pipeline group: its batches pipelined across the ranks, the captured rows
    riding forward with them to the last rank (worker.split.schedule), which returns them (equal to the unsplit
    capture); the others return None per request. No collective per batch: each rank receives the rows gathered
    so far from the rank before, fills in its own points and sends them on, and the hidden state goes only as far
    as the rank owning the deepest point (`reach`)."""
    batching = batching or Batching()
    points = list(points)
    keys, wanted = _inputs(lm, requests, points)
    results: list[np.ndarray | None] = [None] * len(requests)
    gathers = [_Gather(point) for point in points]
    micros = [_riding(lm, keys, wanted, batch, gathers) for batch in _batches(keys, batching)]
    indices = iter([index for index, _ in micros])

    def collect(out: mx.array) -> None:
        for i, a in zip(next(indices), np.array(out)):
            results[i] = a

    with lm.hooks.installed(list(zip(points, gathers))):  # the points' names checked here, before any forward
        reach = stages.owner(lm, max(point_layer(p) for p in points))
        last = stages.run(lm, [m for _, m in micros], collect, reach=reach)
    return results if last else [None] * len(requests)
