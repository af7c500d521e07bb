"""Scoring kernels: lm-eval loglikelihood over token ids, with HF-backend semantics. No Ray, no lm-eval."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .hooks import Rows
from .hooks.blocks import broadcast_kv
from .hooks.condition_share import SharedPrefix, conditional_gates, grown_prefix, shareable, shared_prefix
from .spec import Batching
from .split import stages


# --- requests -> rows -> families -------------------------------------------------------------------

MIN_SHARED_PREFIX = 32  # tokens; below this a separate prefix pass costs more than it saves


@dataclass
class Row:
    """One model input; scores the requests that share it (MMLU's A/B/C/D share one row).

    `prompt_end` is one past the last context token: positions from there on are continuation tokens fed as
    input. Requests share a row only if they share it too whenever steering tells prompt from continuation.
    """

    tokens: tuple[int, ...]
    requests: list[tuple[int, int, tuple[int, ...]]]  # (request index, first scored position, targets)
    prompt_end: int

    @property
    def first_scored(self) -> int:
        return min(start for _, start, _ in self.requests)


@dataclass
class Family:
    """Rows whose first `prefix` tokens are identical: that prefix runs once and its KV cache is shared."""

    prefix: int
    rows: list[Row]


def _rows(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int, split_prompt: bool = False
) -> tuple[list[Row], dict[int, tuple[float, bool]]]:
    """lm-eval HF semantics: input (ctx + cont)[-(max_length + 1):][:-1], score its last len(cont) positions.

    A continuation longer than the window keeps its last max_length tokens (HF refuses these). An empty
    continuation scores (0.0, True): the sum over no tokens. With `split_prompt`, requests with the same input
    but another context/continuation boundary get rows of their own.
    """
    rows: dict[tuple, Row] = {}
    trivial: dict[int, tuple[float, bool]] = {}
    contexts: dict[int, tuple[int, ...]] = {}  # id -> ints: answer choices share one context object
    for i, (ctx, cont) in enumerate(requests):
        cont = tuple(map(int, cont))
        if not cont:
            trivial[i] = (0.0, True)
            continue
        ints = contexts.get(id(ctx))
        if ints is None:
            ints = contexts[id(ctx)] = tuple(map(int, ctx))
        inp = (ints + cont)[-(max_length + 1) :][:-1]
        n_scored = min(len(cont), len(inp))
        if n_scored == 0:
            raise ValueError(f"request {i} has no context token to condition on: give it a prefix (BOS/EOS) token")
        prompt_end = len(inp) - min(len(cont) - 1, len(inp))
        row = rows.setdefault((inp, prompt_end) if split_prompt else inp, Row(inp, [], prompt_end))
        row.requests.append((i, len(inp) - n_scored, cont[-n_scored:]))
    return list(rows.values()), trivial


def _shared_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`: bisection on slice equality (compared in C; the
    head runs this on every request of a streamed run)."""
    lo, hi = 0, min(limit, len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _families(rows: list[Row], reuse: bool) -> list[Family]:
    """Sorted token-wise, rows sharing a long prefix sit next to each other; collect them greedily.

    The shared prefix stops before any scored position, so every scored logit comes from the suffix pass.
    """
    if not reuse:
        return [Family(0, rows)] if rows else []
    rows = sorted(rows, key=lambda r: r.tokens)
    families: list[Family] = []
    loose: list[Row] = []

    def close(group: list[Row], prefix: int) -> None:
        if len(group) > 1 and prefix >= MIN_SHARED_PREFIX:
            families.append(Family(prefix, group))
        else:
            loose.extend(group)

    group, prefix = [], 0
    for row in rows:
        if group:
            shared = _shared_len(group[0].tokens, row.tokens, min(prefix, row.first_scored))
            if shared >= MIN_SHARED_PREFIX:
                group.append(row)
                prefix = shared
                continue
            close(group, prefix)
        group, prefix = [row], row.first_scored
    if group:
        close(group, prefix)
    if loose:
        families.append(Family(0, loose))
    return families


def families(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int, reuse: bool = True) -> list[list[int]]:
    """Request indices grouped so that splitting a group would repeat work (shared input or prefix).

    The distributed scheduler cuts chunks between groups, so worker-side reuse survives sharding.
    """
    rows, trivial = _rows(requests, max_length)
    groups = [[i] for i in trivial]
    for fam in _families(rows, reuse):
        if fam.prefix:
            groups.append(sorted(i for row in fam.rows for i, _, _ in row.requests))
        else:
            groups.extend(sorted(i for i, _, _ in row.requests) for row in fam.rows)
    return groups


# --- forward passes ---------------------------------------------------------------------------------


MAX_PADDING = 0.15  # close a batch (of at least MIN_ROWS rows) before pads exceed this share of its tokens
MIN_ROWS = 4


def _batches(rows: list[Row], prefix: int, batching: Batching) -> list[list[Row]]:
    """Rows sorted by length, cut so that no forward exceeds the row and token budgets or wastes much on pads."""
    rows = sorted(rows, key=lambda r: len(r.tokens))
    out: list[list[Row]] = []
    batch: list[Row] = []
    real = 0  # real (unpadded) suffix tokens in the batch
    for row in rows:
        width = len(row.tokens) - prefix  # longest so far: rows are sorted
        size = len(batch) + 1
        fits = (
            size <= batching.batch_size
            and size * width <= batching.max_batch_tokens
            and size * len(row.tokens) <= 4 * batching.max_batch_tokens
            and (len(batch) < MIN_ROWS or size * width <= (1 + MAX_PADDING) * (real + width))
        )
        if batch and not fits:
            out.append(batch)
            batch, real = [], 0
        batch.append(row)
        real += width
    if batch:
        out.append(batch)
    return out


def _empty_cache(lm) -> list | None:
    """A fresh per-layer KV cache to hold a shared prefix; None for rotating / hybrid caches (no sharing)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(lm.model)
    return cache if all(type(c) is KVCache for c in cache) else None


def _prefix_body(lm, tokens: Sequence[int], cache: list) -> mx.array:
    """The shared prefix's forward (batch 1) into `cache`, lazy; its body output."""
    # Rows(ends=P+1): every prefix token is real, none is any row's last token.
    with lm.hooks.forward(Rows(offset=0, ends=mx.array([len(tokens) + 1]))):
        return lm.head.body(mx.array([tokens]), cache=cache)


def _prefix_cache(lm, tokens: Sequence[int]) -> list | None:
    """Run the shared prefix once (batch 1) and return its per-layer KV cache."""
    cache = _empty_cache(lm)
    if cache is None:
        return None
    _prefix_body(lm, tokens, cache)
    mx.eval([c.state for c in cache])
    return cache


def _family_cache(lm, tokens: Sequence[int]) -> list | SharedPrefix | None:
    """The family's shared prefix cache; under conditional steering one per combination of decisions, each row
    reading its own, grown from the blocks they share where the model runs in slices (worker.hooks.condition_share).
    None: no sharing."""
    gates = conditional_gates(lm.hooks)
    if not gates:
        return _prefix_cache(lm, tokens)
    return grown_prefix(lm, gates, tokens) or shared_prefix(gates, lambda: _prefix_cache(lm, tokens))


def _broadcast(prefix_cache: list | SharedPrefix, batch: int) -> list:
    if isinstance(prefix_cache, SharedPrefix):  # a conditional job's prefix, picked per row
        return prefix_cache.broadcast(batch)
    return [broadcast_kv(c, batch) for c in prefix_cache]


def _body_batch(lm, batch: list[Row], prefix: int, cache: list | None) -> mx.array:
    """One forward of the body over right-padded rows: lazy hidden states [B, width, hidden]."""
    width = max(len(r.tokens) for r in batch) - prefix
    padded = [list(r.tokens[prefix:]) + [0] * (width - len(r.tokens) + prefix) for r in batch]
    rows = Rows(
        offset=prefix, ends=mx.array([len(r.tokens) for r in batch]), prompt_ends=mx.array([r.prompt_end for r in batch]),
        requests=tuple(tuple(i for i, _, _ in r.requests) for r in batch),
    )
    with lm.hooks.forward(rows), continued(cache):
        return lm.head.body(mx.array(padded), cache=_broadcast(cache, len(batch)) if cache else None)


def continued(cache: Any):
    """Inside, forwards continue `cache` (a conditional job's shared prefix: the probes add its sums); else nothing."""
    return cache.continued() if isinstance(cache, SharedPrefix) else contextlib.nullcontext()


def _score_batch(lm, batch: list[Row], prefix: int, cache: list | None):
    """One forward over right-padded rows; returns lazy per-request (sum logprob, all greedy) arrays."""
    return _head_batch(lm, batch, prefix, _body_batch(lm, batch, prefix, cache))


def _head_batch(lm, batch: list[Row], prefix: int, hidden: mx.array):
    """Per-request lazy (sum logprob, misses) from a batch's body output: the head at the scored rows only."""
    width = hidden.shape[1]
    # Gather the scored positions (and only those) before the LM head.
    flat_pos, targets, segment, index = [], [], [], []
    for b, row in enumerate(batch):
        for i, start, tgt in row.requests:
            for j, t in enumerate(tgt):
                flat_pos.append(b * width + start - prefix + j)
                targets.append(t)
                segment.append(len(index))
            index.append(i)
    hidden = hidden.reshape(len(batch) * width, hidden.shape[-1])
    uniq = sorted(set(flat_pos))
    where = {p: k for k, p in enumerate(uniq)}
    logits = lm.head.head(hidden[mx.array(uniq)]).astype(mx.float32)
    at, tg = mx.array([where[p] for p in flat_pos]), mx.array(targets)
    token_lp = logits[at, tg] - mx.logsumexp(logits, axis=-1)[at]  # log-softmax, read at the targets only
    missed = (mx.argmax(logits, axis=-1)[at] != tg).astype(mx.int32)
    seg = mx.array(segment)
    sums = mx.zeros((len(index),), mx.float32).at[seg].add(token_lp)
    misses = mx.zeros((len(index),), mx.int32).at[seg].add(missed)
    return index, sums, misses


def loglikelihood(
    lm,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batching: Batching | None = None,
) -> list[tuple[float, bool]]:
    """(sum of continuation logprobs, continuation is greedy) for token-level (context, continuation) pairs."""
    batching = batching or Batching()
    rows, results = _rows(requests, lm.max_length, split_prompt=lm.hooks.splits_prompt)

    def collect(index, sums, misses) -> None:
        for i, s, m in zip(index, sums.tolist(), misses.tolist()):
            results[i] = (s, m == 0)

    pending = None
    for fam in _families(rows, batching.prefix_reuse):
        cache = _family_cache(lm, fam.rows[0].tokens[: fam.prefix]) if fam.prefix else None
        prefix = fam.prefix if cache is not None else 0
        for batch in _batches(fam.rows, prefix, batching):
            out = _score_batch(lm, batch, prefix, cache)
            mx.async_eval(out[1], out[2])  # this batch computes while the previous one is read back
            if pending is not None:
                collect(*pending)
            pending = out
    if pending is not None:
        collect(*pending)
    return [results[i] for i in range(len(requests))]



# --- the same kernel on a pipeline group: micro-batches through worker.split.stages (issue 26) ------------


def _prefix_micros(lm, tokens: Sequence[int]) -> tuple[list[stages.Micro], list | SharedPrefix | None]:
    """A family's prefix pass as micro-batches (every rank keeps its layers' KV), and the cache its batches read
    (None: no sharing); under conditional steering one pass per combination of decisions (condition_share)."""
    gates = conditional_gates(lm.hooks)
    caches = [_empty_cache(lm) for _ in range(1 << len(gates))] if shareable(gates) else [None]
    if caches[0] is None:
        return [], None
    shared = SharedPrefix(gates, len(tokens), caches) if gates else caches[0]
    run = shared.run if gates else lambda v, body: body()
    return [stages.Micro(lambda v=v, c=c: run(v, lambda: _prefix_body(lm, tokens, c)), keep=lambda c=c: [x.state for x in c])
            for v, c in enumerate(caches)], shared  # fmt: skip


def _micros(lm, rows: list[Row], batching: Batching) -> list[stages.Micro]:
    """Per family: its prefix pass(es), then its batches, as loglikelihood cuts them."""
    micros: list[stages.Micro] = []
    for fam in _families(rows, batching.prefix_reuse):
        passes, cache = _prefix_micros(lm, fam.rows[0].tokens[: fam.prefix]) if fam.prefix else ([], None)
        micros += passes
        prefix = fam.prefix if cache is not None else 0
        for batch in _batches(fam.rows, prefix, batching):
            micros.append(stages.Micro(lambda b=batch, p=prefix, c=cache: _body_batch(lm, b, p, c),
                                       lambda h, b=batch, p=prefix: _head_batch(lm, b, p, h)))  # fmt: skip
    return micros


def pipelined_loglikelihood(lm, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                            batching: Batching | None = None) -> list[tuple[float, bool] | None]:  # fmt: skip
    """`loglikelihood` on one rank of a pipeline group: its micro-batches pipelined across the ranks; the last
    rank returns the numbers (equal to the unsplit model's), the others None per request."""
    batching = batching or Batching()
    rows, results = _rows(requests, lm.max_length, split_prompt=lm.hooks.splits_prompt)

    def collect(out) -> None:
        index, sums, misses = out[0], out[1].tolist(), out[2].tolist()
        for i, s, m in zip(index, sums, misses):
            results[i] = (s, m == 0)

    last = stages.run(lm, _micros(lm, rows, batching), collect)
    return [results[i] for i in range(len(requests))] if last else [None] * len(requests)
