"""`instrument(model)`: swap each decoder block's class (and its branch modules' and output projection's) for a
subclass whose `__call__` runs the hooks around the original one, and record per layer which hook points the
blocks lack (`HookManager.missing`).

The block stays the same object, so attribute reads (`use_sliding`, ...), any call signature and the parameter
tree (weight names, LoRA, quantization) are untouched. With nothing registered the block's own output array is
returned as is: the instrumented model is bitwise the plain model. `resid_mid` is edited through the attention
branch: the branch returns what makes the block's own `x + attn_out` the edited resid_mid.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx

from ..spec import family_gaps, parallel_block, parallel_gap
from .branches import Branches, branches
from .manager import HOOK_POINTS, HookManager

# What blocks name the residual stream among their arguments (talkie's blocks take the embedding skip first).
HIDDEN_ARGS = ("x", "h", "hidden_states", "hidden_state", "inputs")

_HOOKED: dict[type, type] = {}


def _hidden_arg(cls: type) -> tuple[int, str | None]:
    """(position, name) of the residual stream among `cls.__call__`'s arguments: the first named as such, else the first."""
    try:
        names = [p.name for p in inspect.signature(cls.__call__).parameters.values()][1:]
    except (TypeError, ValueError):
        return 0, None
    for i, name in enumerate(names):
        if name in HIDDEN_ARGS:
            return i, name
    return 0, names[0] if names else None


def _hooked_class(cls: type) -> type:
    if cls not in _HOOKED:
        at, name = _hidden_arg(cls)

        def __call__(self, *args: Any, **kwargs: Any):
            hooks: HookManager = self._orchard_hooks
            layer = self._orchard_layer
            if not hooks.active:
                return cls.__call__(self, *args, **kwargs)
            if at < len(args):
                x = hooks.run(f"resid_pre.{layer}", args[at], layer)
                args = (*args[:at], x, *args[at + 1 :])
            else:  # called with the residual stream as a keyword
                key = name if name in kwargs else next(iter(kwargs))
                x = kwargs[key] = hooks.run(f"resid_pre.{layer}", kwargs[key], layer)
            hooks.block_inputs[layer] = x
            try:
                out = cls.__call__(self, *args, **kwargs)
            finally:
                hooks.block_inputs.pop(layer, None)
            if isinstance(out, tuple):  # blocks that also return e.g. router logits
                return (hooks.run(f"resid_post.{layer}", out[0], layer), *out[1:])
            return hooks.run(f"resid_post.{layer}", out, layer)

        _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_block": True})
    return _HOOKED[cls]


def _edit_branch(module, y: mx.array) -> mx.array:
    """The branch output `y` after the `point` hooks and, for attention, the resid_mid hooks (as a delta)."""
    hooks: HookManager = module._orchard_hooks
    point, layer, scale = module._orchard_point, module._orchard_layer, module._orchard_scale
    y = hooks.run(f"{point}.{layer}", y, layer)
    mid = f"resid_mid.{layer}"
    if point != "attn_out" or mid not in hooks._hooks:
        return y
    x = hooks.block_inputs.get(layer)
    if x is None:  # the branch ran outside its block's call: resid_mid unknown, so its hook never runs
        return y
    h = x + y if scale is None else x + y * scale  # exactly the block's own `x + attn_out` (granite: `* multiplier`)
    edited = hooks.run(mid, h, layer)
    if edited is h:
        return y
    return edited - x if scale is None else (edited - x) / scale


_BRANCHES: dict[type, type] = {}


def _hooked_branch(cls: type) -> type:
    if cls not in _BRANCHES:

        def __call__(self, *args: Any, **kwargs: Any):
            out = cls.__call__(self, *args, **kwargs)
            if not self._orchard_hooks.active:
                return out
            if isinstance(out, tuple):  # (output, attention weights / cache / router logits)
                return (_edit_branch(self, out[0]), *out[1:])
            return _edit_branch(self, out)

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


def _swap(module, hooked: Any, flag: str, **attributes: Any) -> None:
    if not getattr(module, flag, False):
        module.__class__ = hooked(type(module))
    for key, value in attributes.items():
        setattr(module, f"_orchard_{key}", value)


def _instrument_block(block, layer: int, hooks: HookManager) -> Branches:
    _swap(block, _hooked_class, "_orchard_block", layer=layer, hooks=hooks)
    found = branches(block)
    for point, module in (("attn_out", found.attn), ("mlp_out", found.mlp)):
        if module is not None:
            _swap(module, _hooked_branch, "_orchard_branch", point=point, layer=layer, hooks=hooks, scale=found.scale)
    if found.projection is not None:
        _swap(found.projection, _hooked_projection, "_orchard_projection", layer=layer, hooks=hooks)
    return found


def _gaps(found: Branches) -> dict[str, str]:
    """{site: what the block has instead} for the sites inside one block that it lacks."""
    why = dict(found.why or {})
    if found.attn is None:
        why.setdefault("attn_head", why["attn_out"])
        why.setdefault("resid_mid", f"resid_mid follows an attention branch: {why['attn_out']}")
    elif found.mlp is None:
        why.setdefault("resid_mid", f"resid_mid lies before an MLP branch: {why['mlp_out']}")
    return why


def _missing(arch: str, per_layer: list[dict[str, str]]) -> dict[str, str]:
    """The manager's `missing`: a site lacking at every layer keyed by kind, else by name naming the layers with it."""
    missing = {}
    for point in HOOK_POINTS:
        lacking = [i for i, why in enumerate(per_layer) if point in why]
        if len(lacking) == len(per_layer):
            reasons = dict.fromkeys(why[point] for why in per_layer)  # hybrids: each kind of block says its own
            missing[point] = f"the {arch} block has no {point}: {'; or '.join(reasons)}"
            continue
        having = ", ".join(str(i) for i in range(len(per_layer)) if i not in lacking)
        for i in lacking:
            missing[f"{point}.{i}"] = f"the {arch} block at layer {i} has no {point} ({per_layer[i][point]}); layers with one: {having}"
    return missing


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
    per_layer = [_gaps(_instrument_block(block, i, hooks)) for i, block in enumerate(layers)]
    hooks.missing = _missing(hooks.arch, per_layer)
    if parallel_block(hooks.arch, getattr(layers[0], "use_parallel_residual", False)) and "resid_mid" not in hooks.missing:
        hooks.missing["resid_mid"] = parallel_gap(hooks.arch)
    gaps = family_gaps(hooks.arch)
    hooks.missing = {k: v for k, v in hooks.missing.items() if k.rpartition(".")[0] not in gaps} | gaps
    model._orchard_hooks = hooks
    return hooks
