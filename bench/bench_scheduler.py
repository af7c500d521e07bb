"""Scheduler benchmarks on the embedded Ray, with workers that do no model work.

    python bench/bench_scheduler.py            # both
    python bench/bench_scheduler.py overhead   # dispatch + merge requests/s with null workers (target >= 20,000/s)
    python bench/bench_scheduler.py uneven     # makespan on workers of speeds 1,1,2,4 vs ideal (target <= 1.1x)

Requests are MMLU-shaped: 5-shot contexts of 400-900 tokens, four one-token continuations per question sharing
the context (one family). Chunks are cut exactly as `mlx-ray` cuts them (default batching: 8192 tokens/forward).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

import numpy as np
import ray

from cluster import Pool, place
from cluster.schedule import Merge, cut, dispatch
from driver.lm.cache import Cache, identity, key

MAX_BATCH_TOKENS = 8192


class NullWorker:
    """Returns a result per request at once, or after `cost / speed * seconds_per_token` (a simulated Mac)."""

    def __init__(self, speed: float = 0.0, seconds_per_token: float = 0.0):
        self.speed, self.seconds_per_token = speed, seconds_per_token

    def facts(self) -> dict:
        return {}

    def loglikelihood(self, indices, requests):
        if self.speed:
            time.sleep(sum(len(c) + len(x) for c, x in requests) * self.seconds_per_token / self.speed)
        return indices, [(-1.0, False)] * len(indices)


def mmlu_like(questions: int, seed: int = 0) -> tuple[list, list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    requests, families = [], []
    for q in range(questions):
        context = tuple(int(t) for t in rng.integers(0, 32000, int(rng.integers(400, 900))))
        families.append(list(range(len(requests), len(requests) + 4)))
        requests += [(context, (int(answer),)) for answer in rng.integers(0, 32000, 4)]
    costs = [len(c) + len(x) for c, x in requests]
    return requests, costs, families


def schedule(workers: list, requests, costs, families, cache: Cache | None = None) -> float:
    """cut + dispatch + merge (+ cache writes); returns seconds."""
    start = time.perf_counter()
    chunks = cut(costs, families, workers=len(workers), max_tokens=8 * MAX_BATCH_TOKENS, min_tokens=MAX_BATCH_TOKENS // 8)
    merge = Merge(len(requests))
    keys = [key(identity({"bench": 1}), "loglikelihood", r) for r in requests] if cache else []

    def on_result(w, c, value):
        indices, results = value
        merge.add(indices, results)
        if cache:
            cache.put((keys[i], r) for i, r in zip(indices, results))

    submit = lambda actor, c: actor.loglikelihood.remote(chunks[c], [requests[i] for i in chunks[c]])  # noqa: E731
    dispatch([sum(costs[i] for i in ch) for ch in chunks], Pool(workers, lambda a: a.facts.remote()), submit, on_result)
    merge.result()
    return time.perf_counter() - start


def overhead() -> None:
    requests, costs, families = mmlu_like(14_042)  # the size of MMLU's test split
    print(f"\nScheduler overhead, null workers: {len(requests):,} MMLU-shaped requests ({sum(costs) / 1e6:.1f} M tokens)")
    print(f"{'workers':>8} {'cache':>6} {'seconds':>8} {'requests/s':>11}")
    for n in (1, 4):
        workers = place(NullWorker, n)
        ray.get([w.facts.remote() for w in workers])
        for cached in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                seconds = schedule(workers, requests, costs, families, Cache(folder) if cached else None)
            print(f"{n:>8} {'yes' if cached else 'no':>6} {seconds:>8.2f} {len(requests) / seconds:>11,.0f}")
        for w in workers:
            ray.kill(w)


def uneven(speeds=(1, 1, 2, 4), seconds_per_token: float = 5e-6) -> None:
    requests, costs, families = mmlu_like(3_000, seed=1)
    ideal = sum(costs) * seconds_per_token / sum(speeds)
    print(f"\nUneven workers, speeds {speeds}: {len(requests):,} requests, ideal makespan {ideal:.2f} s")
    workers = place(NullWorker, len(speeds), per_worker=[{"speed": s, "seconds_per_token": seconds_per_token} for s in speeds])
    ray.get([w.facts.remote() for w in workers])
    seconds = schedule(workers, requests, costs, families)
    print(f"makespan {seconds:.2f} s = {seconds / ideal:.3f} x ideal (target <= 1.1)")
    for w in workers:
        ray.kill(w)


if __name__ == "__main__":
    which = sys.argv[1:] or ["overhead", "uneven"]
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, resources={"mlx": 8}, logging_level=logging.WARNING)
    for name in which:
        {"overhead": overhead, "uneven": uneven}[name]()
    ray.shutdown()
