"""What Orchard's chunks cost and how a job's requests, or a grid's missing cells, are cut into chunks (pure, Ray-free)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from worker.generate import families as generation_families
from worker.grid import GRID_BLOCK, split_point
from worker.score import families
from worker.spec import Batching, Steering

from .schedule import PER_WORKER, Merge, cut

GridChunk = tuple[tuple[int, ...], list[int]]  # (configuration block, request indices)


def request_costs(kind: str, requests: list, max_length: int, prefix_reuse: bool) -> tuple[list[int], list[list[int]]]:
    """Token cost per request, and the groups a chunk must keep whole (shared inputs and prefixes)."""
    if kind == "loglikelihood":
        costs = [min(len(c) + len(x), max_length) for c, x in requests]
        return costs, families(requests, max_length, prefix_reuse)
    if kind == "generate":  # prompts sharing a prefix (few-shot exemplars) stay together: prefilled once
        costs = [min(len(r.context), max_length) + r.max_gen_toks for r in requests]
        return costs, generation_families(requests, max_length, prefix_reuse)
    if kind == "patch":  # a pair's cells share its clean and corrupt runs on the worker: kept together
        return [min(len(r.clean), max_length) for r in requests], _pair_families(requests)
    costs = [min(len(tokens), max_length) for tokens, _ in requests]
    return costs, [[i] for i in range(len(requests))]


def _pair_families(requests: list) -> list[list[int]]:
    """Patch requests' indices grouped by their prompt pair (worker.patch.spec.PatchRequest), in first-seen order."""
    families: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        families.setdefault((r.clean, r.corrupt, r.correct, r.wrong), []).append(i)
    return list(families.values())


def cut_piece(
    kind: str, piece: list, offset: int, filled: bytearray, *, workers: int, batching: Batching, max_length: int, later: int = 0
) -> list[tuple[list[int], int]]:
    """(global request indices, token cost) per chunk of one piece's requests not answered yet; `later`
    requests are still to come (costed at this piece's mean), so the piece's last chunks stay full size."""
    costs, groups = request_costs(kind, piece, max_length, batching.prefix_reuse)
    groups = [g for g in ([i for i in g if not filled[offset + i]] for g in groups) if g]
    chunks = cut(
        costs,
        groups,
        workers=workers,
        max_tokens=8 * batching.max_batch_tokens,
        min_tokens=max(1, batching.max_batch_tokens // 8),
        after=later * sum(costs) // max(1, len(costs)),
    )
    return [([offset + i for i in ch], sum(costs[i] for i in ch)) for ch in chunks]


def even_blocks(members: list[int], n: int) -> list[tuple[int, ...]]:
    """`members` in n consecutive blocks whose sizes differ by at most one."""
    size, extra = divmod(len(members), n)
    out, at = [], 0
    for b in range(n):
        out.append(tuple(members[at : at + size + (b < extra)]))
        at += size + (b < extra)
    return out


def makespan(costs: list[float], workers: int) -> float:
    """When the last of `workers` finishes, the longest job first onto the least loaded worker."""
    loads = [0.0] * workers
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


def block_unit(splits: list[int], n_layers: int) -> Callable[[tuple[int, ...]], float]:
    """A configuration block's cost per request token, in whole-model forwards: the unsteered blocks up to the
    block's highest split once, each configuration its own blocks (at least a quarter block: the LM head, the gather)."""

    def unit(block: tuple[int, ...]) -> float:
        if not n_layers:
            return float(len(block))
        own = sum(max(n_layers - splits[g], 0.25) for g in block)
        return (max(splits[g] for g in block) + own) / n_layers

    return unit


def _best_blocks(members: list[int], tokens: list[int], unit: Callable, workers: int, request_chunks: int) -> list[tuple[int, ...]]:
    """The fewest even blocks of at most GRID_BLOCK configurations, or, with few request chunks for the workers,
    as many as minimise the estimated makespan (fewest blocks on a near tie)."""
    fewest = math.ceil(len(members) / GRID_BLOCK)
    best = even_blocks(members, fewest)
    if workers > 1 and request_chunks < PER_WORKER * workers:
        options = [even_blocks(members, nb) for nb in range(fewest, max(fewest, min(len(members), 4 * workers)) + 1)]
        spans = [makespan([t * unit(b) for t in tokens for b in blocks], workers) for blocks in options]
        best = next(b for b, t in zip(options, spans) if t <= 1.01 * min(spans))
    return best


def grid_chunks(
    configs: Sequence[Steering], costs: list[int], groups: list[list[int]], merges: list[Merge], *,
    workers: int, n_layers: int, max_batch_tokens: int,
) -> tuple[list[GridChunk], list[float]]:  # fmt: skip
    """(configuration block, request indices) chunks covering every missing cell exactly once, and their costs.

    Configurations missing the same requests are planned together: their requests cut as `run` cuts them
    (groups kept whole), the configurations, ordered by the layer where their steering starts, in even
    blocks of at most GRID_BLOCK. A chunk costs its request tokens x the decoder blocks it runs (the
    unsteered ones once, each configuration's own). Few request chunks for the workers: as many blocks
    as minimise the estimated makespan (longest chunk first onto the least loaded worker), so a large grid
    on a small task still keeps every worker busy, at the price of running the shared blocks once per block.
    """
    splits = [split_point(c, n_layers) if n_layers else 0 for c in configs]
    unit = block_unit(splits, n_layers)
    alike: dict[bytes, list[int]] = {}
    for g, merge in enumerate(merges):
        if merge.count < len(merge.filled):
            alike.setdefault(bytes(merge.filled), []).append(g)
    chunks: list[GridChunk] = []
    chunk_costs: list[float] = []
    for filled, members in alike.items():
        members.sort(key=lambda g: splits[g])
        todo = [costs[i] if not filled[i] else 0 for i in range(len(costs))]
        wanted = [g for g in ([i for i in group if not filled[i]] for group in groups) if g]
        width = min(len(members), GRID_BLOCK)
        request_chunks = cut(
            todo,
            wanted,
            workers=workers,
            # One budget share per worker (max_tokens caps it; backups even out the end): each grid chunk runs
            # a family's shared prefix again for every configuration of its block, so fewer, larger chunks
            # win (bench_sweep's grid on 2 workers: 4 shares 10.3-11.3 s, 2 shares 9.2-9.8 s, 1 share 8.6-9.2 s).
            per_worker=1,
            max_tokens=max(2 * max_batch_tokens, 16 * max_batch_tokens // width),
            min_tokens=max(1, max_batch_tokens // 8),
        )
        tokens = [sum(todo[i] for i in indices) for indices in request_chunks]
        best = _best_blocks(members, tokens, unit, workers, len(request_chunks))
        for indices, t in zip(request_chunks, tokens):
            for block in best:
                chunks.append((block, indices))
                chunk_costs.append(t * unit(block))
    return chunks, chunk_costs
