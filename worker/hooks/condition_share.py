"""A shared prefix under conditional (CAST) steering: computed once per combination of decisions, not once per row.

Below a steered layer a prefix's KV is the same whether its row fires or not (condition layers never come after the
steered layer: worker.spec); above it a fired row's KV is the steered prefix's and a quiet row's the plain one's.
With G conditional interventions a row's KV depends on which of them fired: 2^G variants (batch 1), variant v with
intervention g forced on where bit g of v is set and off elsewhere. `grown_prefix` grows them as a tree: the blocks
below the lowest intervention's block run once for all, each next span of blocks once per outcome of the decisions
below it (worker.hooks.blocks runs a span; one intervention in the middle of the model: 1.5 prefix passes, not 2);
where the model cannot run in spans (or on a worker group) `shared_prefix` runs the whole prefix per variant. The
probes keep each variant's sum of the prefix's hidden states at every condition layer (`pool: mean` adds it to the
suffix's; `pool: last` reads the last prompt token, which a shared prefix never holds). A row's decisions are made
on the way up through its own suffix, inside the same lazy forward, so which combinations occur is not known before
the prefix must be ready: every one is computed (MAX_GATES caps that; past it each row runs its whole prompt).

Each suffix forward then reads, at every layer where the variants' KVs differ, the one its row's decisions pick
(`Chosen`: only the interventions whose steering reaches that layer matter there, and they are decided below it),
and each probe adds the prefix sum its row's earlier decisions pick: the same numbers as running each row's whole
prompt. Loglikelihood (worker.score) and generation (worker.generate) share prefixes so, lockstep or pipelined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .blocks import advance, broadcast_kv, kv_cache, shares_lower, unhooked
from .condition import Gate, WhenFired, conditional_gates
from .manager import Rows, point_layer

__all__ = ["MAX_GATES", "Chosen", "ChosenCache", "Picked", "SharedPrefix", "conditional_gates", "grown_prefix", "shareable", "shared_prefix"]

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
        self._running: tuple[int, int] | None = None  # (variant, the bits its pass decides) of the pass running now

    def run(self, v: int, body: Callable[[], Any], mask: int | None = None) -> Any:
        """`body()` (a prefix pass) with intervention g forced on iff bit g of `v` is set; the probes keep its sums
        in every variant that agrees with `v` on the bits of `mask` (all of them by default: `v` alone)."""
        for g, gate in enumerate(self.gates):
            gate.forced, gate.prefix = bool(v >> g & 1), self
        self._running = (v, self.count - 1 if mask is None else mask)
        try:
            return body()
        finally:
            self._running = None
            for gate in self.gates:
                gate.forced, gate.prefix = None, None

    def keep(self, probe: Any, total: mx.array) -> None:
        sums = self._sums.setdefault(probe, [None] * self.count)
        for u in _agreeing(*self._running, self.count):
            sums[u] = total

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


def grown_prefix(lm: Any, gates: list[Gate], tokens: Sequence[int]) -> SharedPrefix | None:
    """A family's prefix for a conditional job, its variants grown as a tree: the blocks below the lowest decision's
    first steered block run once for every variant, each next span of blocks once per outcome of the decisions
    below it (one conditional add in the middle of 32 layers: 16 + 2 x 16 blocks, not 2 x 32). None where the
    blocks cannot run in slices here (worker.hooks.blocks.shares_lower; a worker group; caches not plain)."""
    splits = _first_blocks(lm.hooks, gates)
    order = sorted(range(len(gates)), key=lambda g: splits[g])
    bounds = [0] + [splits[g] for g in order] + [lm.n_layers]
    if not _sliceable(lm, gates, bounds):
        return None
    shared = SharedPrefix(gates, len(tokens), [[None] * lm.n_layers for _ in range(1 << len(gates))])

    def grow(k: int, v: int, h: mx.array | None) -> None:  # blocks bounds[k]..bounds[k+1]-1 under order[:k]'s bits of v
        a, b, mask = bounds[k], bounds[k + 1], sum(1 << g for g in order[:k])
        if a < b:
            fresh = kv_cache(lm)
            h = shared.run(v, lambda: _span(lm, a, b, h, tokens, fresh), mask)
            mx.eval([c.state for c in fresh[a:b]], h if b < lm.n_layers else [])  # the last block's output is no KV's
            for u in _agreeing(v, mask, shared.count):
                shared.variants[u][a:b] = fresh[a:b]
        if k < len(order):
            grow(k + 1, v, h)
            grow(k + 1, v | 1 << order[k], h)

    grow(0, 0, None)
    return shared


def _first_blocks(hooks: Any, gates: list[Gate]) -> list[int]:
    """Per gate, the first block whose numbers its intervention changes (resid_post.L counts as block L: a span's
    last block runs its resid_post hooks inside the span)."""
    first: dict[Gate, int] = {}
    for point, fns in hooks._hooks.items():
        layer = point_layer(point)
        for f in fns:
            if isinstance(f, WhenFired):
                first[f.gate] = min(first.get(f.gate, layer), layer)
    return [first[g] for g in gates]


def _sliceable(lm: Any, gates: list[Gate], bounds: list[int]) -> bool:
    if not shareable(gates) or getattr(lm, "group", None) is not None or kv_cache(lm) is None:
        return False
    with unhooked(lm):  # the probe compares plain forwards
        return all(shares_lower(lm, b) for b in set(bounds) if 0 < b < lm.n_layers)


def _span(lm: Any, a: int, b: int, h: mx.array | None, tokens: Sequence[int], cache: list) -> mx.array:
    """Blocks a..b-1 of the prefix (batch 1) from `h` (the state entering block a; None: a = 0), their KV into
    `cache`; the state leaving block b-1 (lazy)."""
    with lm.hooks.forward(Rows(offset=0, ends=mx.array([len(tokens) + 1]))):  # as worker.score's prefix pass
        return advance(lm, a, b, h, mx.array([tokens]), cache)


def _agreeing(v: int, mask: int, count: int) -> list[int]:
    """The variants that agree with `v` on the bits of `mask`."""
    return [u for u in range(count) if u & mask == v & mask]


def _differs(arrays: list[mx.array], gates: list[Gate]) -> set[int]:
    """The interventions whose decision changes `arrays` (one per variant): those a row's pick must read."""
    return _differences([arrays], gates)[0]


def _differences(many: list[list[mx.array]], gates: list[Gate]) -> list[set[int]]:
    """`_differs` of each list of `many`, in one host sync."""
    pairs = [(g, v) for g in range(len(gates)) for v in range(1 << len(gates)) if not v >> g & 1]
    same = [[mx.array(True) if arrays[v] is arrays[v | 1 << g] else mx.array_equal(arrays[v], arrays[v | 1 << g]) for g, v in pairs]
            for arrays in many]  # fmt: skip
    mx.eval(same)
    return [{g for (g, _), s in zip(pairs, row) if not s.item()} for row in same]


def _held(caches: list, part: str) -> list[mx.array]:
    """Each variant's cache's keys or values (`part`), its filled positions only; variants holding one cache (a grown
    prefix's shared blocks) get one array, so they agree without a compare (`_differences`)."""
    sliced: dict[int, mx.array] = {}
    for c in caches:
        if id(c) not in sliced:
            sliced[id(c)] = getattr(c, part)[..., : c.offset, :]
    return [sliced[id(c)] for c in caches]


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


class Picked:
    """One layer's prefix KV in several variants, as a worker.cascade group: each row reads the one `index()` picks
    for it ([n] int32, built inside the prompt forward whose decisions pick, on the first read, and kept for the
    rows' decode steps). The cascade reads every variant once per forward, as it reads one prefix; from the first
    decode step on only those some row picked (`read`: one variant when every row's decisions agree)."""

    def __init__(self, caches: list[Any], index: Any = None, rows: mx.array | None = None) -> None:
        self.caches, self._index, self._rows = caches, index, rows
        self.offset = caches[0].offset
        self._narrow = rows is not None  # the picks are known: the prompt forward that made them has run

    def rows(self) -> mx.array:
        if self._rows is None:
            self._rows = self._index()
        return self._rows

    def read(self) -> list[Any]:
        """The variants this forward reads: all of them on the prompt forward (whose decisions pick), then only
        those picked (one host read of the picks, once, when the first decode step is built)."""
        if self._narrow:
            picks = self.rows().tolist()
            used = sorted(set(picks))
            self.caches, self._rows = [self.caches[u] for u in used], mx.array([used.index(p) for p in picks])
            self._narrow = False
        elif self._rows is None:
            self._narrow = True  # this is the prompt forward: the next one reads the picks it made
        return self.caches

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
