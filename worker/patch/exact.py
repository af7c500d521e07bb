"""Exact (denoising) patching: the corrupt run with one clean activation put in, a row per (pair, cell).

A cell at split s (worker.patch.pairs.split) changes nothing in blocks 0..s-1, so its row starts from the corrupt
run's state entering block s (kept by the pair's runs) and runs only blocks s.. (worker.hooks.blocks.injected, as
worker.grid's upper passes do): rows of one split and length share one forward whatever their pair and site, each
hook replacing only its own rows' entries. Where the model does not run in slices (`shares_lower`), or s is 0,
rows run the whole forward from the corrupt tokens: the same numbers, no sharing. A positional cell's row also
runs only the positions from its own on (worker.patch.suffix): rows of one split, first position and length share
a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..hooks import HookContext, Rows
from ..hooks.blocks import injected, shares_lower
from ..spec import Batching, head_shape
from .pairs import Pair, logit_diff, point, split
from .spec import PatchRequest
from .suffix import prefix, runs_suffixes, start

Row = tuple[Pair, int]  # (its pair, the request index): one exact cell of one pair


class Put:
    """Patch hook at one point: x where `mask` is False, the clean values where it is True (rows of other points
    and positions keep x exactly); no mask: x as it is (a batch without a cell at this point)."""

    mask: mx.array | None = None
    values: mx.array | None = None

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        return x if self.mask is None else mx.where(self.mask, self.values.astype(x.dtype), x)


def _mask(lm, cells: list, length: int, width: int, offset: int = 0) -> np.ndarray:
    """[rows, length, width] True where each row's cell puts the clean value in (None: a row of another point); the
    forward's first position is `offset`."""
    mask = np.zeros((len(cells), length, width), dtype=bool)
    head_dim = head_shape(lm.config)[1] or 0
    for b, cell in enumerate(cells):
        if cell is None:
            continue
        if cell.site == "attn_head":
            mask[b, :, cell.head * head_dim : (cell.head + 1) * head_dim] = True
        else:
            mask[b, cell.position - offset, :] = True
    return mask


def points_of(rows: list[Row], requests: Sequence[PatchRequest]) -> list[str]:
    return sorted({point(requests[i].cell) for _, i in rows})


def aim(lm, puts: dict[str, Put], rows: list[Row], requests: Sequence[PatchRequest], offset: int = 0) -> None:
    """Set each patch hook for the batch `rows`: its own rows' cells, the clean values of their pairs (none at a
    point no cell of the batch names, or whose layer another rank of a pipeline holds), from position `offset`."""
    cells = [requests[i].cell for _, i in rows]
    for name, put in puts.items():
        mine = [c if point(c) == name else None for c in cells]
        if not any(mine) or not lm.hooks.owns(name):
            put.mask = put.values = None
            continue
        blank = mx.zeros_like(next(pair for (pair, _), c in zip(rows, mine) if c).clean_acts[name][offset:])
        put.values = mx.stack([pair.clean_acts[name][offset:] if c else blank for (pair, _), c in zip(rows, mine)])
        put.mask = mx.array(_mask(lm, mine, *blank.shape, offset))


def _forward(lm, rows: list[Row], requests: Sequence[PatchRequest], s: int, shared: bool, p: int) -> mx.array:
    """The batch's patched logit differences (lazy): from the corrupt state entering block s when `shared`, on
    positions p.. with the corrupt run's keys and values of the positions before p (worker.patch.suffix)."""
    tokens = mx.array([pair.corrupt[p:] for pair, _ in rows])
    cache = prefix([pair.corrupt_kv for pair, _ in rows], p) if p else None
    puts = {name: Put() for name in points_of(rows, requests)}
    aim(lm, puts, rows, requests, p)
    with lm.hooks.installed(list(puts.items())), lm.hooks.forward(Rows(offset=p)):
        if shared:
            with injected(lm, s, mx.stack([pair.corrupt_acts[f"resid_post.{s - 1}"][p:] for pair, _ in rows])):
                hidden = lm.head.body(tokens, cache=cache)
        else:
            hidden = lm.head.body(tokens, cache=cache)
        return logit_diff(lm, hidden, [p.correct for p, _ in rows], [p.wrong for p, _ in rows])


def batches(rows: list[Row], requests: Sequence[PatchRequest], batching: Batching) -> list[tuple[int, list[Row]]]:
    """(split, rows) per forward: rows of one split and length, at most `batch_size` rows and `max_batch_tokens`."""
    groups: dict[tuple[int, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((split(requests[row[1]].cell), len(row[0].corrupt)), []).append(row)
    out = []
    for (s, length), group in sorted(groups.items()):
        size = max(1, min(batching.batch_size, batching.max_batch_tokens // length))
        out += [(s, group[k : k + size]) for k in range(0, len(group), size)]
    return out


def suffix_batches(rows: list[Row], requests: Sequence[PatchRequest], batching: Batching, suffixes: bool) -> list:
    """(split, first position, rows) per forward: `batches` of the rows starting at each position (all at 0
    unless `suffixes`: worker.patch.suffix)."""
    starts: dict[int, list[Row]] = {}
    for row in rows:
        starts.setdefault(start(requests[row[1]].cell, suffixes), []).append(row)
    return [(s, p, batch) for p, group in sorted(starts.items()) for s, batch in batches(group, requests, batching)]


def exact(lm, rows: list[Row], requests: Sequence[PatchRequest], batching: Batching) -> dict[int, float]:
    """{request index: patched logit difference} for the exact cells `rows`."""
    # probed before any hook is installed; under a job's steering no sharing (its resid_post hooks would run twice)
    suffixes = runs_suffixes(lm) and all(pair.corrupt_kv is not None for pair, _ in rows)
    plan = suffix_batches(rows, requests, batching, suffixes)
    shared = {s: s > 0 and not lm.hooks.active and shares_lower(lm, s) for s in {s for s, _, _ in plan}}
    values: dict[int, float] = {}
    pending = None
    for s, p, batch in plan:
        out = _forward(lm, batch, requests, s, shared[s], p)
        mx.async_eval(out)  # computes while the previous batch is read back
        if pending is not None:
            values.update(zip(pending[0], pending[1].tolist()))
        pending = ([i for _, i in batch], out)
    if pending is not None:
        values.update(zip(pending[0], pending[1].tolist()))
    return values
