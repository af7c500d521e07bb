"""Loglikelihood grids: the unsteered stream runs once per batch, each configuration from its split up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..hooks import Rows
from ..load import LoadedModel
from ..score import Row, _batches, _broadcast, _families, _rows, _score_batch, loglikelihood
from ..spec import Batching, Steering
from ..hooks.blocks import advance, eval_caches, injected, kv_cache, shares_lower, upper_prefix
from .passes import _installs, _split_of, splits_prompt

GRID_BLOCK = 16  # most configurations sharing one lower pass (each holds its own upper prefix KV caches)


def _prefix_rows(n_tokens: int) -> Rows:
    # As worker.score._prefix_cache: every prefix token is real, none is any row's last token.
    return Rows(offset=0, ends=mx.array([n_tokens + 1]))


def _padded(batch: list[Row], prefix: int) -> tuple[mx.array, Rows]:
    """The batch exactly as worker.score._score_batch lays it out (right padding) and its Rows."""
    width = max(len(r.tokens) for r in batch) - prefix
    padded = [list(r.tokens[prefix:]) + [0] * (width - len(r.tokens) + prefix) for r in batch]
    rows = Rows(
        offset=prefix, ends=mx.array([len(r.tokens) for r in batch]), prompt_ends=mx.array([r.prompt_end for r in batch])
    )
    return mx.array(padded), rows


def grid_loglikelihood(
    lm: LoadedModel,
    steerings: Sequence[Steering],
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batching: Batching | None = None,
) -> list[list[tuple[float, bool]]]:
    """(sum logprob, is greedy) per request per configuration ([request][configuration]), each equal to
    `loglikelihood` under `steered(lm, steering)`.

    Configurations are taken in blocks of at most GRID_BLOCK, ordered by split. Within a block the unsteered
    stream runs once, level by level: up to the lowest split, where that split's configurations branch off
    (each runs only the blocks above it), then on to the next split from the state already computed, and so
    on: unsteered blocks up to the highest split run once, each configuration runs its own blocks only.
    """
    batching = batching or Batching()
    installs = _installs(lm, steerings)
    rows, trivial = _rows(requests, lm.max_length, split_prompt=splits_prompt(installs))
    results: list[list[Any]] = [[trivial.get(i)] * len(installs) for i in range(len(requests))]
    if not rows:
        return results  # only empty continuations: nothing to run
    splits = [_split_of(ins, lm.n_layers) for ins in installs]
    order = sorted(range(len(installs)), key=lambda c: splits[c])
    for b in range(0, len(order), GRID_BLOCK):
        block = order[b : b + GRID_BLOCK]
        shared = [c for c in block if splits[c] > 0 and shares_lower(lm, splits[c])]
        for c in block:
            if c not in shared:  # steered from block 0 on, or the mechanism fails here: an independent run
                with lm.hooks.installed(installs[c]):
                    for i, r in enumerate(loglikelihood(lm, requests, batching)):
                        results[i][c] = r
        if shared:
            _shared_block(lm, shared, splits, installs, rows, batching, results)
    return results


def _shared_block(
    lm: LoadedModel, block: list[int], splits: list[int], installs: list, rows: list[Row], batching: Batching, results: list
) -> None:
    n = lm.n_layers
    levels: dict[int, list[int]] = {}
    for c in block:
        levels.setdefault(splits[c], []).append(c)
    steps = sorted(levels)  # the splits, lowest first
    pending = None

    def collect(c, index, sums, misses) -> None:
        for i, lp, m in zip(index, sums.tolist(), misses.tolist()):
            results[i][c] = (lp, m == 0)

    for fam in _families(rows, batching.prefix_reuse):
        prefix, caches = 0, {}
        if fam.prefix and kv_cache(lm) is not None:  # rotating / hybrid caches: no prefix sharing (as worker.score)
            prefix = fam.prefix
            tokens = mx.array([fam.rows[0].tokens[:prefix]])
            unsteered: list[Any] = [None] * n  # the prefix's unsteered KV caches, filled level by level
            h, at = None, 0
            for s in steps:
                fresh = kv_cache(lm)  # offset 0: the model builds the prefix's own mask
                with lm.hooks.forward(_prefix_rows(prefix)):
                    h = advance(lm, at, s, h, tokens, fresh)
                mx.eval(h)
                eval_caches(fresh[at:s])
                unsteered[at:s], at = fresh[at:s], s
                for c in levels[s]:
                    if s >= n:  # every layer's cache is the unsteered one: the hooks act on no cache
                        caches[c] = list(unsteered)
                        continue
                    with lm.hooks.installed(installs[c]), lm.hooks.forward(_prefix_rows(prefix)):
                        caches[c] = upper_prefix(lm, s, unsteered, h, tokens)
        # The advances' caches: the unsteered ones up to the highest split, above it (never computed, only read
        # for the masks' offsets) any configuration's.
        any_cache = unsteered[: steps[-1]] + caches[block[0]][steps[-1] :] if prefix else None
        for batch in _batches(fam.rows, prefix, batching):
            tokens, layout = _padded(batch, prefix)
            h, at = None, 0
            for s in steps:
                with lm.hooks.forward(layout):
                    h = advance(lm, at, s, h, tokens, _broadcast(any_cache, len(batch)) if prefix else None)
                at = s
                for c in levels[s]:
                    with lm.hooks.installed(installs[c]), injected(lm, s, h):
                        out = _score_batch(lm, batch, prefix, caches[c] if prefix else None)
                    mx.async_eval(out[1], out[2])  # computes while the previous one is read back
                    if pending is not None:
                        collect(*pending)
                    pending = (c, *out)
    if pending is not None:
        collect(*pending)
