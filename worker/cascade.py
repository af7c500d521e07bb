"""Attention over a prefix that every row of a batch shares, read once per forward (cascade attention).

A prefix family's rows all attend to the same prefix KV. Copied into every row's cache (mlx-lm's BatchKVCache
holds one buffer per row), each decode step reads the prefix once per row: measured here, 4 of a step's ~5 ms
per layer for 16 rows x 1,000 keys. `SharedPrefixCache` holds each family's prefix KV once ([1, kv_heads, P,
d]) and only the rows' own tokens per row; attention is split in two softmax parts, merged with their maxima
and sums (exact up to float rounding: ~2e-7 here):
- the prefix part: the queries of all a family's rows against its prefix in one matmul per KV head;
- the rows' own part: each row against its own tokens, under the cache's causal and padding mask.

mlx-lm's attention modules call `scaled_dot_product_attention` of their family's module (from
mlx_lm.models.base): `install` wraps that name, and the wrapper runs the split only for a SharedPrefixCache,
so every other cache goes to mlx-lm's own function untouched. `usable(lm)` proves, once per model, that the
split gives the logits of the copied-prefix path (a family whose attention does not go through that name
fails the check and keeps the copies); the ranks of a split model (worker.split) each run it on their layers.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache

Group = tuple[Any, int]  # (the prefix's KVCache of this layer, keys [1, kv, P, d], or None; rows), or variants
# of it each row picks among (worker.hooks.condition_share.Picked: `read()`, `rows()`, `kept(local)`)
AGREE = 1e-4  # the self-check's tolerance on logits (float rounding is ~1e-6)
LOG2E = 1.4426950408889634  # scores are taken in base 2 (log2(e) folded into the scale, as flash attention does):
# on MLX's CPU backend mx.power(2, x) ran 3x faster than mx.exp(x) (6.7 vs 19 ms for 1.9M floats), and the
# exponentials are most of an attention's time here


class SharedPrefixCache(BatchKVCache):
    """One layer's batch cache: rows in family groups (contiguous, in batch order), each group's prefix KV held
    once, each row's own tokens left-padded as in BatchKVCache. `offset` (the RoPE position) counts the prefix.
    `inner` groups (optional) partition the same rows more finely and continue their family's prefix: rows that
    are copies of one prompt (under configurations side by side) read its tokens after the family's prefix once."""

    def __init__(self, groups: list[Group], left_padding: list[int], inner: list[Group] | None = None):
        super().__init__(left_padding)
        self.levels = [list(groups)] + ([list(inner)] if inner else [])
        lengths = [sum(0 if kv is None else kv.offset for kv in row) for row in zip(*map(_rows_of, self.levels))]
        self.offset = self.offset + mx.array(lengths)

    @property
    def groups(self) -> list[Group]:
        return self.levels[0]

    @classmethod
    def of(cls, cache: BatchKVCache, groups: list[Group], inner: list[Group] | None = None) -> SharedPrefixCache:
        """`cache` (the rows' own tokens) read after `groups`' prefixes (and `inner`'s)."""
        out = cls(groups, [0] * cache.offset.shape[0], inner)  # its offsets: the prefixes' lengths
        keys, values, offset, out.left_padding, out._idx = cache.state
        out.keys, out.values, out.offset = keys, values, out.offset + offset
        return out

    @classmethod
    def plain(cls, cache: BatchKVCache) -> SharedPrefixCache:
        """`cache` (rows sharing no prefix) as a one-group SharedPrefixCache, so it can join shared ones."""
        return cls.of(cache, [(None, cache.offset.shape[0])])

    def filter(self, batch_indices: mx.array) -> None:
        super().filter(batch_indices)
        kept = batch_indices.tolist()
        self.levels = [_kept(level, kept) for level in self.levels]

    def extend(self, other: BatchKVCache) -> None:
        other = other if isinstance(other, SharedPrefixCache) else SharedPrefixCache.plain(other)
        super().extend(other)
        depth = max(len(self.levels), len(other.levels))
        mine, theirs = _padded(self.levels, depth), _padded(other.levels, depth)
        for level, more in zip(mine, theirs):
            for kv, n in more:  # parts of one family join into one group: its prefix is read once
                last = level[-1]
                level[-1:] = [(kv, last[1] + n)] if last[0] is kv else [last, (kv, n)]
        self.levels = mine

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
        """softmax([prefixes ; own] keys) @ values for queries q [B, H, L, d]; k, v: the rows' own [B, kv, S, d]."""
        B, H, L, d = q.shape
        kv = k.shape[1]
        qf = q.astype(mx.float32) * (scale * LOG2E)
        s = (qf.reshape(B, kv, (H // kv) * L, d) @ k.astype(mx.float32).swapaxes(-1, -2)).reshape(B, H, L, -1)
        if mask is not None:  # finite, as mlx-lm's fallback: a row with no own key left (a pad) stays finite
            s = mx.where(mask, s, mx.finfo(mx.float32).min)
        m_own = s.max(-1, keepdims=True)
        e = mx.power(2.0, s - m_own)
        own = (e.reshape(B, kv, (H // kv) * L, -1) @ v.astype(mx.float32)).reshape(B, H, L, -1)
        parts = [_prefix_parts(qf, level, kv, own.shape[-1]) for level in self.levels] + [(m_own, e.sum(-1, keepdims=True), own)]
        m = parts[0][0]
        for part in parts[1:]:
            m = mx.maximum(m, part[0])
        weights = [mx.power(2.0, part[0] - m) for part in parts]
        top = sum(o * w for (_, _, o), w in zip(parts, weights))
        return (top / sum(sums * w for (_, sums, _), w in zip(parts, weights))).astype(q.dtype)


def _rows_of(level: list[Group]) -> list[Any]:
    """A level's prefix KV per row."""
    return [kv for kv, n in level for _ in range(n)]


def _kept(level: list[Group], kept: list[int]) -> list[Group]:
    """The level's groups after a filter keeping batch rows `kept` (in order); emptied groups go."""
    start, out = 0, []
    for kv, n in level:
        local = [i - start for i in kept if start <= i < start + n]
        if local:
            out.append((kv.kept(local) if hasattr(kv, "kept") else kv, len(local)))  # a Picked keeps its rows' picks
        start += n
    return out


def _padded(levels: list[list[Group]], depth: int) -> list[list[Group]]:
    """Fresh lists of the levels, and levels of no prefix below them down to `depth`."""
    rows = sum(n for _, n in levels[0])
    return [list(level) for level in levels] + [[(None, rows)] for _ in range(depth - len(levels))]


def _prefix_parts(qf: mx.array, groups: list[Group], kv: int, dv: int) -> tuple[mx.array, mx.array, mx.array]:
    """Per row: the prefix scores' max, the sum of their exponentials, and the unnormalized output."""
    _, H, L, _ = qf.shape
    parts, start = [], 0
    for kv_cache, n in groups:
        q = qf[start : start + n]
        start += n
        if kv_cache is None:  # rows sharing no prefix: an empty part
            parts.append((mx.full((n, H, L, 1), -mx.inf), mx.zeros((n, H, L, 1)), mx.zeros((n, H, L, dv))))
        elif hasattr(kv_cache, "rows"):  # variants (condition_share.Picked): each read once, each row keeping its own
            variants = [_group_part(q, c, kv) for c in kv_cache.read()]
            which = kv_cache.rows().reshape(n, 1, 1, 1)
            part = variants[0]
            for j, other in enumerate(variants[1:], 1):
                part = tuple(mx.where(which == j, o, p) for o, p in zip(other, part))
            parts.append(part)
        else:
            parts.append(_group_part(q, kv_cache, kv))
    return tuple(mx.concatenate(p, axis=0) for p in zip(*parts))


def _group_part(q: mx.array, kv_cache: Any, kv: int) -> tuple[mx.array, mx.array, mx.array]:
    """One group's rows (queries q [n, H, L, d]) against its prefix, all rows in one matmul per KV head."""
    n, H, L, d = q.shape
    rows = (H // kv) * L
    qh = q.reshape(n, kv, rows, d).transpose(1, 0, 2, 3).reshape(1, kv, n * rows, d)
    pk, pv = (x[..., : kv_cache.offset, :].astype(mx.float32) for x in (kv_cache.keys, kv_cache.values))
    s = qh @ pk.swapaxes(-1, -2)
    m = s.max(-1, keepdims=True)
    e = mx.power(2.0, s - m)
    return tuple(_per_row(x, n, H, L) for x in (m, e.sum(-1, keepdims=True), e @ pv))


def _per_row(x: mx.array, n: int, H: int, L: int) -> mx.array:
    """[1, kv, n * rows, w] (a family's rows stacked per KV head) back to [n, H, L, w]."""
    kv, w = x.shape[1], x.shape[-1]
    return x.reshape(kv, n, -1, w).transpose(1, 0, 2, 3).reshape(n, H, L, w)


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
        if not isinstance(cache, SharedPrefixCache):
            return original(queries, keys, values, cache, scale, mask, *args, **kwargs)
        if args or kwargs.get("sinks") is not None:
            raise ValueError("attention sinks do not split over a shared prefix")
        return cache.attend(queries, keys, values, scale, mask)

    scaled_dot_product_attention.orchard_cascade = True
    return scaled_dot_product_attention


def install(model: Any) -> bool:
    """Wrap `scaled_dot_product_attention` in the modules of `model`'s layers that take it from mlx-lm's base;
    True when at least one does."""
    found = False
    for name in {type(m).__module__ for _, m in model.named_modules()}:
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if getattr(fn, "orchard_cascade", False):
            found = True
        elif fn is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = _wrap(fn)
            found = True
    return found


def prefill(lm: Any, reqs: list, prefix_kv: list, prefix: int) -> tuple[list, list[int], int, mx.array]:
    """Each row's suffix after the shared prefix, right-padded, in one forward on SharedPrefixCaches; then the
    pads are rolled to the left of the rows' own tokens (`finalize`). The return values of worker.generate's
    prefills: hooks see the layout of the unshared run, each row's prompt left-padded to end at prefix + W."""
    from .hooks import Rows

    suffixes = [r.context[prefix:] for r in reqs]
    W, B = max(map(len, suffixes)), len(reqs)
    right = [W - len(s) for s in suffixes]
    cache = [SharedPrefixCache([(kv, B)], [0] * B) for kv in prefix_kv]
    for c in cache:
        c.prepare(right_padding=right)
    ends = mx.array([prefix + len(s) for s in suffixes])
    with lm.hooks.forward(Rows(offset=prefix, ends=ends, prompt_ends=ends)):
        h = lm.head.body(mx.array([list(s) + [0] * p for s, p in zip(suffixes, right)]), cache=cache)
    last = mx.take_along_axis(h, mx.array([len(s) - 1 for s in suffixes])[:, None, None], axis=1)
    for c in cache:
        c.finalize()
    return cache, right, prefix + W, lm.head.head(last)[:, 0, :].astype(mx.float32)


def stored_rows(contexts: list[tuple[int, ...]], caches: list[list]) -> list[SharedPrefixCache]:
    """Rows' own batch-1 KV caches, each of all its prompt but the last token (a sweep's configurations share
    them: worker.prefix_cache.own_prefixes), as one SharedPrefixCache per layer: neighbours whose prompts share at
    least MIN_SHARED_PREFIX tokens read that prefix from the first one's KV (a view, held once); only each row's
    tokens after it are copied into the batch. Consecutive copies of one prompt (configurations side by side)
    also read its tokens after that prefix once (an inner level), and keep only the token before the last."""
    copies = [(ctx, len(list(same))) for ctx, same in itertools.groupby(contexts)]
    if all(n == 1 for _, n in copies):
        return [SharedPrefixCache.of(*_layer(layer, contexts, _runs(contexts))) for layer in zip(*caches)]
    return [SharedPrefixCache.of(*_layer_of_copies(layer, copies)) for layer in zip(*caches)]


def _view(kv: Any, start: int, end: int) -> Any:
    """Positions start..end-1 of a batch-1 KV cache, as a KVCache (no copy)."""
    from mlx_lm.models.cache import KVCache

    out = KVCache()
    out.keys, out.values, out.offset = kv.keys[..., start:end, :], kv.values[..., start:end, :], end - start
    return out


def _layer(layer: tuple, contexts: list[tuple[int, ...]], runs: list[tuple[int, int]]) -> tuple[BatchKVCache, list[Group]]:
    """One layer's rows (their own tokens after their run's prefix, copied) and the runs' prefixes (views)."""
    groups, own, start = [], [], 0
    for prefix, n in runs:
        groups.append((_view(layer[start], 0, prefix) if prefix else None, n))
        own += [_view(kv, prefix, len(ctx) - 1) for kv, ctx in zip(layer[start : start + n], contexts[start : start + n])]
        start += n
    return BatchKVCache.merge(own), groups


def _layer_of_copies(layer: tuple, copies: list[tuple[tuple[int, ...], int]]) -> tuple[BatchKVCache, list[Group], list[Group]]:
    """`_layer` for prompts in consecutive copies: the runs over the distinct prompts, then per prompt its tokens
    after its run's prefix up to the token before its last (read by its copies), then that token per row."""
    firsts = list(itertools.accumulate([0] + [n for _, n in copies]))
    groups, inner, own, at = [], [], [], 0
    for prefix, n in _runs([ctx for ctx, _ in copies]):
        groups.append((_view(layer[firsts[at]], 0, prefix) if prefix else None, firsts[at + n] - firsts[at]))
        for (ctx, k), first in zip(copies[at : at + n], firsts[at : at + n]):
            end = len(ctx) - 2
            inner.append((_view(layer[first], prefix, end) if end > prefix else None, k))
            own += [_view(layer[first + j], end, end + 1) for j in range(k)]
        at += n
    return BatchKVCache.merge(own), groups, inner


def _runs(contexts: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    """(shared prefix length or 0, rows) for consecutive rows, each run's prefix shared by all its rows and
    leaving each of them at least one token of its own before its last."""
    from .score import MIN_SHARED_PREFIX

    runs: list[list[int]] = []  # [prefix, rows, first row's index]
    for i, ctx in enumerate(contexts):
        if runs:
            prefix, n, first = runs[-1]
            common = next((j for j, (a, b) in enumerate(zip(contexts[first], ctx)) if a != b), min(len(ctx), len(contexts[first])))
            shared = min(prefix if n > 1 else common, common, len(ctx) - 2, len(contexts[first]) - 2)
            if shared >= MIN_SHARED_PREFIX:
                runs[-1][:2] = [shared, n + 1]
                continue
        runs.append([0, 1, i])
    return [(prefix, n) for prefix, n, _ in runs]


def usable(lm: Any, copied: Any) -> bool:
    """Whether `lm` may prefill and decode on SharedPrefixCaches: decided once per model, by comparing the last
    logits of two rows (suffixes of 3 and 1 tokens after a 4-token prefix) with `copied(lm, reqs, prefix_kv,
    prefix)`'s, the copied-prefix path, no hook running. The ranks of a split model run the probe in lockstep (at
    the same point of the same job) and end each forward with the same state (worker.split), so they agree."""
    verdict = getattr(lm.model, "_orchard_cascade", None)  # on the model: shared by every view of it
    if verdict is None:
        verdict = lm.model._orchard_cascade = install(lm.model) and _agrees(lm, copied)
    return verdict


def _agrees(lm: Any, copied: Any) -> bool:
    from types import SimpleNamespace

    from .score import _prefix_cache

    prefix = [1, 2, 3, 4]
    reqs = [SimpleNamespace(context=(*prefix, 5, 6, 7)), SimpleNamespace(context=(*prefix, 8))]  # prefills read .context
    with lm.hooks.suspended():
        kv = _prefix_cache(lm, prefix)
        if kv is None:
            return False
        want = copied(lm, reqs, kv, len(prefix))[3]
        try:
            got = prefill(lm, reqs, kv, len(prefix))[3]
        except Exception:  # noqa: BLE001  (a probe: attention the split cannot run, e.g. with sinks, keeps the copies)
            return False
        return bool(mx.allclose(got, want, atol=AGREE, rtol=AGREE).item())
