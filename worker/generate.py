"""generate_until over token ids, with lm-eval HF-backend semantics. No Ray, no lm-eval.

Requests are sorted by prompt length and run in left-padded batches: one prefill forward, then one decode
forward per step for the rows still running (finished rows are dropped from the caches); one host sync a step.
Prefix families (worker.score's): prompts that share at least MIN_SHARED_PREFIX tokens run that prefix once
(batch 1, under the job's hooks); each batch of the family then prefills only its rows' suffixes, on one copy of
the prefix KV that every row reads (worker.cascade) where the model passes its self-check, else on copies (the
suffixes right-padded, then the pads rolled left by `BatchKVCache.finalize`). Positions and RoPE offsets are
those of the unshared run. Prefills that fit in batch_size rows together decode as one batch. Prefix KV is kept
across calls in a bounded per-model LRU (worker.prefix_cache), keyed by the tokens and the steering that touches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from . import cascade
from .hooks import Rows, decoder_layers
from .hooks.condition_share import ChosenCache, SharedPrefix
from .prefix_cache import merged, own_prefixes, prefix_kv
from .sampling import check_finite, finite_flag, lookback, next_tokens, sample_keys, stop_at, stopped
from .score import MAX_PADDING, MIN_ROWS, Row, _broadcast, _families


@dataclass(frozen=True)
class GenRequest:
    context: tuple[int, ...]  # prompt token ids (already tokenized by the driver)
    until: tuple[str, ...] = ()  # stop strings (the driver already appended the EOS string as lm-eval does)
    max_gen_toks: int = 256
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # per-request seed: sampled output must not depend on batch composition
    # HF `generate` applies top_k=50 whenever it samples unless the model's generation_config says
    # otherwise, so that is the default here too; 0 disables it.
    top_k: int = 50

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


def truncate(request: GenRequest, max_length: int) -> GenRequest:
    """Left-truncate the context to leave room for max_gen_toks, as lm-eval's HF backend does."""
    r = request
    if r.max_gen_toks < 0 or r.temperature < 0 or not 0.0 <= r.top_p <= 1.0 or r.top_k < 0:
        raise ValueError(
            f"invalid generation settings: max_gen_toks={r.max_gen_toks}, temperature={r.temperature}, "
            f"top_p={r.top_p}, top_k={r.top_k} (need max_gen_toks, temperature, top_k >= 0 and 0 <= top_p <= 1)"
        )
    room = max_length - request.max_gen_toks
    if room <= 0:
        raise ValueError(
            f"max_gen_toks ({request.max_gen_toks}) must be less than the model's max_length ({max_length})"
        )
    if len(request.context) > room:
        return replace(request, context=tuple(request.context[-room:]))
    return request


def generate(lm: Any, requests: Sequence[GenRequest], *, batch_size: int = 16, prefix_reuse: bool = True, **reuse) -> list[str]:
    """Generated text per request (cut at the first stop string), in the order given."""
    return texts(lm, generate_tokens(lm, requests, batch_size=batch_size, prefix_reuse=prefix_reuse, **reuse), requests)


def texts(lm: Any, tokens: Sequence[list[int]], requests: Sequence[GenRequest]) -> list[str]:
    """Each request's generated ids as lm-eval returns them: decoded without special tokens, cut at the stop strings."""
    return [stop_at(lm.tokenizer.decode(t, skip_special_tokens=True), r.until) for t, r in zip(tokens, requests)]


def generate_tokens(
    lm: Any, requests: Sequence[GenRequest], *, batch_size: int = 16, prefix_reuse: bool = True, prompt_reuse: bool = False,
    compute: Any = None,
) -> list[list[int]]:
    """Generated token ids per request: EOS excluded; a row ends at the token that completes a stop string
    (decoded with special tokens, as lm-eval's stopping criteria do) or after max_gen_toks tokens.
    `prefix_reuse` shares long common prompt prefixes (the same tokens either way; only speed changes).
    `prompt_reuse` also stores each row's whole prompt but its last token (worker.prefix_cache), for a later
    call whose installed steering is the same on prompt positions (a sweep's other configurations); `compute`:
    how prefix_kv computes those (worker.grid: from the store's unsteered lower layers)."""
    reqs, parts = prompt_parts(lm, requests, batch_size=batch_size, prefix_reuse=prefix_reuse, prompt_reuse=prompt_reuse,
                               compute=compute)
    return decode(lm, reqs, parts, batch_size)


def prompt_parts(
    lm: Any, requests: Sequence[GenRequest], *, batch_size: int = 16, prefix_reuse: bool = True, prompt_reuse: bool = False,
    compute: Any = None,
) -> tuple[list[GenRequest], list[tuple[Any, int, list[int]]]]:
    """The requests truncated as lm-eval's HF backend does, and their prefills: (prefix KV or None, prefix length,
    rows) each, the shared prefixes computed (or found in the store) under the hooks installed now; requests with
    max_gen_toks 0 are in none."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    reqs, families = prompt_families(lm, requests, prefix_reuse)
    loose: list[int] = []
    parts: list[tuple[Any, int, list[int]]] = []
    for prefix, idx in families:
        shared = prefix_kv(lm, reqs[idx[0]].context[:prefix], compute) if prefix else None
        if prompt_reuse:  # the family's prefix (now stored) is where each row's own prompt KV starts from
            parts += own_prefixes(lm, [reqs[i].context for i in idx], idx, loose, compute)
            continue
        if shared is None:  # no shared prefix, or a model whose caches cannot share one
            loose.extend(idx)
            continue
        parts += _cut(reqs, idx, batch_size, shared, prefix)
    return reqs, parts + _cut(reqs, loose, batch_size)


def prompt_families(lm: Any, requests: Sequence[GenRequest], prefix_reuse: bool) -> tuple[list[GenRequest], list[tuple[int, list[int]]]]:
    """The requests truncated as lm-eval's HF backend does, and (shared prefix length or 0, request indices) per
    family of those that generate (max_gen_toks 0 produces nothing, runs nothing)."""
    reqs = []
    for i, r in enumerate(requests):
        r = truncate(r, lm.max_length)
        if r.max_gen_toks > 0 and not r.context:
            raise ValueError(f"request {i} has an empty context: generation needs at least one prompt token")
        reqs.append(r)
    todo = [i for i, r in enumerate(reqs) if r.max_gen_toks > 0]
    return reqs, [(prefix, [todo[j] for j in idx]) for prefix, idx in _prefix_families([reqs[i].context for i in todo], prefix_reuse)]


def decode(lm: Any, reqs: Sequence[GenRequest], parts: list, batch_size: int, configs: Sequence[int] | None = None) -> list[list[int]]:
    """Generated ids per request of `prompt_parts`' parts, batch_size rows a batch. `configs`: row i runs under
    configuration configs[i] of those whose hooks are installed side by side (worker.steer.side_by_side)."""
    out: list[list[int]] = [[] for _ in reqs]
    eos = frozenset(lm.tokenizer.eos_token_ids)
    for batch in _decode_batches(parts, batch_size):
        rows = [i for _, _, idx in batch for i in idx]
        under = [configs[i] for i in rows] if configs is not None else None
        for i, ids in zip(rows, _generate_batch(lm, [([reqs[i] for i in idx], shared, prefix) for shared, prefix, idx in batch], eos, under)):
            out[i] = ids
    return out


def _cut(reqs, idx, batch_size, shared=None, prefix=0) -> list[tuple[Any, int, list[int]]]:
    # Longest first, like lm-eval: similar lengths share a prefill (little padding) and memory peaks early. A family's
    # suffix prefill closes before its pads pass MAX_PADDING of its tokens, as worker.score's batches (parts decode together).
    out, real = [], 0
    for i in sorted(idx, key=lambda i: -len(reqs[i].context)):
        rows, n = out[-1][2] if out else [], len(reqs[i].context) - prefix
        padded = (len(rows) + 1) * (len(reqs[rows[0]].context) - prefix) if rows else 0  # the first is the longest
        if not out or len(rows) >= batch_size or (shared and len(rows) >= MIN_ROWS and padded > (1 + MAX_PADDING) * (real + n)):
            out.append((shared, prefix, []))
            real = 0
        out[-1][2].append(i)
        real += n
    return out


def _decode_batches(parts: list, batch_size: int) -> list[list]:
    """Consecutive prefills packed into decode batches of at most batch_size rows: small families decode
    together (one decode step serves them all) instead of one after the other."""
    out: list[list] = []
    rows = batch_size
    for part in parts:
        if rows + len(part[2]) > batch_size:
            out.append([])
            rows = 0
        out[-1].append(part)
        rows += len(part[2])
    return out


def _prefix_families(contexts: Sequence[tuple[int, ...]], reuse: bool) -> list[tuple[int, list[int]]]:
    """(shared prefix length, indices) per family; 0 for the rows that share nothing. worker.score's
    families, with each prompt's last token as its first scored position: every row keeps a suffix to
    prefill, whose last position gives its first generated token."""
    rows = [Row(tuple(c), [(i, len(c) - 1, ())], len(c)) for i, c in enumerate(contexts)]
    return [(f.prefix, sorted(i for row in f.rows for i, _, _ in row.requests)) for f in _families(rows, reuse)]


def families(requests: Sequence[GenRequest], max_length: int, reuse: bool = True) -> list[list[int]]:
    """Request indices grouped so that splitting a group would repeat a shared prompt prefix; the scheduler
    cuts chunks between groups (as for loglikelihood: worker.score.families)."""
    contexts, groups, live = [], [], []
    for i, r in enumerate(requests):
        room = max_length - r.max_gen_toks
        if r.max_gen_toks <= 0 or room <= 0 or not r.context:
            groups.append([i])  # nothing to run, or refused by the kernel: alone
            continue
        live.append(i)
        contexts.append(tuple(r.context[-room:]))
    for prefix, idx in _prefix_families(contexts, reuse):
        groups.extend([[live[j] for j in idx]] if prefix else [[live[j]] for j in idx])
    return groups


def make_batch_cache(model: Any, left_padding: list[int]) -> list[Any]:
    """One batched cache per layer, mirroring the model's own cache kinds (full or sliding window)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    if not hasattr(model, "make_cache"):
        return [BatchKVCache(left_padding) for _ in decoder_layers(model)]
    caches = []
    for c in model.make_cache():
        if type(c) is KVCache:
            caches.append(BatchKVCache(left_padding))
        elif type(c) is RotatingKVCache and c.keep == 0:
            caches.append(BatchRotatingKVCache(c.max_size, left_padding))
        else:
            raise ValueError(
                f"{type(model).__name__} uses {type(c).__name__} caches: batched generation supports "
                "KV and sliding-window caches only"
            )
    return caches


def _last_logits(lm: Any, tokens: mx.array, cache: list[Any]) -> mx.array:
    # Every row is left-padded, so its newest token is at the last position: run the LM head there only.
    h = lm.head.body(tokens, cache=cache)
    return lm.head.head(h[:, -1:, :])[:, 0, :].astype(mx.float32)



def _prefill(lm: Any, reqs: list[GenRequest]) -> tuple[list[Any], list[int], int, mx.array]:
    """Left-padded prompts in one forward: (cache, left pads, next write index, last-token logits)."""
    B = len(reqs)
    P = max(len(r.context) for r in reqs)
    pads = [P - len(r.context) for r in reqs]
    tokens = mx.array([[0] * p + list(r.context) for p, r in zip(pads, reqs)])
    cache = make_batch_cache(lm.model, pads)
    # Padded layout: row b's real tokens are [pads[b], P); every prompt ends at P.
    rows = Rows(offset=0, starts=mx.array(pads), ends=mx.full((B,), P), prompt_ends=mx.full((B,), P))
    with lm.hooks.forward(rows):
        logits = _last_logits(lm, tokens, cache)
    return cache, pads, P, logits


def shared_batch_cache(prefix_cache: list[Any], batch: int) -> list[Any]:
    """BatchKVCaches that start with the prefix's keys and values broadcast to every row (no left padding)."""
    out = []
    for kv in _broadcast(prefix_cache, batch):
        if isinstance(kv, ChosenCache):  # conditional steering: each row's pick, made when the layer first reads it
            out.append(kv.chosen.batched(batch))
            continue
        c = BatchKVCache([0] * batch)
        c.keys, c.values, c._idx = kv.keys, kv.values, kv.offset
        c.offset = c.offset + kv.offset
        out.append(c)
    return out


def reads_one_prefix(lm: Any) -> bool:
    """Whether `lm`'s rows read one copy of a shared prefix's KV (worker.cascade) rather than copies of it."""
    return cascade.usable(lm, _prefill_copied)


def _prefill_suffixes(lm: Any, reqs: list[GenRequest], prefix_cache: list[Any], prefix: int) -> tuple[list[Any], list[int], int, mx.array]:
    """A family's suffixes on one copy of the prefix KV (worker.cascade) where the model allows, else copied; under
    conditional steering each row reads the variant its decisions pick (worker.hooks.condition_share)."""
    conditional = isinstance(prefix_cache, SharedPrefix)
    with prefix_cache.continued() if conditional else contextlib.nullcontext():
        if reads_one_prefix(lm):
            return cascade.prefill(lm, reqs, prefix_cache.cascaded() if conditional else prefix_cache, prefix)
        return _prefill_copied(lm, reqs, prefix_cache, prefix)


def _prefill_copied(lm: Any, reqs: list[GenRequest], prefix_cache: list[Any], prefix: int) -> tuple[list[Any], list[int], int, mx.array]:
    """Each row's suffix after the prefix (copied per row), right-padded, in one forward; then the pads are rolled to
    the left of the cache, so the result is the left-padded layout `_prefill` gives (same return values)."""
    suffixes = [r.context[prefix:] for r in reqs]
    W = max(map(len, suffixes))
    right = [W - len(s) for s in suffixes]
    tokens = mx.array([list(s) + [0] * p for s, p in zip(suffixes, right)])
    cache = shared_batch_cache(prefix_cache, len(reqs))
    for c in cache:
        c.prepare(right_padding=right)
    # Right pads come after every real token (the causal mask hides them); ends marks each row's last token.
    ends = mx.array([prefix + len(s) for s in suffixes])
    with lm.hooks.forward(Rows(offset=prefix, ends=ends, prompt_ends=ends)):
        h = lm.head.body(tokens, cache=cache)
    last = mx.take_along_axis(h, mx.array([len(s) - 1 for s in suffixes])[:, None, None], axis=1)
    logits = lm.head.head(last)[:, 0, :].astype(mx.float32)
    for c in cache:
        c.finalize()  # row b's keys move right by its pads: left padding, prompt ending at prefix + W
    return cache, right, prefix + W, logits


def _prefill_last(lm: Any, reqs: list[GenRequest], cache: list[Any]) -> tuple[list[Any], list[int], int, mx.array]:
    """Rows whose caches hold all their prompt but the last token: the last tokens in one forward (as `_prefill`)."""
    B, P = len(reqs), max(len(r.context) for r in reqs)
    pads = [P - len(r.context) for r in reqs]  # hooks' layout: every prompt left-padded to end at P
    rows = Rows(offset=P - 1, starts=mx.array(pads), ends=mx.full((B,), P), prompt_ends=mx.full((B,), P))
    with lm.hooks.forward(rows):
        logits = _last_logits(lm, mx.array([[r.context[-1]] for r in reqs]), cache)
    return cache, pads, P, logits


def _merged_prefill(lm: Any, parts: list[tuple[list[GenRequest], Any, int]], configs: list[int] | None) -> tuple[list[Any], list[int], int, mx.array]:
    """Each part prefilled on its own (with its shared prefix, if any), then the caches joined row-wise into one
    left-padded batch (mlx-lm's BatchKVCache.extend right-aligns them); the same return values as `_prefill`."""
    if len(parts) > 1 and all(len(r) == 1 and s is not None and not isinstance(s, SharedPrefix) and len(r[0].context) == p + 1 for r, s, p in parts):
        rows, own = [r[0] for r, _, _ in parts], [s for _, s, _ in parts]
        held = cascade.stored_rows([r.context for r in rows], own) if reads_one_prefix(lm) else merged(own)
        with lm.hooks.rows_under(configs):
            return _prefill_last(lm, rows, held)
    done, start = [], 0
    for r, shared, prefix in parts:
        with lm.hooks.rows_under(configs[start : start + len(r)] if configs is not None else None):
            done.append(prefill_part(lm, r, shared, prefix))
        start += len(r)
    return join_prefills(done, parts)


def prefill_part(lm: Any, reqs: list[GenRequest], shared: Any, prefix: int) -> tuple[list[Any], list[int], int, mx.array]:
    """One part's prefill (the `_prefill` return values): its whole prompts, or its suffixes after a shared prefix."""
    return _prefill(lm, reqs) if shared is None else _prefill_suffixes(lm, reqs, shared, prefix)


def join_prefills(done: list[tuple], parts: list[tuple[list[GenRequest], Any, int]]) -> tuple[list[Any], list[int], int, mx.array]:
    """The parts' prefills (`prefill_part`'s, in order) as one left-padded batch: the `_prefill` return values."""
    if len(done) == 1:
        return done[0]
    cache = done[0][0]
    if any(isinstance(c, cascade.SharedPrefixCache) for d in done for c in d[0]):  # a plain part joins as one group
        cache = [c if isinstance(c, cascade.SharedPrefixCache) else cascade.SharedPrefixCache.plain(c) for c in cache]
    if not all(isinstance(c, BatchKVCache) for d in done for c in d[0]):
        raise ValueError("only plain KV caches can be joined")  # never: families need plain KV caches
    for d in done[1:]:
        for c, other in zip(cache, d[0]):
            c.extend(other)
    pos = max(d[2] for d in done)  # hooks' layout: every prompt left-padded to end at pos (caches keep their own)
    return cache, [pos - len(r.context) for rs, _, _ in parts for r in rs], pos, mx.concatenate([d[3] for d in done])


def _generate_batch(lm: Any, parts: list[tuple[list[GenRequest], Any, int]], eos: frozenset[int], configs: list[int] | None = None) -> list[list[int]]:
    """Generated ids for the rows of `parts` ((requests, prefix KV or None, prefix length) each), in order;
    `configs`: each row's configuration among those installed side by side."""
    reqs = [r for rs, _, _ in parts for r in rs]
    B = len(reqs)
    cache, pads, pos, logits = _merged_prefill(lm, parts, configs)
    prompt_end = pos
    keys = [None if r.greedy else sample_keys(r) for r in reqs]
    lookbacks = [lookback(r.until) for r in reqs]
    y, finite = next_tokens(logits, reqs, keys, 0), finite_flag(logits)

    live = list(range(B))  # batch rows still generating, in cache order
    generated: list[list[int]] = [[] for _ in range(B)]
    step = 0
    while True:
        mx.eval(y, finite, [c.state for c in cache])  # the step's one host sync
        check_finite(finite, logits)
        keep = []
        for j, (b, tok) in enumerate(zip(live, y.tolist())):
            r = reqs[b]
            if tok in eos:
                continue
            generated[b].append(tok)
            # Decode text, not the new token alone: a stop string may span tokens or end inside one.
            if r.until and stopped(lm.tokenizer, generated[b], r.until, lookbacks[b]):
                continue
            if len(generated[b]) < r.max_gen_toks:
                keep.append(j)
        step += 1
        if not keep:
            break
        if len(keep) < len(live):
            # Drop finished rows; the cache then trims the left padding the survivors no longer need,
            # so shift the layout the same way to keep Rows consistent with it.
            sel = mx.array(keep)
            for c in cache:
                c.filter(sel)
            live = [live[j] for j in keep]
            kept_pads = [pads[j] for j in keep]
            shift = min(kept_pads)
            pads = [p - shift for p in kept_pads]
            prompt_end -= shift
            pos -= shift
            y = y[sel]
        n = len(live)
        rows = Rows(
            offset=pos, starts=mx.array(pads), ends=mx.full((n,), pos + 1), prompt_ends=mx.full((n,), prompt_end)
        )
        with lm.hooks.rows_under([configs[b] for b in live] if configs is not None else None), lm.hooks.forward(rows):
            logits = _last_logits(lm, y[:, None], cache)
        pos += 1
        sub = [reqs[b] for b in live]
        y, finite = next_tokens(logits, sub, [keys[b] for b in live], step), finite_flag(logits)

    return generated
