"""A shared prefix under conditional (CAST) steering: computed once per combination of decisions, not once per row.

Below a steered layer a prefix's KV is the same whether its row fires or not (condition layers never come after the
steered layer: worker.spec); above it a fired row's KV is the steered prefix's and a quiet row's the plain one's.
With G conditional interventions a row's KV depends on which of them fired, so the prefix runs 2^G times (batch 1),
variant v with intervention g forced on where bit g of v is set and off elsewhere; the probes keep each variant's
sum of the prefix's hidden states at every condition layer (`pool: mean` adds it to the suffix's; `pool: last`
reads the last prompt token, which a shared prefix never holds). A row's decisions are made on the way up through
its own suffix, inside the same lazy forward, so which combinations occur is not known before the prefix must be
ready: every one is computed (MAX_GATES caps that; past it each row runs its whole prompt).

Each suffix forward then reads, at every layer where the variants' KVs differ, the one its row's decisions pick
(`Chosen`: only the interventions whose steering reaches that layer matter there, and they are decided below it),
and each probe adds the prefix sum its row's earlier decisions pick: the same numbers as running each row's whole
prompt. Loglikelihood (worker.score) and generation (worker.generate) share prefixes so, lockstep or pipelined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .condition import Gate, conditional_gates

__all__ = ["MAX_GATES", "Chosen", "ChosenCache", "Picked", "SharedPrefix", "broadcast_kv", "conditional_gates", "shareable", "shared_prefix"]

MAX_GATES = 3  # conditional interventions whose prefixes are shared: 2^3 = 8 prefix passes per family at most


class SharedPrefix:
    """One family's prefix under `gates`: its KV cache per variant (filled by `run`), the probes' sums per variant,
    its length; `broadcast`/`batched` hand each suffix forward the per-row picks."""

    def __init__(self, gates: list[Gate], length: int, variants: list | None = None) -> None:
        self.gates, self.length = gates, length
        self.count = 1 << len(gates)
        self.variants: list = variants if variants is not None else [None] * self.count
        self._sums: dict[Any, list[mx.array | None]] = {}  # probe -> its sum in each variant
        self._picks: dict[Any, Callable[[], mx.array]] = {}  # probe -> its per-row pick, built on first use
        self._layers: list | None = None
        self._running: int | None = None  # the variant whose pass runs now

    def run(self, v: int, body: Callable[[], Any]) -> Any:
        """`body()` (a prefix pass) with intervention g forced on iff bit g of `v` is set; the probes keep its sums."""
        for g, gate in enumerate(self.gates):
            gate.forced, gate.prefix = bool(v >> g & 1), self
        self._running = v
        try:
            return body()
        finally:
            self._running = None
            for gate in self.gates:
                gate.forced, gate.prefix = None, None

    def keep(self, probe: Any, total: mx.array) -> None:
        self._sums.setdefault(probe, [None] * self.count)[self._running] = total

    def summed(self, probe: Any) -> mx.array:
        """[B or 1, hidden]: the prefix's sum of hidden states at `probe`'s layer, in the variant each row picks."""
        if probe not in self._picks:
            sums = self._sums[probe]
            self._picks[probe] = _picker(sums, self.gates, _differs(sums, self.gates))
        return self._picks[probe]()

    @contextlib.contextmanager
    def continued(self) -> Iterator[None]:
        """Forwards inside continue this prefix: the probes add its sums, its length is where they start."""
        for gate in self.gates:
            gate.prefix = self
        try:
            yield
        finally:
            for gate in self.gates:
                gate.prefix = None

    def layers(self) -> list:
        """Per layer: the prefix's KVCache where every variant's is the same, else a `Chosen` (one host sync, once)."""
        if self._layers is None:
            per_layer = [[v[i] for v in self.variants] for i in range(len(self.variants[0]))]
            found = _differences([_held(caches, part) for caches in per_layer for part in ("keys", "values")], self.gates)
            self._layers = [_layer(caches, self.gates, k | v) for caches, k, v in zip(per_layer, found[::2], found[1::2])]
        return self._layers

    def cascaded(self) -> list:
        """Per layer the prefix's KVCache, or its variants to pick among per row (worker.cascade reads each once)."""
        return [c.picked() if isinstance(c, Chosen) else c for c in self.layers()]

    def broadcast(self, batch: int) -> list:
        """Per layer a KVCache for a batch of `batch` suffixes (worker.score)."""
        return [c.broadcast(batch) if isinstance(c, Chosen) else broadcast_kv(c, batch) for c in self.layers()]


def shareable(gates: list[Gate]) -> bool:
    """Whether a job under these conditional interventions shares its families' prefixes (2^G passes each)."""
    return len(gates) <= MAX_GATES


def shared_prefix(gates: list[Gate], run_prefix: Callable[[], list | None]) -> SharedPrefix | None:
    """A family's prefix for a conditional job, each variant run now by `run_prefix()` into a fresh cache; None
    when it cannot be shared (too many conditional interventions, or a model whose caches cannot share)."""
    if not shareable(gates):
        return None
    shared = SharedPrefix(gates, 0)
    for v in range(shared.count):
        shared.variants[v] = shared.run(v, run_prefix)
        if shared.variants[v] is None:
            return None
    shared.length = shared.variants[0][0].offset
    return shared


def _differs(arrays: list[mx.array], gates: list[Gate]) -> set[int]:
    """The interventions whose decision changes `arrays` (one per variant): those a row's pick must read."""
    return _differences([arrays], gates)[0]


def _differences(many: list[list[mx.array]], gates: list[Gate]) -> list[set[int]]:
    """`_differs` of each list of `many`, in one host sync."""
    pairs = [(g, v) for g in range(len(gates)) for v in range(1 << len(gates)) if not v >> g & 1]
    same = [[mx.array_equal(arrays[v], arrays[v | 1 << g]) for g, v in pairs] for arrays in many]
    mx.eval(same)
    return [{g for (g, _), s in zip(pairs, row) if not s.item()} for row in same]


def _held(caches: list, part: str) -> list[mx.array]:
    """Each variant's cache's keys or values (`part`), its filled positions only."""
    return [getattr(c, part)[..., : c.offset, :] for c in caches]


def _variants(items: list, relevant: set[int]) -> list:
    """`items` (one per variant) in the order of the index `_index` gives over the `relevant` interventions."""
    bits = sorted(relevant)
    return [items[sum((j >> i & 1) << g for i, g in enumerate(bits))] for j in range(1 << len(bits))]


def _index(gates: list[Gate], relevant: set[int]) -> Callable[[], mx.array]:
    """A function giving, per row of the forward now running, [B] int32: which of `_variants` its decisions pick
    among the `relevant` interventions (decided by then: their steering reaches what the variants hold)."""
    bits = sorted(relevant)
    return lambda: sum(gates[g].current().astype(mx.int32) * (1 << i) for i, g in enumerate(bits))


def _picker(arrays: list[mx.array], gates: list[Gate], relevant: set[int]) -> Callable[[], mx.array]:
    """A function giving, per row of the forward now running, `arrays[v]` (leading dim 1) for the variant v its
    decisions pick among the `relevant` interventions."""
    if not relevant:
        return lambda: arrays[0]
    table, index = mx.concatenate(_variants(arrays, relevant)), _index(gates, relevant)
    return lambda: mx.take(table, index(), axis=0)


def _layer(caches: list, gates: list[Gate], relevant: set[int]) -> Any:
    """One layer's prefix KV in every variant: the plain cache if no decision changes it, else a `Chosen`."""
    if not relevant:
        return caches[0]
    keys, values = _held(caches, "keys"), _held(caches, "values")
    return Chosen(_picker(keys, gates, relevant), _picker(values, gates, relevant), caches[0].offset,
                  _variants(caches, relevant), _index(gates, relevant))  # fmt: skip


def broadcast_kv(c: Any, batch: int) -> KVCache:
    """A KVCache for `batch` rows that all start with the batch-1 cache `c`'s keys and values (one copy, broadcast)."""
    k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    fresh = KVCache()
    fresh.keys, fresh.values = mx.broadcast_to(k, (batch, *k.shape[1:])), mx.broadcast_to(v, (batch, *v.shape[1:]))
    fresh.offset = c.offset
    return fresh


class Picked:
    """One layer's prefix KV in several variants, as a worker.cascade group: each row reads the one `index()` picks
    for it ([n] int32, built inside the prompt forward whose decisions pick, on the first read, and kept for the
    rows' decode steps). The cascade reads every variant once per forward, as it reads one prefix."""

    def __init__(self, caches: list[Any], index: Any = None, rows: mx.array | None = None) -> None:
        self.caches, self._index, self._rows = caches, index, rows
        self.offset = caches[0].offset

    def rows(self) -> mx.array:
        if self._rows is None:
            self._rows = self._index()
        return self._rows

    def kept(self, local: list[int]) -> Picked:
        """The same variants for the group's rows `local` (indices within the group, in order)."""
        return Picked(self.caches, rows=self.rows()[mx.array(local)])


class Chosen:
    """One layer's prefix KV in several variants, picked per row by the decisions of the forward reading it."""

    def __init__(self, keys: Callable[[], mx.array], values: Callable[[], mx.array], length: int, caches: list,
                 index: Callable[[], mx.array]) -> None:  # fmt: skip
        self.keys, self.values, self.length = keys, values, length
        self.caches, self.index = caches, index  # the variants' caches and each row's pick among them: worker.cascade

    def picked(self) -> Picked:
        """The variants read once each, rows keeping their pick (worker.cascade), for one prompt forward's rows."""
        return Picked(self.caches, self.index)

    def pick(self, batch: int) -> tuple[mx.array, mx.array]:
        k, v = self.keys(), self.values()
        return mx.broadcast_to(k, (batch, *k.shape[1:])), mx.broadcast_to(v, (batch, *v.shape[1:]))

    def broadcast(self, batch: int) -> KVCache:
        return ChosenCache(self, batch)

    def batched(self, batch: int) -> BatchKVCache:
        return ChosenBatchCache(self, batch)


class ChosenCache(KVCache):
    """A batch's KVCache whose prefix part is each row's pick, made when the layer first reads it (by then the
    probes below and the steered layers below have decided this forward's rows)."""

    def __init__(self, chosen: Chosen, batch: int) -> None:
        super().__init__()
        self.chosen, self.batch = chosen, batch
        self.offset = chosen.length

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = self.chosen.pick(self.batch)
        return super().update_and_fetch(keys, values)


class ChosenBatchCache(BatchKVCache):
    """The same for generation's batched caches (no left padding: every row starts with the prefix)."""

    def __init__(self, chosen: Chosen, batch: int) -> None:
        super().__init__([0] * batch)
        self.chosen, self.batch = chosen, batch
        self._idx = chosen.length
        self.offset = self.offset + chosen.length

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = self.chosen.pick(self.batch)
        return super().update_and_fetch(keys, values)
