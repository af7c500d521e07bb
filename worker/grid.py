"""Grids of steering configurations on one loaded model: every (configuration, request) pair of a chunk.

Steering at hook point resid_pre.L or resid_post.L cannot change anything the decoder blocks below it compute.
A configuration's "split" s is the number of blocks it leaves alone (resid_pre.L: L, resid_post.L: L + 1, the
lowest of its interventions; none: all). For loglikelihood work the unsteered stream runs once per batch, and
each configuration branches off it at its split:

    lower pass   (once, unsteered)      tokens -> blocks 0..s1-1 -> h  (captured; blocks >= s1 pass x through)
    upper pass   (per configuration of split s1, its hooks installed)
                                        blocks 0..s1-1 return h (resid_post.{s1-1} hooks run on it) -> blocks
                                        s1..n-1 -> final norm -> LM head at the scored positions only
    advance      (once, unsteered)      h -> blocks s1..s2-1 -> the state at the next split s2, and so on

so the unsteered blocks up to the highest split run once and each configuration runs only its own blocks. A
shared few-shot prefix (worker.score's families) is split the same way: its unsteered layers' KV caches are
computed once, each configuration's upper layers' caches once per configuration (under its steering, as an
independent steered run computes them).

The mechanism is generic over mlx-lm models because it touches only the decoder blocks, the way
worker.hooks does: for the duration of one forward a block's class is swapped for a subclass whose
`__call__` passes its input through, records its output, or returns the captured state. The model's own
`__call__` (embeddings, position embeddings, embedding scaling, masks built from the caches' offsets) runs
unchanged, so gpt2's position embeddings or gemma's scaling are computed lazily and never evaluated above the
split. Whether this holds for a model is checked once per split with a probe equality test (with and
without a prefix KV cache), as `Head.for_model` does; architectures where it does not hold (a forward that
reads blocks' outputs elsewhere, blocks returning tuples, ...) run each configuration on its own: the same
numbers, just no sharing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from .generate import GenRequest, families, generate
from .hooks import Hook, Rows, decoder_layers
from .load import LoadedModel
from .prefix_cache import blocks, prompt_sharers
from .score import Row, _batches, _broadcast, _families, _rows, _score_batch, loglikelihood
from .spec import Batching, Steering, head_shape
from .steer import hidden_size, hooks_for

__all__ = ["GRID_BLOCK", "distinct", "grid_generate", "grid_loglikelihood", "run_grid", "shares_lower", "split_point"]

GRID_BLOCK = 16  # most configurations sharing one lower pass (each holds its own upper prefix KV caches)
KINDS = ("loglikelihood", "generate")


# --- where a configuration starts to change numbers --------------------------------------------------


def _point_split(name: str) -> int:
    site, _, layer = name.rpartition(".")
    return int(layer) + 1 if site == "resid_post" else int(layer)  # the other sites are in or before block L


def split_point(steering: Steering | None, n_layers: int) -> int:
    """How many decoder blocks compute exactly what the plain model does under `steering`.

    resid_pre.L (and resid_mid.L, attn_out.L, mlp_out.L, inside block L) leave blocks 0..L-1 alone (L), resid_post.L
    blocks 0..L (L + 1); no intervention: n_layers. Negative layers count from the end.
    """
    out = n_layers
    for iv in steering.interventions if steering else ():
        layer = iv.layer + n_layers if iv.layer < 0 else iv.layer
        out = min(out, _point_split(f"{iv.site}.{layer}"))
    return out


# --- staged blocks ------------------------------------------------------------------------------------


class _Box:
    """The hidden state handed from the lower pass to the upper ones."""

    h: mx.array | None = None


class _Stage:
    """What a staged block does in one forward: 'pass' (return its input), 'capture' (run, record its output)
    or 'inject' (return the captured state; `hooks_at` names the resid_post hook point to run on it)."""

    def __init__(self, mode: str, box: _Box, hooks_at: int | None = None) -> None:
        self.mode, self.box, self.hooks_at = mode, box, hooks_at


_STAGED: dict[type, type] = {}


def _first(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else next(iter(kwargs.values()))


def _staged_class(cls: type) -> type:
    if cls not in _STAGED:

        def __call__(self, *args: Any, **kwargs: Any):
            stage: _Stage = self._orchard_stage
            if stage.mode == "pass":
                return _first(args, kwargs)
            if stage.mode == "capture":
                out = cls.__call__(self, *args, **kwargs)
                stage.box.h = out[0] if isinstance(out, tuple) else out
                return out
            h, x = stage.box.h, _first(args, kwargs)
            if h is None or tuple(h.shape[:2]) != tuple(x.shape[:2]):
                raise RuntimeError(f"grid: the captured state does not fit this forward ({None if h is None else h.shape} vs {x.shape})")
            if stage.hooks_at is not None:
                h = self._orchard_hooks.run(f"resid_post.{stage.hooks_at}", h, stage.hooks_at)
            return h

        _STAGED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_staged": True})
    return _STAGED[cls]


@contextlib.contextmanager
def _staged(lm: LoadedModel, stages: dict[int, _Stage]) -> Iterator[None]:
    """Swap the named blocks' classes for the staged subclass for the block; restore them exactly."""
    layers = decoder_layers(lm.model)
    swapped: list[tuple[Any, type]] = []
    try:
        for i, stage in stages.items():
            block = layers[i]
            cls = type(block)
            object.__setattr__(block, "_orchard_stage", stage)
            block.__class__ = _staged_class(cls)
            swapped.append((block, cls))
        yield
    finally:
        for block, cls in swapped:
            block.__class__ = cls
            object.__delattr__(block, "_orchard_stage")


def _advance(lm: LoadedModel, a: int, b: int, h: mx.array | None, tokens: mx.array, cache: list | None) -> mx.array:
    """Unsteered blocks a..b-1 (lazy): blocks below a return `h` (the state entering block a; a = 0: the
    tokens' embeddings are used), blocks from b on pass their input through and are never computed."""
    box_in, box_out = _Box(), _Box()
    box_in.h = h
    stages = {i: _Stage("inject", box_in) for i in range(a)}
    stages.update({b - 1: _Stage("capture", box_out), **{i: _Stage("pass", box_out) for i in range(b, lm.n_layers)}})
    with _staged(lm, stages):
        lm.head.body(tokens, cache=cache)
    if box_out.h is None:
        raise RuntimeError(f"grid: block {b - 1} never ran in the {lm.hooks.arch} model's forward")
    return box_out.h


def _lower(lm: LoadedModel, s: int, tokens: mx.array, cache: list | None) -> mx.array:
    """Blocks 0..s-1 on `tokens` (lazy); blocks s.. pass their input through and are never computed."""
    return _advance(lm, 0, s, None, tokens, cache)


def _injected(lm: LoadedModel, s: int, h: mx.array):
    """Blocks 0..s-1 return `h` (the last of them running the resid_post.{s-1} hooks on it)."""
    box = _Box()
    box.h = h
    return _staged(lm, {i: _Stage("inject", box, s - 1 if i == s - 1 else None) for i in range(s)})


def _kv_cache(lm: LoadedModel) -> list | None:
    """A fresh prompt cache when every layer's is a plain KVCache (what prefix sharing supports), else None."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(lm.model)
    return cache if all(type(c) is KVCache for c in cache) else None


def _eval_caches(caches: Sequence[Any]) -> None:
    mx.eval([(c.keys, c.values) for c in caches if c.keys is not None])


# --- the probe -----------------------------------------------------------------------------------------


def shares_lower(lm: LoadedModel, s: int) -> bool:
    """Whether lower + upper passes split at block s reproduce the model's forward exactly on this model.

    Probed once per (model, split): with no cache, and (plain KV caches only) a prefix cache broadcast to a
    batch of two, as the scoring kernel uses them.
    """
    memo: dict[int, bool] = lm.__dict__.setdefault("_orchard_grid_probe", {})
    if s not in memo:
        memo[s] = 0 < s <= lm.n_layers and _probe(lm, s)
    return memo[s]


def _probe(lm: LoadedModel, s: int) -> bool:
    if lm.hooks.active:
        return False  # the probe compares unsteered forwards only
    try:
        x = mx.array([[1, 2, 3, 4, 5, 6, 7]])
        want = lm.head.body(x)
        lower = _lower(lm, s, x, None)
        got = _upper_body(lm, s, lower, x, None)
        if not mx.array_equal(want, got).item():
            return False
        if s > 1 and not mx.array_equal(lower, _advance(lm, 1, s, _lower(lm, 1, x, None), x, None)).item():
            return False  # advancing from another split's state
        plain = _kv_cache(lm)
        if plain is None:
            return True
        prefix, suffix = mx.array([[1, 2, 3, 4, 5, 6]]), mx.array([[7, 8, 9], [10, 11, 12]])
        lm.head.body(prefix, cache=plain)
        _eval_caches(plain)
        want = lm.head.body(suffix, cache=_broadcast(plain, 2))
        shared = _kv_cache(lm)
        h = _lower(lm, s, prefix, shared)
        mx.eval(h)
        _eval_caches(shared[:s])
        combined = _upper_prefix(lm, s, shared, h, prefix) if s < lm.n_layers else shared
        h = _lower(lm, s, suffix, _broadcast(combined, 2))
        got = _upper_body(lm, s, h, suffix, _broadcast(combined, 2))
        return bool(mx.array_equal(want, got).item())
    except Exception:
        return False


def _upper_body(lm: LoadedModel, s: int, h: mx.array, tokens: mx.array, cache: list | None) -> mx.array:
    with _injected(lm, s, h):
        return lm.head.body(tokens, cache=cache)


def _upper_prefix(lm: LoadedModel, s: int, shared: list, h: mx.array, tokens: mx.array) -> list:
    """The prefix's caches for one configuration: the shared lower layers', its own upper layers' (evaluated);
    s < n_layers.

    The upper pass runs on fresh caches (offset 0, so the model builds the prefix's own mask); the lower
    layers' fresh caches stay untouched and are dropped.
    """
    fresh = _kv_cache(lm)
    _upper_body(lm, s, h, tokens, fresh)
    _eval_caches(fresh[s:])
    return list(shared[:s]) + list(fresh[s:])


# --- loglikelihood ---------------------------------------------------------------------------------------


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


def _installs(lm: LoadedModel, steerings: Sequence[Steering]) -> list[list[tuple[str, Hook]]]:
    """Each configuration's hooks, built (and checked against the model) once for the whole call."""
    hidden = hidden_size(lm) if any(steerings) else 0
    return [hooks_for(s, lm.n_layers, hidden, heads=head_shape(lm.config)) if s else [] for s in steerings]


def _split_of(install: list[tuple[str, Hook]], n_layers: int) -> int:
    return min((_point_split(name) for name, _ in install), default=n_layers)


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
    splits_prompt = any(getattr(op, "positions", "all") in ("prompt", "continuation") for ins in installs for _, op in ins)
    rows, trivial = _rows(requests, lm.max_length, split_prompt=splits_prompt)
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
        if fam.prefix and _kv_cache(lm) is not None:  # rotating / hybrid caches: no prefix sharing (as worker.score)
            prefix = fam.prefix
            tokens = mx.array([fam.rows[0].tokens[:prefix]])
            unsteered: list[Any] = [None] * n  # the prefix's unsteered KV caches, filled level by level
            h, at = None, 0
            for s in steps:
                fresh = _kv_cache(lm)  # offset 0: the model builds the prefix's own mask
                with lm.hooks.forward(_prefix_rows(prefix)):
                    h = _advance(lm, at, s, h, tokens, fresh)
                mx.eval(h)
                _eval_caches(fresh[at:s])
                unsteered[at:s], at = fresh[at:s], s
                for c in levels[s]:
                    if s >= n:  # every layer's cache is the unsteered one: the hooks act on no cache
                        caches[c] = list(unsteered)
                        continue
                    with lm.hooks.installed(installs[c]), lm.hooks.forward(_prefix_rows(prefix)):
                        caches[c] = _upper_prefix(lm, s, unsteered, h, tokens)
        # The advances' caches: the unsteered ones up to the highest split, above it (never computed, only read
        # for the masks' offsets) any configuration's.
        any_cache = unsteered[: steps[-1]] + caches[block[0]][steps[-1] :] if prefix else None
        for batch in _batches(fam.rows, prefix, batching):
            tokens, layout = _padded(batch, prefix)
            h, at = None, 0
            for s in steps:
                with lm.hooks.forward(layout):
                    h = _advance(lm, at, s, h, tokens, _broadcast(any_cache, len(batch)) if prefix else None)
                at = s
                for c in levels[s]:
                    with lm.hooks.installed(installs[c]), _injected(lm, s, h):
                        out = _score_batch(lm, batch, prefix, caches[c] if prefix else None)
                    mx.async_eval(out[1], out[2])  # computes while the previous one is read back
                    if pending is not None:
                        collect(*pending)
                    pending = (c, *out)
    if pending is not None:
        collect(*pending)


# --- generation ------------------------------------------------------------------------------------------


def grid_generate(
    lm: LoadedModel, steerings: Sequence[Steering], requests: Sequence[GenRequest], batching: Batching | None = None
) -> list[list[str]]:
    """Texts per request per configuration ([request][configuration]), each a steered run. Configurations alike on
    prompt positions (prefix_cache.prompt_sharers) go block by block of requests, sharing each prompt's KV."""
    batching = batching or Batching()
    installs = _installs(lm, steerings)
    sharers = prompt_sharers(lm, installs, [r.context for r in requests], batching.batch_size)
    results: list[list[Any]] = [[None] * len(installs) for _ in requests]
    alone, together = [c for c, s in enumerate(sharers) if not s], [c for c, s in enumerate(sharers) if s]
    groups = families(requests, lm.max_length, batching.prefix_reuse) if together else []
    for configs, idx in [(alone, list(range(len(requests))))] + [(together, b) for b in blocks(groups, batching.batch_size)]:
        for c in configs:
            with lm.hooks.installed(installs[c]):
                texts = generate(lm, [requests[i] for i in idx], batch_size=batching.batch_size,
                                 prefix_reuse=batching.prefix_reuse, prompt_reuse=configs is together)
            for i, text in zip(idx, texts):
                results[i][c] = text
    return results


def distinct(steerings: Sequence[Steering]) -> tuple[list[Steering], list[int]]:
    """The distinct configurations (first occurrence order), and which one each given configuration is."""
    index: dict[str, int] = {}
    owner = [index.setdefault(s.key(), len(index)) for s in steerings]
    configs = [s for i, (s, o) in enumerate(zip(steerings, owner)) if o not in owner[:i]]
    return configs, owner


def run_grid(
    lm: LoadedModel, kind: str, steerings: Sequence[Steering], requests: Sequence[Any], batching: Batching | None = None
) -> list[list]:
    """Results per request per configuration ([request][configuration]); identical configurations run once."""
    if kind not in KINDS:
        raise ValueError(f"a grid runs {' or '.join(KINDS)} work, not {kind!r}")
    configs, owner = distinct(steerings)
    kernel = grid_loglikelihood if kind == "loglikelihood" else grid_generate
    out = kernel(lm, configs, requests, batching)
    return out if len(configs) == len(owner) else [[r[o] for o in owner] for r in out]
