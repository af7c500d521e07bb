"""Pipeline split, generic over every family Orchard instruments: each rank keeps a contiguous range of decoder
blocks (their GLOBAL layer indices stay: hooks, steering and capture name layers as the whole model does).

The first local block takes the hidden state from the rank before (recv), the last local block sends its output
to the rank after. Two ways on from there:
- lockstep (every kernel by default): every rank keeps the LAST stage's output of an all_gather, so every rank
  ends the body with the same hidden state and every kernel after the forward agrees across ranks (each hand-over
  evaluated as it is built, so transfers keep program order: `_handoff`);
- pipelined (inside `passing(model, pipe)`: worker.split.stages runs the schedule): no send and no gather in the
  blocks; the first local block reads its input from a lazy `recv_like` (kept on `pipe.received`) and the last
  one leaves its output on `pipe.out`, and the stages loop evaluates the receive, the layers and the send as
  steps of its own, so each rank works on another micro-batch.
Embeddings, the final norm and the head stay on every rank (the fixed overhead of a pipeline rank).

Conditional steering (worker.hooks.condition) decides each row at its condition layers, perhaps on a rank before the
one that owns the steered layer: on a forward that decides rows, what the conditions said so far travels with the
hidden state, as extra columns of the array handed over (`_Relay`), to the next rank, which adds its own probes'
findings and hands them on. The last rank records the decisions after its last layer (it answers pipelined jobs);
in lockstep every rank does, from the last stage's columns that the all_gather brings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..hooks import decoder_layers
from ..hooks.condition import conditional_gates, deciding, relay, settle, take
from .plan import head_layers, layer_ranges

_STAGED: dict[type, type] = {}


@dataclass
class Pipe:
    """A pipelined forward's hand-over points on this rank: the lazy receive its first block read (ranks > 0) and
    the output of its last block (ranks before the last), for the stages loop to evaluate and send."""

    received: mx.array | None = None
    out: mx.array | None = None


def _with_input(args: tuple, kwargs: dict, x: mx.array) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    key = next(iter(kwargs))
    return args, {**kwargs, key: x}


@dataclass
class _Relay:
    """The conditional gates deciding rows on this forward (the same on every rank: host facts), whose findings
    travel beside the hidden state as `width` extra columns (none: the array handed over is the hidden state)."""

    rows: Any = None
    gates: list = field(default_factory=list)

    @classmethod
    def of(cls, block: Any, x: mx.array) -> "_Relay":
        hooks = block._orchard_hooks
        return cls(hooks.rows, deciding(conditional_gates(hooks), hooks.rows, x.shape[1]) if hooks.active else [])

    @property
    def width(self) -> int:
        return sum(len(g.spec.conditions) for g in self.gates)

    def like(self, x: mx.array) -> mx.array:
        """What the rank before hands over for a block input shaped as `x`."""
        return x if not self.gates else mx.zeros((*x.shape[:-1], x.shape[-1] + self.width), x.dtype)

    def pack(self, h: mx.array) -> mx.array:
        if not self.gates:
            return h
        found = mx.broadcast_to(relay(self.gates, self.rows, h.shape[0])[:, None, :], (*h.shape[:-1], self.width))
        return mx.concatenate([h, found.astype(h.dtype)], axis=-1)

    def unpack(self, packed: mx.array) -> mx.array:
        """The hidden state; the conditions' findings join this rank's gates."""
        if not self.gates:
            return packed
        take(self.gates, self.rows, packed[:, 0, -self.width :])
        return packed[..., : -self.width]


def _handoff(self, h: mx.array, relayed: _Relay) -> mx.array:
    """Send this stage's output on, then every rank takes the last stage's output (all_gather).

    Evaluated here, as the forward is built: a kernel may build several forwards before it evaluates them (a
    generation batch merges the prefills of several prompt families), and one evaluation of them all orders the
    receives, sends and gathers of different forwards as each rank's graph happens to (they differ by rank), which
    pairs one forward's transfer with another's. Built and evaluated one at a time, they happen in program order,
    the same on every rank."""
    group, rank, size = self._orchard_group, self._orchard_group.rank(), self._orchard_group.size()
    h = relayed.pack(h)
    if rank < size - 1:
        h = mx.distributed.send(h, rank + 1, group=group)
    batch = h.shape[0]
    gathered = mx.distributed.all_gather(h, group=group)[(size - 1) * batch : size * batch]
    mx.eval(gathered)
    last = relayed.unpack(gathered)
    settle(relayed.gates)  # every rank now knows the decisions (lockstep kernels agree across ranks)
    return last


def _staged_class(cls: type) -> type:
    """A block class that receives its input from the previous rank (first local block) and/or hands its output
    on (last local block) around the block's own (instrumented) call."""
    if cls not in _STAGED:

        def __call__(self, *args: Any, **kwargs: Any):
            if not (self._orchard_receives or self._orchard_sends):  # a block inside the rank's range
                return cls.__call__(self, *args, **kwargs)
            group, pipe = self._orchard_group, self._orchard_pipe
            x = args[0] if args else next(iter(kwargs.values()))
            relayed = _Relay.of(self, x)
            if self._orchard_receives:
                received = mx.distributed.recv_like(relayed.like(x), group.rank() - 1, group=group)  # shape and dtype only
                if pipe is not None:
                    pipe.received = received
                args, kwargs = _with_input(args, kwargs, relayed.unpack(received))
            out = cls.__call__(self, *args, **kwargs)
            if not self._orchard_sends:
                return out
            if pipe is not None:  # pipelined: the stages loop sends (ranks before the last); no gather
                h = out[0] if isinstance(out, tuple) else out
                if group.rank() < group.size() - 1:
                    pipe.out = relayed.pack(h)
                else:  # the answering rank: every condition layer has run
                    pipe.out = h
                    settle(relayed.gates)
                return out
            if isinstance(out, tuple):  # blocks that also return e.g. router logits
                return (_handoff(self, out[0], relayed), *out[1:])
            return _handoff(self, out, relayed)

        _STAGED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "_orchard_stage": True})
    return _STAGED[cls]


def _same(value: Any, blocks: list) -> bool:
    return isinstance(value, list) and len(value) == len(blocks) and all(a is b for a, b in zip(value, blocks))


def _holder(model: Any, blocks: list) -> tuple[Any, str]:
    """(module, key) holding the list of decoder blocks (a property such as `layers` may return a copy)."""
    for module in (getattr(model, "model", None), model):
        entries = module.items() if isinstance(module, dict) else ()  # an nn.Module keeps its children as items
        for name, value in entries:
            if _same(value, blocks):
                return module, name
    raise ValueError(f"{type(model).__name__}: cannot find the list holding its decoder blocks to split it")


def unsplittable(model: Any) -> str | None:
    """Why `split` could not cut this model's blocks (None if it can): asked of a weightless skeleton before Ray."""
    try:
        _holder(model, decoder_layers(model))
    except ValueError as e:  # no list of blocks (decoder_layers), or none that the model holds (_holder)
        return str(e)
    return None


def _local_indices(inner: Any, kept: list) -> None:
    """Families that index the cache list by a layer kind (llama: fa_idx, swa_idx) index the LOCAL list now."""
    if isinstance(getattr(inner, "fa_idx", None), int):
        inner.fa_idx = next((i for i, b in enumerate(kept) if not getattr(b, "use_sliding", False)), 0)
    if isinstance(getattr(inner, "swa_idx", None), int):
        inner.swa_idx = next((i for i, b in enumerate(kept) if getattr(b, "use_sliding", False)), None)


def split(model: Any, group: "mx.distributed.Group", config: dict | None = None) -> tuple[int, int]:
    """Keep this rank's blocks of an instrumented model (in place); returns its global [start, end). The ranges
    count the vocabulary head on the last rank (worker.split.plan.head_layers of the model's config)."""
    blocks = decoder_layers(model)
    start, end = layer_ranges(len(blocks), group.size(), head=head_layers(config or {}))[group.rank()]
    holder, name = _holder(model, blocks)
    kept = blocks[start:end]
    setattr(holder, name, kept)
    _local_indices(holder, kept)
    for i, block in enumerate(kept):
        if not getattr(block, "_orchard_stage", False):
            block.__class__ = _staged_class(type(block))
        block._orchard_group = group
        block._orchard_receives = i == 0 and group.rank() > 0
        block._orchard_sends = i == len(kept) - 1
        block._orchard_pipe = None
    return start, end


@contextlib.contextmanager
def passing(model: Any, pipe: Pipe) -> Iterator[Pipe]:
    """Inside, a split model's forwards hand over through `pipe` (pipelined) instead of send + all_gather; the
    same ops otherwise, so the last rank's numbers are the lockstep ones."""
    blocks = [b for b in decoder_layers(model) if getattr(b, "_orchard_stage", False)]
    for block in blocks:
        block._orchard_pipe = pipe
    try:
        yield pipe
    finally:
        for block in blocks:
            block._orchard_pipe = None
