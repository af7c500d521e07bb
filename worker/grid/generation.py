"""Generation grids: configurations share what their prompts' KV has in common, through the prefix store.

Configurations alike on every prompt position (prefix_cache.prompt_sharers: steering only `continuation` or
`last`, or none) share each prompt's whole KV (all but its last token), and decode side by side: one batch holds
a row per (request, configuration), each configuration's hooks acting on its own rows only (worker.steer.OnRows,
Rows.configs), so a decode step serves them all; each prompt's KV is read once per step by its copies
(worker.cascade's inner level). How many go side by side is bounded by a plain batch's KV and SIDE_BY_SIDE_ROWS
(`side_by_side_width`); models that must copy prompt KV into every row run them one after another. The others,
steering prompt positions from block s up (their split), share the prompt's unsteered lower part: blocks
0..s-1's KV and the state entering block s, stored once per prompt under the split's own key (LOWER) by the first
configuration of that split; each configuration then runs only blocks s.. on the prompt, from that state under
its hooks (the upper pass of worker.grid.passes), and decodes. Requests go block by block (families kept whole),
every configuration on a block before the next, so the block's stored prompts stay in the store meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..generate import GenRequest, decode, families, generate, prompt_parts, reads_one_prefix, texts, truncate
from ..hooks import Rows
from ..load import LoadedModel
from ..prefix_cache import blocks, fingerprint, fits, prompt_prints, prompt_sharers, store
from ..spec import Batching, Steering
from ..steer import side_by_side
from ..hooks.blocks import advance, eval_caches, kv_cache, shares_lower, unhooked, upper_body
from .passes import _installs, _split_of

SIDE_BY_SIDE_ROWS = 256  # rows of a grid's decode batch at most (their logits: rows x vocabulary floats)
LOWER = "lower@{}"  # the store's key for split s's unsteered entries (no hooks' fingerprint has this form)


def grid_generate(
    lm: LoadedModel, steerings: Sequence[Steering], requests: Sequence[GenRequest], batching: Batching | None = None
) -> list[list[str]]:
    """Texts per request per configuration ([request][configuration]), each a steered run. Configurations that
    share prompt KV (whole, or below their split) go block by block of requests; the others run on their own.
    Configurations alike on every prompt position decode side by side, a row per (request, configuration)."""
    batching = batching or Batching()
    installs = _installs(lm, steerings)
    contexts = [r.context for r in requests]
    prints = prompt_prints(lm, installs)
    sharers = prompt_sharers(lm, prints, contexts, batching.batch_size)
    splits = staged_splits(lm, installs, sharers, contexts, batching.batch_size)
    prints = [f if share else None for f, share in zip(prints, sharers)]  # the fingerprints that share
    results: list[list[Any]] = [[None] * len(installs) for _ in requests]
    alone = [c for c in range(len(installs)) if not sharers[c] and not splits[c]]
    together = sorted((c for c in range(len(installs)) if sharers[c] or splits[c]), key=lambda c: splits[c])
    groups = families(requests, lm.max_length, batching.prefix_reuse) if together else []
    for configs, idx in [(alone, list(range(len(requests))))] + [(together, b) for b in blocks(groups, batching.batch_size)]:
        block = [requests[i] for i in idx]
        width = side_by_side_width(lm, block, batching.batch_size) if configs is together else 1
        for chunk in _chunks(configs, prints, width):
            if len(chunk) > 1:
                done = _side_by_side(lm, [installs[c] for c in chunk], block, batching)
            else:
                done = [[t] for t in _one(lm, installs[chunk[0]], splits[chunk[0]], block, batching, configs is together)]
            for i, row in zip(idx, done):
                for c, text in zip(chunk, row):
                    results[i][c] = text
    return results


def _one(lm: LoadedModel, install: list, split: int, reqs: list[GenRequest], batching: Batching, reuse: bool) -> list[str]:
    """One configuration's texts; `reuse`: its prompts' KV stored for (or read from) the others."""
    with lm.hooks.installed(install):
        texts = generate(lm, reqs, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse, prompt_reuse=reuse,
                         compute=staged_kv(split) if split else None)
        if split:  # its rows' own prompt KV serves no other configuration: room for theirs
            store(lm).drop(fingerprint(lm.hooks), [truncate(r, lm.max_length).context[:-1] for r in reqs])
    return texts


def _chunks(configs: Sequence[int], prints: Sequence[str | None], width: int) -> list[list[int]]:
    """The configurations in runs: those with one prompt fingerprint together, `width` at most; the rest one each."""
    out: list[list[int]] = []
    for c in configs:
        home = next((o for o in out if prints[c] is not None and prints[o[0]] == prints[c] and len(o) < width), None)
        if home is None:
            out.append([c])
        else:
            home.append(c)
    return out


def side_by_side_width(lm: LoadedModel, reqs: Sequence[GenRequest], batch_size: int) -> int:
    """How many configurations alike on prompt positions decode side by side on `reqs`: each row holds only its
    own tokens' KV (the prompt's is read from the store, once per prompt: worker.cascade), so as many as keep a
    decode batch's KV within one plain batch's (batch_size whole prompts and their generations), and its
    logits within SIDE_BY_SIDE_ROWS rows. 1 where the model must copy prompt KV into every row."""
    live = [truncate(r, lm.max_length) for r in reqs if r.max_gen_toks > 0]
    if len(live) == 0 or not reads_one_prefix(lm):
        return 1
    prompts, gen = min(len(live), batch_size), max(r.max_gen_toks for r in live)
    plain = prompts * (max(len(r.context) for r in live) + gen)
    return max(1, min(plain // (prompts * (gen + 2)), SIDE_BY_SIDE_ROWS // prompts))


def _side_by_side(lm: LoadedModel, installs: Sequence[list], reqs: list[GenRequest], batching: Batching) -> list[list[str]]:
    """Texts [request][k] of configurations alike on prompt positions (installs[k]) decoded in one batch: each
    prompt's KV is computed (or found in the store) once, under installs[0] (the same as under each), and every
    (request, configuration) is a row, its hooks those of its configuration (worker.steer.side_by_side)."""
    k = len(installs)
    with lm.hooks.installed(installs[0]):
        cut, parts = prompt_parts(lm, reqs, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse, prompt_reuse=True)
    wide = []  # row i * k + j: request i under configuration j (a prompt's copies next to each other: cascade.stored_rows)
    for kv, prefix, idx in parts:
        rows = [[i * k + j for i in idx for j in range(k)]] if len(idx) > 1 else [[idx[0] * k + j] for j in range(k)]
        wide += [(kv, prefix, r) for r in rows]
    with lm.hooks.installed(side_by_side(installs)):
        tokens = decode(lm, [r for r in cut for _ in range(k)], wide, batching.batch_size * k, [j for _ in cut for j in range(k)])
    flat = texts(lm, tokens, [r for r in reqs for _ in range(k)])
    return [flat[i * k : (i + 1) * k] for i in range(len(reqs))]


def staged_splits(
    lm: LoadedModel, installs: Sequence[list], sharers: Sequence[bool], contexts: Sequence[tuple], block: int
) -> list[int]:
    """Per configuration, the split s whose unsteered lower prompt KV it shares with the other configurations of
    that split; 0 for none: sharers (they share all), configurations steering block 0, a split only one
    configuration has, models where the passes do not hold, a worker group's rank, and blocks of prompts that
    would not fit the store twice (the lower entries and a configuration's own)."""
    if getattr(lm, "group", None) is not None or kv_cache(lm) is None or not fits(lm, contexts, block, copies=2):
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
        fresh = kv_cache(lm)
        if have:  # the lower layers' caches only give the mask its offset; the upper ones are this configuration's
            fresh = _cut(lower, have) + _cut(found[1][s:], have)
        with lm.hooks.forward(Rows(offset=have, ends=mx.array([len(tokens) + 1]))):  # the prefix pass's rows
            upper_body(lm, s, h[:, have:], mx.array([tokens[have:]]), fresh)
        eval_caches(fresh[s:])
        return list(lower) + fresh[s:]

    return compute


def lower_kv(lm: LoadedModel, s: int, tokens: tuple[int, ...]) -> tuple[list, mx.array]:
    """(blocks 0..s-1's KV caches, the state entering block s at every position) of `tokens`, unsteered, from the
    store, else computed and stored: on from the split's longest stored prefix of the tokens, and from a lower
    split r's entry for these very tokens (splits chain: only blocks r..s-1 run)."""
    st, key = store(lm), LOWER.format(s)
    found = st.longest(key, tokens)
    have = found[0] if found is not None else 0
    if have == len(tokens):
        st.hits, st.reused = st.hits + 1, st.reused + have
        return found[1]
    below = _lower_below(st, s, tokens)
    r, (caches, h0) = below if below else (0, ((), None))
    st.extended, st.misses = st.extended + bool(have or r), st.misses + (not have and not r)
    st.reused += max(have, len(tokens) if r else 0)
    fresh = kv_cache(lm)
    if have:  # blocks below r: only the mask's offset; blocks r..s-1: this split's stored prefix
        fresh[:s] = _cut(found[1][0], have)
    with unhooked(lm), lm.hooks.forward(Rows(offset=have, ends=mx.array([len(tokens) + 1]))):
        h = advance(lm, r, s, h0[:, have:] if r else None, mx.array([tokens[have:]]), fresh)
    fresh[:r] = caches  # split r's own (held by both entries: each counts them, so the budget errs safe)
    if have:
        h = mx.concatenate([found[1][1][:, :have], h], axis=1)
    mx.eval(h)
    eval_caches(fresh[r:s])
    entry = (fresh[:s], h)
    st.put(key, tokens, entry, size=sum(c.keys.nbytes + c.values.nbytes for c in fresh[:s]) + h.nbytes)
    return entry


def _lower_below(st: Any, s: int, tokens: tuple[int, ...]) -> tuple[int, tuple] | None:
    """(r, entry) of the highest split r < s whose store entry holds exactly these tokens."""
    for r in range(s - 1, 0, -1):
        found = st.longest(LOWER.format(r), tokens)
        if found is not None and found[0] == len(tokens):
            return r, found[1]
    return None


def _cut(caches: Sequence[Any], n: int) -> list:
    """New KV caches holding the first n positions of `caches` (the stored ones stay untouched)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(k)
    return out
