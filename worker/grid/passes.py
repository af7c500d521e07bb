"""The lower and upper passes of a split model (see worker.grid): staged blocks, the probe, where a
configuration starts to change numbers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from ..hooks import Hook, decoder_layers
from ..hooks.manager import splits_at_prompt
from ..load import LoadedModel
from ..score import _broadcast
from ..spec import Steering, head_shape
from ..steer import hidden_size, hooks_for


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


def _installs(lm: LoadedModel, steerings: Sequence[Steering]) -> list[list[tuple[str, Hook]]]:
    """Each configuration's hooks, built (and checked against the model) once for the whole call."""
    hidden = hidden_size(lm) if any(steerings) else 0
    return [hooks_for(s, lm.n_layers, hidden, heads=head_shape(lm.config)) if s else [] for s in steerings]


def splits_prompt(installs: Sequence[list[tuple[str, Hook]]]) -> bool:
    """Whether any configuration's hooks treat prompt and continuation positions differently (rows then split there)."""
    return splits_at_prompt(op for install in installs for _, op in install)


def _split_of(install: list[tuple[str, Hook]], n_layers: int) -> int:
    return min((_point_split(name) for name, _ in install), default=n_layers)


@contextlib.contextmanager
def unhooked(lm: LoadedModel) -> Iterator[None]:
    """No hook runs for the block (a lower pass inside a configuration's job: its resid_post.{s-1} hooks belong to
    the upper pass, which runs them on the injected state)."""
    saved, lm.hooks._hooks = lm.hooks._hooks, {}
    try:
        yield
    finally:
        lm.hooks._hooks = saved
