"""A slice of the decoder's blocks run on its own: blocks below `a` hand back a given state, blocks from `b` on pass
their input through uncomputed (`advance`). Worker.grid runs the blocks a configuration leaves alone once for
all configurations; a conditional job's shared prefix (worker.hooks.condition_share) runs the blocks below a
decision once for both of its outcomes. `shares_lower` probes, once per model and split, that the slices give
the whole forward's numbers exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .instrument import decoder_layers

if TYPE_CHECKING:
    from ..load import LoadedModel


def broadcast_kv(c: Any, batch: int) -> KVCache:
    """A KVCache for `batch` rows that all start with the batch-1 cache `c`'s keys and values (one copy, broadcast)."""
    k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    fresh = KVCache()
    fresh.keys, fresh.values = mx.broadcast_to(k, (batch, *k.shape[1:])), mx.broadcast_to(v, (batch, *v.shape[1:]))
    fresh.offset = c.offset
    return fresh


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


def advance(lm: LoadedModel, a: int, b: int, h: mx.array | None, tokens: mx.array, cache: list | None) -> mx.array:
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


def lower(lm: LoadedModel, s: int, tokens: mx.array, cache: list | None) -> mx.array:
    """Blocks 0..s-1 on `tokens` (lazy); blocks s.. pass their input through and are never computed."""
    return advance(lm, 0, s, None, tokens, cache)


def injected(lm: LoadedModel, s: int, h: mx.array):
    """Blocks 0..s-1 return `h` (the last of them running the resid_post.{s-1} hooks on it)."""
    box = _Box()
    box.h = h
    return _staged(lm, {i: _Stage("inject", box, s - 1 if i == s - 1 else None) for i in range(s)})


def kv_cache(lm: LoadedModel) -> list | None:
    """A fresh prompt cache when every layer's is a plain KVCache (what prefix sharing supports), else None."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(lm.model)
    return cache if all(type(c) is KVCache for c in cache) else None


def eval_caches(caches: Sequence[Any]) -> None:
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
        below = lower(lm, s, x, None)
        got = upper_body(lm, s, below, x, None)
        if not mx.array_equal(want, got).item():
            return False
        if s > 1 and not mx.array_equal(below, advance(lm, 1, s, lower(lm, 1, x, None), x, None)).item():
            return False  # advancing from another split's state
        plain = kv_cache(lm)
        if plain is None:
            return True
        prefix, suffix = mx.array([[1, 2, 3, 4, 5, 6]]), mx.array([[7, 8, 9], [10, 11, 12]])
        lm.head.body(prefix, cache=plain)
        eval_caches(plain)
        want = lm.head.body(suffix, cache=[broadcast_kv(c, 2) for c in plain])
        shared = kv_cache(lm)
        h = lower(lm, s, prefix, shared)
        mx.eval(h)
        eval_caches(shared[:s])
        combined = upper_prefix(lm, s, shared, h, prefix) if s < lm.n_layers else shared
        h = lower(lm, s, suffix, [broadcast_kv(c, 2) for c in combined])
        got = upper_body(lm, s, h, suffix, [broadcast_kv(c, 2) for c in combined])
        return bool(mx.array_equal(want, got).item())
    except Exception:
        return False


def upper_body(lm: LoadedModel, s: int, h: mx.array, tokens: mx.array, cache: list | None) -> mx.array:
    with injected(lm, s, h):
        return lm.head.body(tokens, cache=cache)


def upper_prefix(lm: LoadedModel, s: int, shared: list, h: mx.array, tokens: mx.array) -> list:
    """The prefix's caches for one configuration: the shared lower layers', its own upper layers' (evaluated);
    s < n_layers.

    The upper pass runs on fresh caches (offset 0, so the model builds the prefix's own mask); the lower
    layers' fresh caches stay untouched and are dropped.
    """
    fresh = kv_cache(lm)
    upper_body(lm, s, h, tokens, fresh)
    eval_caches(fresh[s:])
    return list(shared[:s]) + list(fresh[s:])




@contextlib.contextmanager
def unhooked(lm: LoadedModel) -> Iterator[None]:
    """No hook runs for the block (a lower pass inside a configuration's job: its resid_post.{s-1} hooks belong to
    the upper pass, which runs them on the injected state)."""
    saved, lm.hooks._hooks = lm.hooks._hooks, {}
    try:
        yield
    finally:
        lm.hooks._hooks = saved
