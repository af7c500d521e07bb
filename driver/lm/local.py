"""The in-process executor (`mlx`): the worker kernels on a model loaded here, and the protocol every executor follows."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Protocol

from cluster.facts import blas, fast_blas
from cluster.schedule import gather
from worker.grid import run_grid
from worker.jobs import run
from worker.load import load
from worker.prefix_cache import store
from worker.spec import Batching, Job, ModelSpec, Steering

from driver.steering.spec import warn_once


class Executor(Protocol):
    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list: ...
    def run_grid(self, kind: str, steerings: Sequence[Steering], requests: list) -> list[list]: ...
    def info(self) -> dict: ...
    def close(self) -> None: ...


class LocalExecutor:
    """The worker kernels on a model loaded in this process."""

    def __init__(self, spec: ModelSpec, batching: Batching) -> None:
        self.lm = load(spec)
        self.batching = batching
        if blas().startswith("reference") and fast_blas():  # a fast BLAS must be preloaded before Python starts
            print(f"note: MLX runs on its reference BLAS here; start Python with LD_PRELOAD={fast_blas()} for ~10x", file=sys.stderr)

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        results = run(self.lm, job, gather(requests, total), self.batching)
        warn_once(results)  # the steering's notes (e.g. it swamps the residual stream), once per run
        return results

    def run_grid(self, kind: str, steerings: Sequence[Steering], requests: list) -> list[list]:
        """Results [configuration][request], each equal to `run(Job(kind=kind, steering=s), requests)[i]`;
        blocks below the configurations' lowest steered layer run once per request (worker.grid)."""
        per_request = run_grid(self.lm, kind, list(steerings), requests, self.batching)
        return [[r[c] for r in per_request] for c in range(len(steerings))]

    def info(self) -> dict:
        return {"executor": "local", "head_split": self.lm.head.split, "prefix_store": [store(self.lm).stats()] if self.lm else []}

    def close(self) -> None:
        self.lm = None
