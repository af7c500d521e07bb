"""A bounded per-model LRU of shared-prefix KV caches, so a later chunk of a task does not recompute its exemplars.

An entry is the batch-1 KV cache of a token prefix, computed by worker.score's `_prefix_cache` under the hooks
installed at the time. It lives on the loaded model object (one per worker), so the model's identity is part of
every key and the store goes with the model. Its key is the prefix's tokens and a fingerprint of every
installed hook that can touch a prefix position: steering ops by kind, alpha, positions and vector bytes, at
their hook point (and head, for one head's op), in order. Ops at `continuation` or `last` positions never touch a prefix (the prefix pass has
no continuation and none of its positions is a row's last), so configurations that differ only there share
entries. Any other hook (a capture, a custom callable) turns the store off for that call: never a wrong hit.

A lookup uses the longest stored prefix of the wanted tokens with the same fingerprint (at least
MIN_SHARED_PREFIX tokens); the rest of the wanted prefix runs on a copy of it, and the result is stored too.
Entries leave in least-recently-used order once the stored KV bytes pass the budget.

Sweeps (worker.grid.grid_generate) also store each row's whole prompt but its last token when several
configurations have the same fingerprint (`prompt_sharers`): it is computed once, and every configuration's rows
run only the last token and decode (worker.grid.generation: side by side, in one batch).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .hooks import Rows
from .score import MIN_SHARED_PREFIX, _family_cache, _prefix_cache
from .spec import Batching

DEFAULT_BUDGET = Batching.model_fields["prefix_cache_mb"].default << 20  # bytes of stored prefix KV per model (worker)
_BLIND = ("continuation", "last")  # op positions that never touch a prefix position


@dataclass
class PrefixStore:
    """The LRU itself, with counters a worker can report."""

    budget: int = DEFAULT_BUDGET
    entries: OrderedDict = field(default_factory=OrderedDict)  # (fingerprint, tokens) -> (cache, nbytes)
    nbytes: int = 0
    peak: int = 0
    hits: int = 0
    extended: int = 0
    misses: int = 0
    evicted: int = 0
    reused: int = 0  # prefix tokens whose KV came from the store (whole hits and the stored part of extensions)
    # (all layers, this rank's layers): a pipeline rank counts an entry as the whole model's KV, so every rank
    # of a group stores and evicts alike and their forwards stay in lockstep
    share: tuple[int, int] = (1, 1)

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "peak_bytes": self.peak, "budget": self.budget,
                "hits": self.hits, "extended": self.extended, "misses": self.misses, "evicted": self.evicted,
                "tokens_reused": self.reused}

    def clear(self) -> None:
        """Drop every entry and zero the counters (the budget stays)."""
        self.entries.clear()
        self.nbytes = self.peak = self.hits = self.extended = self.misses = self.evicted = self.reused = 0

    def longest(self, fingerprint: str, tokens: tuple[int, ...]) -> tuple[int, list] | None:
        """(length, cache) of the longest stored prefix of `tokens`; marks it most recently used."""
        best = None
        for key in self.entries:
            f, stored = key
            if f == fingerprint and len(stored) <= len(tokens) and (best is None or len(stored) > len(best[1])):
                if tokens[: len(stored)] == stored:
                    best = key
        if best is None:
            return None
        self.entries.move_to_end(best)
        return len(best[1]), self.entries[best][0]

    def drop(self, fingerprint: str, prefixes: Sequence[Sequence[int]]) -> None:
        """Forget these entries, if stored (wanted by no later call; not counted as evictions)."""
        for tokens in prefixes:
            gone = self.entries.pop((fingerprint, tuple(tokens)), None)
            self.nbytes -= gone[1] if gone is not None else 0

    def put(self, fingerprint: str, tokens: tuple[int, ...], cache: Any, size: int | None = None) -> None:
        """Store `cache` (a KV cache list; anything else with its `size` in bytes)."""
        key = (fingerprint, tokens)
        if size is None:
            size = sum(c.keys.nbytes + c.values.nbytes for c in cache) * self.share[0] // self.share[1]
        if key in self.entries or size > self.budget:
            return
        self.entries[key] = (cache, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            _, (_, gone) = self.entries.popitem(last=False)
            self.nbytes -= gone
            self.evicted += 1
        self.peak = max(self.peak, self.nbytes)


def store(lm: Any) -> PrefixStore:
    """The model's store (made on first use)."""
    s = getattr(lm.model, "_orchard_prefix_store", None)
    if s is None:
        split = getattr(lm, "group", None) is not None  # a pipeline rank holds its layers' share of each entry
        share = (lm.n_layers, lm.layers[1] - lm.layers[0]) if split else (1, 1)
        s = lm.model._orchard_prefix_store = PrefixStore(share=share)
    return s


def set_budget(lm: Any, nbytes: int) -> None:
    """Bound the model's stored prefix KV to `nbytes` (0 turns the store off); evicts at the next store."""
    if nbytes < 0:
        raise ValueError(f"the prefix cache budget must be >= 0 bytes, not {nbytes}")
    s = store(lm)
    s.budget = nbytes
    while s.nbytes > nbytes and s.entries:
        _, (_, gone) = s.entries.popitem(last=False)
        s.nbytes -= gone
        s.evicted += 1
    s.peak = s.nbytes  # the peak under this budget


def use_budget(lm: Any, nbytes: int) -> None:
    """`set_budget` when the budget changes (a job's Batching names it; the counters stay otherwise)."""
    if store(lm).budget != nbytes:
        set_budget(lm, nbytes)


def fingerprint(hooks: Any) -> str | None:
    """A digest of the installed hooks that can change a prefix's KV; None if some hook is not a known op."""
    from .steer import OnHead, _Op

    parts = []
    for name, fns in sorted(hooks._hooks.items()):  # the manager's registry: hook point -> hooks, in order
        for fn in fns:
            # One head's op is its op on that head's columns: known, keyed by the head too (attn_head.L.h).
            at, fn = (f"{name}.{fn.head}", fn.op) if isinstance(fn, OnHead) else (name, fn)
            if not isinstance(fn, _Op):
                return None
            if fn.positions in _BLIND:
                continue
            vec = hashlib.sha256(np.asarray(fn.vector, dtype=np.float32).tobytes()).hexdigest()
            parts.append(f"{at}:{type(fn).__name__}:{fn.alpha!r}:{fn.positions}:{vec}")
    return "|".join(parts)


def resumed(lm: Any, cache: list, have: int, tokens: Sequence[int]) -> tuple[list, mx.array]:
    """A copy of `cache` (the KV of tokens[:have]) and the lazy forward of the rest of `tokens` into it (its body
    output): a pipeline rank evaluates it as a step of its plan (worker.split.decode)."""
    from mlx_lm.models.cache import KVCache

    fresh = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys[..., :have, :], c.values[..., :have, :], have
        fresh.append(k)
    # As in the prefix pass: every position real prompt, none a row's last.
    with lm.hooks.forward(Rows(offset=have, ends=mx.array([len(tokens) + 1]))):
        return fresh, lm.head.body(mx.array([list(tokens[have:])]), cache=fresh)


def _extend(lm: Any, cache: list, have: int, tokens: Sequence[int]) -> list:
    """A copy of `cache` (the KV of tokens[:have]) run on through the rest of `tokens`."""
    fresh, _ = resumed(lm, cache, have, tokens)
    mx.eval([c.state for c in fresh])
    return fresh


def stored(lm: Any, tokens: tuple[int, ...]) -> tuple[str | None, tuple[int, list] | None]:
    """(the store's fingerprint of the installed hooks, None when the store is off for them; the (length, cache)
    of the longest stored prefix of `tokens` to start from: all of them, or at least MIN_SHARED_PREFIX tokens).
    Counts nothing; marks the entry found most recently used."""
    fp = fingerprint(lm.hooks) if store(lm).budget > 0 else None
    return fp, start_from(lm, fp, tokens)


def start_from(lm: Any, fp: str | None, tokens: tuple[int, ...]) -> tuple[int, list] | None:
    """The (length, cache) of the longest prefix of `tokens` stored under fingerprint `fp` to start from: all of
    them, or at least MIN_SHARED_PREFIX tokens (None: none, `fp` None or the store off). Counts nothing; marks the
    entry found most recently used."""
    s = store(lm)
    found = s.longest(fp, tokens) if fp is not None and s.budget > 0 else None
    return found if found is not None and found[0] >= min(len(tokens), MIN_SHARED_PREFIX) else None


def count(lm: Any, found: tuple[int, list] | None, n: int) -> None:
    """Count a lookup of n prefix tokens that found `found` (`start_from`'s): a hit, an extension or a miss."""
    s = store(lm)
    if found is not None and found[0] == n:
        s.hits += 1
    elif found is not None:
        s.extended += 1
    else:
        s.misses += 1
    s.reused += found[0] if found is not None else 0


def prefix_kv(lm: Any, tokens: Sequence[int], compute: Callable | None = None) -> list | None:
    """The batch-1 KV cache of `tokens` (as `_prefix_cache` computes it), from the store when it holds it.

    `compute(lm, tokens, found)` computes an entry the store lacks, `found` the (length, cache) of its longest
    stored prefix or None (worker.grid's configurations of one split: the lower layers from their shared
    unsteered entry); by default the rest of the tokens run through the whole model under the installed hooks.
    With the store off for these hooks, `compute(lm, tokens, None)` computes it (if given); by default then, under
    conditional steering (whose hooks turn the store off), a prefix per combination of decisions
    (worker.hooks.condition_share.SharedPrefix)."""
    tokens = tuple(tokens)
    s = store(lm)
    fp, found = stored(lm, tokens)
    if fp is None:
        return compute(lm, tokens, None) if compute is not None else _family_cache(lm, tokens)
    count(lm, found, len(tokens))
    if found is not None and found[0] == len(tokens):
        return found[1]
    if compute is not None:
        cache = compute(lm, tokens, found)
    else:
        cache = _extend(lm, found[1], found[0], tokens) if found is not None else _prefix_cache(lm, tokens)
    if cache is None:
        return None
    s.put(fp, tokens, cache)
    return cache


def kv_bytes_per_token(lm: Any) -> int:
    """An upper estimate of one token's KV bytes in every layer, from the config (float32 unless it says 16-bit)."""
    c = {**(lm.config.get("text_config") or {}), **lm.config}
    heads = c.get("num_attention_heads") or c.get("n_head") or 1
    head_dim = c.get("head_dim") or (c.get("hidden_size") or c.get("n_embd") or heads) // heads
    width = 2 if c.get("torch_dtype") in ("float16", "bfloat16") else 4
    return 2 * lm.n_layers * (c.get("num_key_value_heads") or heads) * head_dim * width


def fits(lm: Any, contexts: Sequence[tuple] = (), block: int = 1, copies: int = 1) -> bool:
    """Whether the store is on and holds `copies` KV caches of the `block` longest of `contexts` at once."""
    longest = sorted(map(len, contexts), reverse=True)[:block]
    return store(lm).budget > 0 and copies * sum(longest) * kv_bytes_per_token(lm) <= store(lm).budget


def prompt_sharers(lm: Any, prints: Sequence[str | None], contexts: Sequence[tuple] = (), block: int = 1) -> list[bool]:
    """Per configuration (its `prompt_prints` fingerprint), whether another one acts the same on every prompt
    position (e.g. both steer only `continuation` or `last` positions), so their prompts' KV is the same and worth
    storing for each other. Never with the store off, nor when the `block` longest of `contexts` would not fit in
    it at once (sharing would then evict each prompt before the next configuration reads it)."""
    if not fits(lm, contexts, block):
        return [False] * len(prints)
    return [f is not None and prints.count(f) > 1 for f in prints]


def prompt_prints(lm: Any, installs: Sequence[list]) -> list[str | None]:
    """Per configuration (its hooks), the fingerprint of what it does on prompt positions (None: not known ops)."""
    prints = []
    for install in installs:
        with lm.hooks.installed(install):
            prints.append(fingerprint(lm.hooks))
    return prints


def blocks(groups: Sequence[list[int]], size: int) -> list[list[int]]:
    """Consecutive groups (families, kept whole) packed into blocks of about `size` rows: a sweep runs every
    configuration on one block before the next, so the block's stored prompts stay in the LRU meanwhile."""
    out: list[list[int]] = []
    for g in groups:
        if not out or len(out[-1]) + len(g) > size:
            out.append([])
        out[-1].extend(g)
    return out


def own_prefixes(lm: Any, contexts: Sequence[tuple[int, ...]], idx: list[int], loose: list[int], compute=None) -> list[tuple]:
    """(KV, length, [row]) per row: its prompt's stored KV but the last token (which stays a suffix: its position
    gives the first token and is the row's `last`); longest first; rows that cannot share go to `loose`."""
    parts = []
    for ctx, i in sorted(zip(contexts, idx), key=lambda p: -len(p[0])):
        shared = prefix_kv(lm, ctx[:-1], compute) if len(ctx) > 1 else None
        if shared is None:
            loose.append(i)
        else:
            parts.append((shared, len(ctx) - 1, [i]))
    return parts


def merged(caches: Sequence[list]) -> list:
    """Rows' own batch-1 KV caches (one list per row, lengths differ) as one left-padded BatchKVCache per layer
    (new arrays: the stored entries stay untouched)."""
    from mlx_lm.models.cache import BatchKVCache

    return [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]
