"""Hook points on the residual stream of mlx-lm decoder blocks: `resid_pre.{L}` and `resid_post.{L}`.

`instrument(model)` swaps each decoder block's class for a subclass whose `__call__` runs the hooks around
the original one. The block stays the same object, so attribute reads (`use_sliding`, ...), any call
signature and the parameter tree (weight names, LoRA, quantization) are untouched. With nothing registered
the block's own output array is returned as is: the instrumented model is bitwise the plain model.

Kernels describe the rows of each forward with a `Rows` (where each row's real tokens, and its prompt,
begin and end in the padded layout); interventions turn it into position masks, so "last" is each row's
own last real token and pad positions are never changed. This module is the mechanism (hook points, Rows,
Capture); the steering ops live in `worker.steer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

POSITIONS = ("all", "prompt", "continuation", "last")
HOOK_POINTS = ("resid_pre", "resid_post")


@dataclass
class Rows:
    """Where the real tokens of each row are, in padded-layout indices (arrays of shape [B], int32).

    offset: padded index of the first token of the forward being run (> 0 after a KV-cached prefix).
    starts: first real index per row (left padding); None means 0.
    ends: one past the last real index per row; None means every position of the forward is real.
    prompt_ends: one past the last prompt index per row; None means the whole row is prompt.
    """

    offset: int = 0
    starts: mx.array | None = None
    ends: mx.array | None = None
    prompt_ends: mx.array | None = None

    def mask(self, positions: str, batch: int, length: int) -> mx.array:
        """Boolean [B, S] mask of the forward's positions selected by `positions`."""
        if positions not in POSITIONS:
            raise ValueError(f"unknown positions {positions!r}: choose one of {', '.join(POSITIONS)}")
        idx = mx.arange(self.offset, self.offset + length)[None, :]
        ends = self.ends[:, None] if self.ends is not None else mx.full((batch, 1), self.offset + length)
        real = idx < ends
        if self.starts is not None:
            real = real & (idx >= self.starts[:, None])
        if positions == "all":
            return real
        if positions == "last":
            return idx == ends - 1
        prompt_ends = self.prompt_ends[:, None] if self.prompt_ends is not None else ends
        if positions == "prompt":
            return real & (idx < prompt_ends)
        return real & (idx >= prompt_ends)


Hook = Callable[[mx.array, "HookContext"], mx.array]


class HookError(RuntimeError):
    """A hook that cannot do what it was installed for; the message names the hook point and the architecture."""


@dataclass
class HookContext:
    name: str
    layer: int
    rows: Rows


class HookManager:
    """Named hook lists; kernels set `rows` around each forward with `manager.forward(rows)`.

    `arch` names the model's architecture in errors. The manager counts forwards and, per hook point, the
    calls that ran its hooks, so `installed` can tell a hook that never ran from one that did.
    """

    def __init__(self, n_layers: int, arch: str = "model") -> None:
        self.n_layers = n_layers
        self.arch = arch
        self._hooks: dict[str, list[Hook]] = {}
        self.rows = Rows()
        self._forwards = 0
        self._runs: dict[str, int] = {}

    def check_name(self, name: str) -> None:
        point, _, layer = name.rpartition(".")
        if point not in HOOK_POINTS or not layer.isdigit() or not 0 <= int(layer) < self.n_layers:
            raise ValueError(
                f"unknown hook point {name!r}: use resid_pre.L or resid_post.L with 0 <= L < {self.n_layers}"
            )

    def add(self, name: str, fn: Hook) -> Hook:
        self.check_name(name)
        self._hooks.setdefault(name, []).append(fn)
        return fn

    def remove(self, name: str, fn: Hook | None = None) -> None:
        if fn is None:
            self._hooks.pop(name, None)
        elif name in self._hooks:
            self._hooks[name] = [f for f in self._hooks[name] if f is not fn]
            if not self._hooks[name]:
                del self._hooks[name]

    def clear(self) -> None:
        self._hooks.clear()

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    @property
    def splits_prompt(self) -> bool:
        """Whether a registered hook treats prompt and continuation positions differently."""
        return any(getattr(f, "positions", "all") in ("prompt", "continuation") for fs in self._hooks.values() for f in fs)

    @contextlib.contextmanager
    def forward(self, rows: Rows) -> Iterator[None]:
        previous, self.rows = self.rows, rows
        self._forwards += 1
        try:
            yield
        finally:
            self.rows = previous

    @contextlib.contextmanager
    def installed(self, interventions: Sequence[tuple[str, Hook]]) -> Iterator[None]:
        """Register (name, hook) pairs for the duration of a job, then remove exactly those.

        Leaving normally after a kernel forward (one run under `forward(rows)`) in which some installed hook
        never ran is an error: that steering or capture silently did nothing.
        """
        added: list[tuple[str, Hook]] = []
        forwards = self._forwards
        try:
            for name, fn in interventions:
                added.append((name, self.add(name, fn)))
            runs = {name: self._runs.get(name, 0) for name, _ in added}
            yield
        finally:
            for name, fn in added:
                self.remove(name, fn)
        idle = [name for name, n in runs.items() if self._runs.get(name, 0) == n]
        if idle and self._forwards > forwards:
            raise HookError(
                f"hook {idle[0]} never ran although the {self.arch} model ran forward: its forward calls the "
                "decoder blocks' parts directly (or skips that block), so steering and capture cannot work on it"
            )

    def run(self, name: str, x: mx.array, layer: int) -> mx.array:
        fns = self._hooks.get(name)
        if not fns:
            return x
        self._runs[name] = self._runs.get(name, 0) + 1
        if x.ndim != 3:
            raise HookError(
                f"{name}: the {self.arch} model's residual stream has shape {tuple(x.shape)}, not "
                "[batch, seq, hidden]: steering and capture do not support this architecture"
            )
        ctx = HookContext(name, layer, self.rows)
        for fn in fns:
            x = fn(x, ctx)
        return x


_HOOKED: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    if cls not in _HOOKED:

        def __call__(self, *args: Any, **kwargs: Any):
            hooks: HookManager = self._orchard_hooks
            layer = self._orchard_layer
            if not hooks.active:
                return cls.__call__(self, *args, **kwargs)
            if args:
                args = (hooks.run(f"resid_pre.{layer}", args[0], layer), *args[1:])
            else:  # blocks called with keywords only
                key = next(iter(kwargs))
                kwargs[key] = hooks.run(f"resid_pre.{layer}", kwargs[key], layer)
            out = cls.__call__(self, *args, **kwargs)
            if isinstance(out, tuple):  # blocks that also return e.g. router logits
                return (hooks.run(f"resid_post.{layer}", out[0], layer), *out[1:])
            return hooks.run(f"resid_post.{layer}", out, layer)

        _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_block": True})
    return _HOOKED[cls]


def decoder_layers(model) -> list:
    """The list of decoder blocks: mlx-lm models expose it as `model.layers` (gpt2: `model.model.h`)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{type(model).__name__} exposes no list of decoder layers: cannot instrument it")
    return layers


def architecture(model) -> str:
    """The model's architecture name (mlx-lm's model_type, else its module's name), for error messages."""
    name = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    return str(name or type(model).__module__.rpartition(".")[2])


def instrument(model) -> HookManager:
    """Make every decoder block hookable, in place; idempotent. Returns the model's hook manager."""
    existing = getattr(model, "_orchard_hooks", None)
    if existing is not None:
        return existing
    layers = decoder_layers(model)
    hooks = HookManager(len(layers), architecture(model))
    for i, block in enumerate(layers):
        if not getattr(block, "_orchard_block", False):
            block.__class__ = _hooked_class(type(block))
        block._orchard_layer = i
        block._orchard_hooks = hooks
    model._orchard_hooks = hooks
    return hooks


# --- capture -------------------------------------------------------------------------------------


class Capture:
    """Record the residual stream; returns x unchanged.

    positions: "last" (each row's last real token: one [B, D] record per forward), "all" (each row's real
    tokens: a list of [n_real, D] arrays per forward), or explicit real-token indices (a [B, K, D] record).
    """

    def __init__(self, positions: str | Sequence[int] = "last") -> None:
        if isinstance(positions, str) and positions not in ("last", "all"):
            raise ValueError(f"capture positions must be 'last', 'all' or a list of indices, not {positions!r}")
        self.positions = positions
        self.records: list[Any] = []

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        B, S, _ = x.shape
        rows = ctx.rows
        if self.positions == "last":
            ends = rows.ends if rows.ends is not None else mx.full((B,), rows.offset + S)
            at = mx.clip(ends - 1 - rows.offset, 0, S - 1).astype(mx.int32)
            self.records.append(mx.take_along_axis(x, at[:, None, None], axis=1)[:, 0, :])
        elif self.positions == "all":
            real = rows.mask("all", B, S)
            mx.eval(real)
            keep = [mx.array([j for j, r in enumerate(row) if r]) for row in real.tolist()]
            self.records.append([x[b][k] if k.size else x[b][:0] for b, k in enumerate(keep)])
        else:
            starts = rows.starts if rows.starts is not None else mx.zeros((B,), mx.int32)
            at = starts[:, None] + mx.array(list(self.positions))[None, :] - rows.offset
            self.records.append(mx.take_along_axis(x, at[..., None].astype(mx.int32), axis=1))
        return x
