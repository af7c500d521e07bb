"""Exact rows that run only the positions a positional cell can change.

A cell at (layer L, position p) of a resid/attn_out/mlp_out site leaves every position before p as the corrupt run
computes it (causal attention), so its row runs the corrupt tokens p..T-1 only, on a per-layer KV cache holding the
corrupt run's keys and values of positions 0..p-1 (captured once per pair by its run, `keep`): RoPE takes the
absolute positions from the cache's offset p, the mask lets the suffix see the whole prefix. attn_head cells patch
every position and keep the full row. Used only where `runs_suffixes` probes that cached suffixes give the whole
forward's numbers on this model (plain KV caches, unsteered); elsewhere every row starts at position 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..hooks.blocks import kv_cache, shares_lower


def runs_suffixes(lm) -> bool:
    """Whether rows may start at their cell's position here (probed once, before any hook is installed)."""
    if lm.hooks.active or lm.n_layers < 1 or lm.grouping is not None:
        return False  # a steered job's hooks act per position of the whole prompt; a group's ring pays per forward
    memo = lm.__dict__.setdefault("_orchard_patch_suffix", {})
    if "ok" not in memo:
        memo["ok"] = kv_cache(lm) is not None and shares_lower(lm, 1)
    return memo["ok"]


def start(cell, suffixes: bool) -> int:
    """The first position a cell's row runs."""
    return cell.position if suffixes and cell.site != "attn_head" else 0


def keep(cache: list | None, row: int) -> list | None:
    """Row `row`'s keys and values per layer (lazy) from a forward's caches; None: no caches."""
    if cache is None:
        return None
    return [(c.keys[row : row + 1, :, : c.offset, :], c.values[row : row + 1, :, : c.offset, :]) for c in cache]


def prefix(kvs: Sequence[list], p: int) -> list[KVCache]:
    """Per layer, a cache of each row's corrupt keys and values at positions 0..p-1 (rows in order)."""
    caches = []
    for layer in range(len(kvs[0])):
        c = KVCache()
        c.keys = mx.concatenate([kv[layer][0][:, :, :p, :] for kv in kvs], axis=0)
        c.values = mx.concatenate([kv[layer][1][:, :, :p, :] for kv in kvs], axis=0)
        c.offset = p
        caches.append(c)
    return caches
