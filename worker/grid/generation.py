"""Generation grids: configurations share what their prompts' KV has in common, through the prefix store.

Configurations alike on every prompt position (prefix_cache.prompt_sharers: steering only `continuation` or
`last`, or none) share each prompt's whole KV (all but its last token). The others, steering prompt positions
from block s up (their split), share the prompt's unsteered lower part: blocks 0..s-1's KV and the state entering
block s, stored once per prompt under the split's own key (LOWER) by the first configuration of that split;
each configuration then runs only blocks s.. on the prompt, from that state under its hooks (the upper pass of
worker.grid.passes), and decodes. Requests go block by block (families kept whole), every configuration on a
block before the next, so the block's stored prompts stay in the store meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..generate import GenRequest, families, generate, truncate
from ..hooks import Rows
from ..load import LoadedModel
from ..prefix_cache import blocks, fingerprint, fits, prompt_sharers, store
from ..spec import Batching, Steering
from .passes import _advance, _eval_caches, _installs, _kv_cache, _split_of, _upper_body, shares_lower, unhooked

LOWER = "lower@{}"  # the store's key for split s's unsteered entries (no hooks' fingerprint has this form)


def grid_generate(
    lm: LoadedModel, steerings: Sequence[Steering], requests: Sequence[GenRequest], batching: Batching | None = None
) -> list[list[str]]:
    """Texts per request per configuration ([request][configuration]), each a steered run. Configurations that
    share prompt KV (whole, or below their split) go block by block of requests; the others run on their own."""
    batching = batching or Batching()
    installs = _installs(lm, steerings)
    contexts = [r.context for r in requests]
    sharers = prompt_sharers(lm, installs, contexts, batching.batch_size)
    splits = staged_splits(lm, installs, sharers, contexts, batching.batch_size)
    results: list[list[Any]] = [[None] * len(installs) for _ in requests]
    alone = [c for c in range(len(installs)) if not sharers[c] and not splits[c]]
    together = sorted((c for c in range(len(installs)) if sharers[c] or splits[c]), key=lambda c: splits[c])
    groups = families(requests, lm.max_length, batching.prefix_reuse) if together else []
    for configs, idx in [(alone, list(range(len(requests))))] + [(together, b) for b in blocks(groups, batching.batch_size)]:
        for c in configs:
            with lm.hooks.installed(installs[c]):
                texts = generate(lm, [requests[i] for i in idx], batch_size=batching.batch_size,
                                 prefix_reuse=batching.prefix_reuse, prompt_reuse=configs is together,
                                 compute=staged_kv(splits[c]) if splits[c] else None)
                if splits[c]:  # its rows' own prompt KV serves no other configuration: room for theirs
                    store(lm).drop(fingerprint(lm.hooks), [truncate(requests[i], lm.max_length).context[:-1] for i in idx])
            for i, text in zip(idx, texts):
                results[i][c] = text
    return results


def staged_splits(
    lm: LoadedModel, installs: Sequence[list], sharers: Sequence[bool], contexts: Sequence[tuple], block: int
) -> list[int]:
    """Per configuration, the split s whose unsteered lower prompt KV it shares with the other configurations of
    that split; 0 for none: sharers (they share all), configurations steering block 0, a split only one
    configuration has, models where the passes do not hold, a worker group's rank, and blocks of prompts that
    would not fit the store twice (the lower entries and a configuration's own)."""
    if getattr(lm, "group", None) is not None or _kv_cache(lm) is None or not fits(lm, contexts, block, copies=2):
        return [0] * len(installs)
    splits = [0 if share else _split_of(ins, lm.n_layers) for share, ins in zip(sharers, installs)]
    return [s if s and splits.count(s) > 1 and shares_lower(lm, s) else 0 for s in splits]


def staged_kv(s: int) -> Callable:
    """A prefix_kv `compute` for a configuration of split s (its hooks installed): blocks 0..s-1's KV from the
    split's unsteered store entry for the tokens, blocks s.. run from the state entering block s under the
    hooks, on from the configuration's own longest stored prefix (`found`) when there is one."""

    def compute(lm: LoadedModel, tokens: tuple[int, ...], found: tuple[int, list] | None) -> list:
        lower, h = lower_kv(lm, s, tokens)
        if s >= lm.n_layers:
            return list(lower)  # no block runs steered: the prompt's KV is the unsteered one
        have = found[0] if found is not None else 0
        fresh = _kv_cache(lm)
        if have:  # the lower layers' caches only give the mask its offset; the upper ones are this configuration's
            fresh = _cut(lower, have) + _cut(found[1][s:], have)
        with lm.hooks.forward(Rows(offset=have, ends=mx.array([len(tokens) + 1]))):  # the prefix pass's rows
            _upper_body(lm, s, h[:, have:], mx.array([tokens[have:]]), fresh)
        _eval_caches(fresh[s:])
        return list(lower) + fresh[s:]

    return compute


def lower_kv(lm: LoadedModel, s: int, tokens: tuple[int, ...]) -> tuple[list, mx.array]:
    """(blocks 0..s-1's KV caches, the state entering block s at every position) of `tokens`, unsteered, from the
    store (computed on from its longest stored prefix when it lacks them, and stored)."""
    st, key = store(lm), LOWER.format(s)
    found = st.longest(key, tokens)
    have = found[0] if found is not None else 0
    st.reused += have
    if have == len(tokens):
        st.hits += 1
        return found[1]
    st.extended, st.misses = st.extended + bool(have), st.misses + (not have)
    fresh = _kv_cache(lm)
    if have:
        fresh[:s] = _cut(found[1][0], have)
    with unhooked(lm), lm.hooks.forward(Rows(offset=have, ends=mx.array([len(tokens) + 1]))):
        h = _advance(lm, 0, s, None, mx.array([tokens[have:]]), fresh)
    if have:
        h = mx.concatenate([found[1][1][:, :have], h], axis=1)
    mx.eval(h)
    _eval_caches(fresh[:s])
    entry = (fresh[:s], h)
    st.put(key, tokens, entry, size=sum(c.keys.nbytes + c.values.nbytes for c in fresh[:s]) + h.nbytes)
    return entry


def _cut(caches: Sequence[Any], n: int) -> list:
    """New KV caches holding the first n positions of `caches` (the stored ones stay untouched)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(k)
    return out
