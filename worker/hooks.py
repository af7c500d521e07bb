"""Hook points of mlx-lm decoder blocks: the residual stream `resid_pre.{L}`, `resid_mid.{L}`, `resid_post.{L}`,
the branch outputs `attn_out.{L}`, `mlp_out.{L}` (what each branch adds to the residual stream) and the heads'
outputs `attn_head.{L}` (the input of the attention's output projection, [batch, seq, heads*head_dim]).

`instrument(model)` swaps each decoder block's class for a subclass whose `__call__` runs the hooks around
the original one. The block stays the same object, so attribute reads (`use_sliding`, ...), any call
signature and the parameter tree (weight names, LoRA, quantization) are untouched. With nothing registered
the block's own output array is returned as is: the instrumented model is bitwise the plain model.
Branch points swap the class of the module whose output the block adds to the residual (the attention / MLP
module, or the post-branch norm in families that have one, e.g. gemma2/3, olmo2); `resid_mid` is edited
through the attention branch: the branch returns edited(x + attn_out) - x, which the block adds back to x.

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

from .spec import parallel_block

POSITIONS = ("all", "prompt", "continuation", "last")
HOOK_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head")
# What each family names its branches, and the norms applied to a branch's output before the residual add.
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn", "mlp_block")
# What blocks that normalise the MLP branch's output before adding it name that norm.
POST_MLP_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm")
# What the attention module names its output projection, whose input is the heads' outputs side by side.
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


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
        self.missing: dict[str, str] = {}  # hook point kind -> why this model's blocks lack it
        self.block_inputs: dict[int, mx.array] = {}  # per layer, while a hooked block runs: its (edited) input
        # The layers whose blocks this process runs (a pipeline rank: its share). Hooks of other layers are kept
        # (so every rank of a group agrees on what is installed) but never run here, so only these can be idle.
        self.owned = range(n_layers)
        self.group: Any = None  # the mx.distributed ring of a split model: idle hooks are counted across it

    def check_name(self, name: str) -> None:
        point, _, layer = name.rpartition(".")
        if point not in HOOK_POINTS or not layer.isdigit() or not 0 <= int(layer) < self.n_layers:
            raise ValueError(
                f"unknown hook point {name!r}: use {', '.join(p + '.L' for p in HOOK_POINTS)} with 0 <= L < {self.n_layers}"
            )
        if point in self.missing:
            raise HookError(f"{name}: the {self.arch} block has no {point}: {self.missing[point]}")

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
        idle = [name for name, n in runs.items() if self._runs.get(name, 0) == n and self.owns(name)]
        if self.group is not None and runs and self._forwards > forwards:  # the same on every rank: lockstep
            idle = _idle_anywhere(self.group, list(runs), idle)
        if idle and self._forwards > forwards:
            raise HookError(
                f"hook {idle[0]} never ran although the {self.arch} model ran forward: its forward calls the "
                "decoder blocks' parts directly (or skips that block), so steering and capture cannot work on it"
            )

    def owns(self, name: str) -> bool:
        return int(name.rpartition(".")[2]) in self.owned

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


def _idle_anywhere(group: Any, names: list[str], idle: list[str]) -> list[str]:
    """The hooks idle on the rank that owns them, known to every rank of a group (one small all_sum)."""
    flags = mx.distributed.all_sum(mx.array([float(name in idle) for name in names]), group=group)
    return [name for name, flag in zip(names, flags.tolist()) if flag > 0]


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
                hooks.block_inputs[layer] = args[0]
            else:  # blocks called with keywords only
                key = next(iter(kwargs))
                kwargs[key] = hooks.run(f"resid_pre.{layer}", kwargs[key], layer)
                hooks.block_inputs[layer] = kwargs[key]
            try:
                out = cls.__call__(self, *args, **kwargs)
            finally:
                hooks.block_inputs.pop(layer, None)
            if isinstance(out, tuple):  # blocks that also return e.g. router logits
                return (hooks.run(f"resid_post.{layer}", out[0], layer), *out[1:])
            return hooks.run(f"resid_post.{layer}", out, layer)

        _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_block": True})
    return _HOOKED[cls]


def _edit_branch(hooks: HookManager, point: str, layer: int, y: mx.array) -> mx.array:
    """The branch output `y` after the `point` hooks and, for attention, the resid_mid hooks (as a delta)."""
    y = hooks.run(f"{point}.{layer}", y, layer)
    mid = f"resid_mid.{layer}"
    if point != "attn_out" or mid not in hooks._hooks:
        return y
    x = hooks.block_inputs.get(layer)
    if x is None:  # the branch ran outside its block's call: resid_mid unknown, so its hook never runs
        return y
    h = x + y  # exactly the block's own `x + attn_out`
    edited = hooks.run(mid, h, layer)
    return y if edited is h else edited - x


_BRANCHES: dict[type, type] = {}


def _hooked_branch(cls: type) -> type:
    if cls not in _BRANCHES:

        def __call__(self, *args: Any, **kwargs: Any):
            out = cls.__call__(self, *args, **kwargs)
            hooks: HookManager = self._orchard_hooks
            if not hooks.active:
                return out
            point, layer = self._orchard_point, self._orchard_layer
            if isinstance(out, tuple):  # (output, attention weights / cache / router logits)
                return (_edit_branch(hooks, point, layer, out[0]), *out[1:])
            return _edit_branch(hooks, point, layer, out)

        _BRANCHES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_branch": True})
    return _BRANCHES[cls]


_PROJECTIONS: dict[type, type] = {}


def _hooked_projection(cls: type) -> type:
    """The output projection's class, running the `attn_head` hooks on its input (the heads' outputs)."""
    if cls not in _PROJECTIONS:

        def __call__(self, x, *args: Any, **kwargs: Any):
            hooks: HookManager = self._orchard_hooks
            if hooks.active:
                x = hooks.run(f"attn_head.{self._orchard_layer}", x, self._orchard_layer)
            return cls.__call__(self, x, *args, **kwargs)

        _PROJECTIONS[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_projection": True})
    return _PROJECTIONS[cls]


def _instrument_heads(block, layer: int, hooks: HookManager) -> None:
    attention = next((getattr(block, n) for n in ATTENTION_NAMES if callable(getattr(block, n, None))), None)
    projection = next((getattr(attention, n) for n in OUTPUT_PROJECTIONS if callable(getattr(attention, n, None))), None)
    if projection is None:
        where = "no attention module" if attention is None else f"no output projection ({' / '.join(OUTPUT_PROJECTIONS)}) in their attention"
        hooks.missing.setdefault("attn_head", f"its blocks expose {where}, so single heads cannot be reached")
        return
    if not getattr(projection, "_orchard_projection", False):
        projection.__class__ = _hooked_projection(type(projection))
    projection._orchard_layer, projection._orchard_hooks = layer, hooks


def _branch_modules(block) -> dict[str, Any]:
    """{"attn_out": module, "mlp_out": module} whose outputs the block adds to its residual stream."""
    def first(names):
        return next((getattr(block, n) for n in names if callable(getattr(block, n, None))), None)

    found = {"attn_out": first(ATTENTION_NAMES), "mlp_out": first(MLP_NAMES)}
    post_mlp = first(POST_MLP_NORMS)
    if post_mlp is None:
        return found
    # post-branch norms (gemma2/3, olmo2, afmoe, glm4): their outputs are what the block adds. The attention's is
    # `post_self_attn_layernorm`, else `post_attention_layernorm` (glm4's is its pre-MLP norm: it has the former)
    post_attn = first(("post_self_attn_layernorm", "post_attention_layernorm"))
    found["mlp_out"] = post_mlp if found["mlp_out"] is not None else None
    found["attn_out"] = post_attn if found["attn_out"] is not None and post_attn is not None else None
    return found


def _instrument_branches(block, layer: int, hooks: HookManager) -> None:
    for point, module in _branch_modules(block).items():
        if module is None:
            hooks.missing.setdefault(point, f"its blocks expose no {' / '.join(ATTENTION_NAMES if point == 'attn_out' else MLP_NAMES)} module")
            continue
        if not getattr(module, "_orchard_branch", False):
            module.__class__ = _hooked_branch(type(module))
        module._orchard_point, module._orchard_layer, module._orchard_hooks = point, layer, hooks


def _parallel(model, block) -> bool:
    return parallel_block(architecture(model), getattr(block, "use_parallel_residual", False))


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
        _instrument_branches(block, i, hooks)
        _instrument_heads(block, i, hooks)
    if "attn_out" in hooks.missing:
        hooks.missing["resid_mid"] = "resid_mid is edited through the attention branch, which its blocks do not expose"
    elif _parallel(model, layers[0]):
        hooks.missing["resid_mid"] = "it runs attention and MLP in parallel on the same input; steer attn_out or mlp_out"
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
