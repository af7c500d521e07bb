"""A shared prefix for conditional (CAST) loglikelihood jobs: computed twice, once plain and once steered, not per row.

Below the steered layer a prefix's KV is the same whether its row fires or not (condition layers never come after
the steered layer: worker.spec); above it a fired row's KV is the unconditionally steered prefix's and a quiet
row's the plain prefix's. So each family's prefix runs twice (batch 1): plain, with the probes keeping the sum of
the prefix's hidden states at each condition layer (`pool: mean` adds it to the suffix's; `pool: last` reads the
last prompt token, which a shared prefix never holds: worker.score stops it before the first scored position),
then steered. Each row's suffix forward decides the row on the way up and, at every layer whose two prefix KVs
differ, reads the one its decision picks (`Chosen`): the same numbers as running each row's whole prompt.
One conditional intervention per job shares (with two, a row's KV would depend on which of them fired).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .condition import Gate, WhenFired


def conditional_gates(hooks: Any) -> list[Gate]:
    """The gates of the conditional interventions installed on `hooks` (a HookManager), each once."""
    out: list[Gate] = []
    for fns in hooks._hooks.values():
        out += [f.gate for f in fns if isinstance(f, WhenFired) and f.gate not in out]
    return out


def shared_prefix(gate: Gate, run_prefix: Callable[[], list | None]) -> list | None:
    """The family's prefix cache for a conditional job: per layer the plain KVCache, or a `Chosen` pair where the
    steered prefix's KV differs from the plain one. `run_prefix()` runs the prefix into a fresh cache (or None)."""
    gate.forced, gate.recording = False, True
    try:
        plain = run_prefix()
        gate.recording, gate.forced = False, True
        fired = run_prefix() if plain is not None else None
    finally:
        gate.forced, gate.recording = None, False
    if plain is None:
        return None
    same = [mx.array_equal(p.keys, f.keys) & mx.array_equal(p.values, f.values) for p, f in zip(plain, fired)]
    mx.eval(same)
    return [p if s.item() else Chosen(p, f, gate) for p, f, s in zip(plain, fired, same)]


class Chosen:
    """One layer's prefix KV in two versions (plain, steered), picked per row by the gate's decision."""

    def __init__(self, plain: Any, fired: Any, gate: Gate) -> None:
        self.plain, self.fired, self.gate = plain, fired, gate

    def broadcast(self, batch: int) -> Any:
        return ChosenCache(self, batch)


def _kv(c: Any) -> tuple[mx.array, mx.array]:
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


class ChosenCache(KVCache):
    """A batch's KVCache whose prefix part is each row's pick, made when the layer first reads it (by then the
    probes below and the steered layer have decided this forward's rows)."""

    def __init__(self, pair: Chosen, batch: int) -> None:
        super().__init__()
        self.pair, self.batch = pair, batch
        self.offset = pair.plain.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            fired = self.pair.gate.current()[:, None, None, None]
            (pk, pv), (fk, fv) = _kv(self.pair.plain), _kv(self.pair.fired)
            shape = (self.batch, *pk.shape[1:])
            self.keys = mx.broadcast_to(mx.where(fired, fk, pk), shape)
            self.values = mx.broadcast_to(mx.where(fired, fv, pv), shape)
        return super().update_and_fetch(keys, values)
