"""Capture: record a hook point's activations at chosen positions, leaving them unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .manager import HookContext


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
