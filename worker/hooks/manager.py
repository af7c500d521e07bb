"""The hook registry: named hook lists per hook point, the rows of the forward being run, and the checks that a
hook exists at its layer (`missing`) and ran (`installed`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from ..spec import site_missing

POSITIONS = ("all", "prompt", "continuation", "last")
HOOK_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head")


@dataclass
class Rows:
    """Where the real tokens of each row are, in padded-layout indices (arrays of shape [B], int32).

    offset: padded index of the first token of the forward being run (> 0 after a KV-cached prefix).
    starts: first real index per row (left padding); None means 0.
    ends: one past the last real index per row; None means every position of the forward is real.
    prompt_ends: one past the last prompt index per row; None means the whole row is prompt.
    configs: which of the configurations decoding side by side each row runs under (worker.steer.OnRows);
        None when one configuration's hooks act on every row. (A conditional job's generation runs row b under
        "configuration" = its request index: worker.hooks.condition keeps each row's decision by it.)
    requests: per row, the job's request indices it answers (loglikelihood rows); None when not told.
    """

    offset: int = 0
    starts: mx.array | None = None
    ends: mx.array | None = None
    prompt_ends: mx.array | None = None
    configs: mx.array | None = None
    requests: tuple[tuple[int, ...], ...] | None = None

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


def point_layer(point: str) -> int:
    """The layer of a hook point's name (`resid_post.3` -> 3)."""
    return int(point.rpartition(".")[2])


def splits_at_prompt(hooks: Iterable[Any]) -> bool:
    """Whether any of `hooks` treats prompt and continuation positions differently (rows then split there)."""
    return any(getattr(f, "positions", "all") in ("prompt", "continuation") for f in hooks)


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
        # why this model lacks a hook point: keyed by kind ("attn_out": every layer) or name ("attn_out.2": one layer)
        self.missing: dict[str, str] = {}
        self.block_inputs: dict[int, mx.array] = {}  # per layer, while a hooked block runs: its (edited) input
        # The layers whose blocks this process runs (a pipeline rank: its share). Hooks of other layers are kept
        # (so every rank of a group agrees on what is installed) but never run here, so only these can be idle.
        self.owned = range(n_layers)
        self.group: Any = None  # the mx.distributed ring of a split model: idle hooks are counted across it
        self.row_configs: mx.array | None = None  # set by `rows_under` for the forwards inside it

    def check_name(self, name: str) -> None:
        point, _, layer = name.rpartition(".")
        if point not in HOOK_POINTS or not layer.isdigit() or not 0 <= int(layer) < self.n_layers:
            raise ValueError(
                f"unknown hook point {name!r}: use {', '.join(p + '.L' for p in HOOK_POINTS)} with 0 <= L < {self.n_layers}"
            )
        why = site_missing(self.missing, point, int(layer))
        if why:
            raise HookError(f"{name}: {why}")

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
        return splits_at_prompt(f for fs in self._hooks.values() for f in fs)

    @contextlib.contextmanager
    def forward(self, rows: Rows) -> Iterator[None]:
        if rows.configs is None and self.row_configs is not None:
            rows = replace(rows, configs=self.row_configs)
        previous, self.rows = self.rows, rows
        self._forwards += 1
        try:
            yield
        finally:
            self.rows = previous

    @contextlib.contextmanager
    def rows_under(self, configs: Sequence[int] | None) -> Iterator[None]:
        """Forwards inside run row b under configuration configs[b] (Rows.configs); None: no change. Kernels
        that batch rows of several configurations set it around each forward, so the Rows they build need not."""
        previous = self.row_configs
        self.row_configs = mx.array(list(configs)) if configs is not None else previous
        try:
            yield
        finally:
            self.row_configs = previous

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No hook runs inside: for a probe forward that belongs to no job (worker.cascade's self-check)."""
        saved, self._hooks = self._hooks, {}
        try:
            yield
        finally:
            self._hooks = saved

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
        return point_layer(name) in self.owned

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
