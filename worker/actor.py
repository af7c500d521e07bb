"""The worker actor: one model, loaded once, scoring chunks of token-level requests tagged with global indices.

A plain class: `cluster.place` turns it into a Ray actor (one per `mlx` node). When Ray restarts a crashed
actor it runs the constructor again, so the model is reloaded.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence

from .load import ModelLoadError, fingerprint, load
from .spec import Batching, ModelSpec


class Worker:
    def __init__(self, spec: ModelSpec, batching: Batching, *, delay: float = 0.0, exit_after: int | None = None):
        """`delay` (seconds per chunk) and `exit_after` (crash the process once, after that many chunks) are test knobs."""
        import ray

        with warnings.catch_warnings():  # Ray's own property calls its deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.batching = batching
        self.delay = delay
        self.exit_after = None if restarted else exit_after
        self.chunks = 0
        self.restarted = restarted
        self.error: ModelLoadError | None = None
        try:
            self.lm = load(spec)
        except ModelLoadError as e:  # reported by facts(), so the driver prints the one-line message
            self.lm, self.error = None, e

    def facts(self) -> dict:
        """Where this worker runs and what it holds; raises the load error if the model did not load."""
        from cluster.facts import collect

        if self.error is not None:
            raise self.error
        return {**collect(), "model_files": fingerprint(self.lm.path), "max_length": self.lm.max_length, "restarted": self.restarted}

    def loglikelihood(self, indices: Sequence[int], requests: Sequence[tuple[Sequence[int], Sequence[int]]]):
        from .score import loglikelihood

        self._tick()
        return indices, loglikelihood(self.lm, requests, self.batching)

    def generate(self, indices: Sequence[int], requests: Sequence):
        from .generate import generate

        self._tick()
        return indices, generate(self.lm, requests, batch_size=self.batching.batch_size)

    def _tick(self) -> None:
        self.chunks += 1
        if self.exit_after is not None and self.chunks > self.exit_after:
            os._exit(1)  # a crash, as when a Mac's process is killed: Ray restarts the actor
        if self.delay:
            time.sleep(self.delay)
