"""Attribution patching (Nanda 2023; TransformerLens's `attribution patching`): the first-order estimate of every
cell of a pair, grad . (clean - corrupt), with grad the gradient of the logit difference at the corrupt run with
respect to each patched activation: one forward and one backward (mx.vjp) per pair, whatever its number of cells.

The gradient is taken with respect to a zero added at each hook point (`Nudge`), so it is exactly d metric / d
activation with every other activation following it, as a hook on the activation sees it in a torch backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..hooks import HookContext, Rows
from ..spec import head_shape
from .pairs import Pair, logit_diff, point
from .spec import PatchRequest


class Nudge:
    """Adds `delta` (zeros, the variable of the gradient) to the activation at its point (None: nothing)."""

    delta: mx.array | None = None

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        return x if self.delta is None else x + self.delta.astype(x.dtype)


def gradients(lm, pair: Pair, names: Sequence[str]) -> dict[str, mx.array]:
    """{point: d logit difference / d activation, [T, width] float32} at the corrupt run of `pair`."""
    nudges = [Nudge() for _ in names]
    zeros = [mx.zeros(pair.corrupt_acts[n].shape, mx.float32)[None] for n in names]

    def metric(*deltas: mx.array) -> mx.array:
        for nudge, delta in zip(nudges, deltas):
            nudge.delta = delta
        with lm.hooks.forward(Rows()):
            return logit_diff(lm, lm.head.body(mx.array([pair.corrupt])), [pair.correct], [pair.wrong])

    with lm.hooks.installed(list(zip(names, nudges))):
        _, grads = mx.vjp(metric, zeros, [mx.ones((1,), mx.float32)])
        mx.eval(grads)
    return {n: g[0] for n, g in zip(names, grads)}


def sums(lm, pair: Pair, grads: dict[str, mx.array]) -> dict[str, mx.array]:
    """{point: grad . (clean - corrupt) per cell of the point} (lazy float32): per position ([T]) at the positional
    sites, per head ([heads], summed over every position) at attn_head."""
    out = {}
    for name, grad in grads.items():
        product = grad * (pair.clean_acts[name].astype(mx.float32) - pair.corrupt_acts[name].astype(mx.float32))
        if name.startswith("attn_head."):
            product = product.reshape(product.shape[0], -1, head_shape(lm.config)[1]).transpose(1, 0, 2)
        out[name] = product.reshape(product.shape[0], -1).sum(axis=-1)
    return out


def pick(request: PatchRequest, table: dict[str, mx.array]) -> mx.array:
    """The cell's entry of `sums`."""
    cell = request.cell
    return table[point(cell)][cell.head if cell.site == "attn_head" else cell.position]


def wanted(pair: Pair, requests: Sequence[PatchRequest]) -> list[int]:
    """The pair's attribution requests."""
    return [i for i in pair.requests if requests[i].cell is not None and requests[i].cell.method == "attribution"]


def attribution(lm, pairs: Sequence[Pair], requests: Sequence[PatchRequest]) -> dict[int, float]:
    """{request index: estimated patched logit difference} for every attribution cell of `pairs`."""
    values: dict[int, float] = {}
    for pair in pairs:
        mine = wanted(pair, requests)
        if not mine:
            continue
        table = sums(lm, pair, gradients(lm, pair, sorted({point(requests[i].cell) for i in mine})))
        out = mx.stack([pick(requests[i], table) for i in mine])
        values.update((i, pair.corrupt_ld + v) for i, v in zip(mine, out.tolist()))
    return values
