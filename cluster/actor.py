"""The worker actor and its whole lifecycle: placed one per `mlx` node, checked ready, revived, stopped.

`WorkerActor` is thin: it loads one model once and hands each call to `worker.jobs.run`, which installs that
call's steering around the kernel and removes it after. When Ray restarts a crashed actor it runs the
constructor again, so the model is reloaded. Tests pass their own subclass (slow or crashing workers).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from worker.jobs import run
from worker.load import ModelLoadError, fingerprint, load, resolve, weights_bytes
from worker.prefix_cache import store
from worker.spec import Batching, Job, ModelSpec
from worker.split import smallest_size

from .connect import ClusterError
from .facts import collect, mismatch, mlx_device, slow_blas
from .place import place


def _was_restarted() -> bool:
    import ray

    with warnings.catch_warnings():  # Ray's own property calls its deprecated `actor_id`
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)


class WorkerActor:
    def __init__(self, spec: ModelSpec, batching: Batching, rank: int = 0):
        self.rank, self.batching, self.spec = rank, batching, spec
        self.restarted = _was_restarted()
        self.error: ModelLoadError | None = None
        try:
            folder = resolve(spec.model, spec.revision, spec.adapter_path)  # local, this node's staged copy, or Hub
            self.check_fits(folder)
            self.lm = load(spec.model_copy(update={"model": str(folder)}))  # no second Hub or staged-copy lookup
        except ModelLoadError as e:  # reported by facts(), so the driver prints the one-line message
            self.lm, self.error = None, e

    def memory_for_models(self) -> tuple[float, str]:
        """(GB this node can give a model, where that figure comes from): Metal's working set, or system memory."""
        device = mlx_device()
        return device["model_memory_gb"], device["model_memory_source"]

    def check_fits(self, folder: Path, size: int = 1) -> None:
        """Refuse, in one line, weights (this rank's 1/`size` share of them, in a worker group) larger than the
        node's memory for models, before MLX tries and swaps; the refusal names the group size that would fit."""
        total = weights_bytes(folder) / 2**30
        have, source = self.memory_for_models()
        if total / size <= have:
            return
        fit = smallest_size(total, max(have, 1e-9))
        held = f"the model's weights ({total:.1f} GB)" if size == 1 else \
            f"this rank's share of the weights ({total / size:.1f} GB of {total:.1f} GB over {size} ranks)"
        raise ModelLoadError(
            f"{held} do not fit in the {have:.1f} GB this node has for models ({source}): use a smaller or quantized "
            f"model (e.g. an mlx-community 4-bit one), pass --group-size {fit} (or auto) to split it across that "
            "many nodes, or leave this node out"
        )

    def facts(self) -> dict:
        """Where this worker runs and what it holds; raises the load error if the model did not load."""
        if self.error is not None:
            raise self.error
        return {
            **collect(),
            "rank": self.rank,
            "model_files": fingerprint(self.lm.path),
            "model_path": str(self.lm.path),
            "adapter_files": fingerprint(Path(self.spec.adapter_path).expanduser()) if self.spec.adapter_path else None,
            "max_length": self.lm.max_length,
            "n_layers": self.lm.n_layers,
            "restarted": self.restarted,
        }

    def run(self, job: Job, indices: Sequence[int], requests: Sequence[Any]) -> tuple[Sequence[int], list]:
        return indices, run(self.lm, job, requests, self.batching)

    def prefix_store(self) -> dict:
        """The counters of this worker's prefix KV store (worker.prefix_cache): hits, tokens reused, peak bytes."""
        return store(self.lm).stats()


def revive(actor: Any) -> Any:
    """A ref that completes once a lost actor is back (Ray restarted it, model reloaded), or fails for good."""
    return actor.facts.options(max_task_retries=-1).remote()


class Pool:
    """The workers of a run, across dispatch calls: which are alive, and which Ray is restarting."""

    def __init__(self, workers: Sequence[Any], revive: Callable[[Any], Any] = revive):
        self.workers = list(workers)
        self.revive = revive
        self.alive = set(range(len(self.workers)))
        self.reviving: dict[Any, int] = {}  # ref -> worker index

    def prefix_stores(self, timeout: float = 5.0) -> list[dict]:
        """Each live worker's prefix store counters, asked after the work (a busy worker answers after its chunks);
        [] when they do not all answer within `timeout` s."""
        import ray

        asked = [self.workers[w].prefix_store.remote() for w in sorted(self.alive)] if ray.is_initialized() else []
        if not asked or len(ray.wait(asked, num_returns=len(asked), timeout=timeout)[0]) < len(asked):
            return []
        try:
            return ray.get(asked)
        except Exception:  # a courtesy for the summary: never fail a finished run over it
            return []

    def lost(self, w: int) -> None:
        if w in self.alive:
            self.alive.discard(w)
            self.reviving[self.revive(self.workers[w])] = w

    def back(self, ref: Any) -> None:
        import ray
        from ray.exceptions import RayActorError

        w = self.reviving.pop(ref)
        try:
            ray.get(ref)
            self.alive.add(w)
        except RayActorError:
            pass  # gone for good

    # What dispatch asks every pool; a pool of worker groups (cluster.groups) answers otherwise.
    def watched(self) -> dict:
        """Refs dispatch waits on besides the results (a group's other ranks): none here."""
        return {}

    def settle(self, ref: Any) -> None:
        """A watched ref landed (never here)."""

    def due(self) -> float | None:
        """Seconds until the next deadline (a hung group): none here."""
        return None

    def expire(self) -> None:
        """Act on deadlines passed (none here)."""

    def broken(self, w: int, error: BaseException) -> bool:
        """Whether a result's error means worker w is lost (never here: an actor's death is a RayActorError)."""
        return False

    def drop(self, ref: Any) -> None:
        """A copy no longer needed: cancelled."""
        import ray

        ray.cancel(ref)

    def gone(self) -> str:
        """Why the run cannot go on once no worker is left."""
        return "every worker is lost"


def launch(
    spec: ModelSpec,
    batching: Batching,
    n: int,
    *,
    actor_cls: type = WorkerActor,
    threads: int | None = None,
    max_restarts: int = 3,
) -> tuple[list, list]:
    """Place n actors (one per `mlx` node); they load their models while the caller goes on (lm-eval building
    its requests). (actors, refs to their facts): pass both to `ready` before the first job."""
    ranks = [{"rank": i} for i in range(n)]
    actors = place(actor_cls, n, spec, batching, max_restarts=max_restarts, threads=threads, per_worker=ranks)
    return actors, [a.facts.remote() for a in actors]


def held_files(facts: dict) -> dict:
    """The model (and adapter) files a worker holds, by content: {"weights": …, "adapter": …}."""
    held = {"weights": facts["model_files"]}
    if facts.get("adapter_files"):
        held["adapter"] = facts["adapter_files"]
    return held


def ready(actors: list, refs: list, spec: ModelSpec, files: dict | None = None) -> list[dict]:
    """Wait for each launched worker to hold its model; their facts.

    Raises ModelLoadError / ClusterError in one line (and stops every actor) if any worker cannot serve: it
    failed to load, the workers disagree, or they hold other files than `files` (the head's, by `held_files`).
    """
    import ray
    from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

    from .failures import describe, load_failure

    facts: list[dict] = []
    try:
        for rank, ref in enumerate(refs):  # in order, so a failure is pinned on its worker (and node)
            try:
                facts.append(ray.get(ref))
            except RayTaskError as e:  # raised inside the worker
                if isinstance(e.cause, ModelLoadError):
                    raise ModelLoadError(load_failure(actors, rank, str(e.cause), spec.model)) from None
                raise
            except (RayActorError, OutOfMemoryError) as e:  # the worker process died (or Ray killed it for memory)
                raise ClusterError(describe(e, actors, rank, doing=f"loading {spec.model}", model=spec.model)) from None
        problem = mismatch(facts)
        if problem is None and files is not None:
            problem = _other_files(held_files(facts[0]), files, facts[0]["hostname"], spec.model)
        if problem:
            raise ClusterError(problem)
    except BaseException:
        stop(actors)
        raise
    warning = slow_blas(facts)
    if warning:  # once per run, in one line
        print(warning, file=sys.stderr)
    return facts


def _other_files(held: dict, files: dict, host: str, model: str) -> str | None:
    """One line if the workers hold other model (or adapter) files than the head tokenizes and keys the cache
    with, else None."""
    kind = next((k for k in ("weights", "adapter") if held.get(k) != files.get(k)), None)
    if kind is None:
        return None
    theirs, ours = (str(d.get(kind) or "none")[:12] for d in (held, files))
    return (
        f"the workers hold other {kind} files than the head ({theirs} on {host}, {ours} here): the files changed "
        f"since the head read them, or the nodes hold other copies: `driver stage --model {model}` (or `driver run --stage`) copies the head's"
    )


def start(spec: ModelSpec, batching: Batching, n: int, **options: Any) -> tuple[list, list[dict]]:
    """`launch` then `ready`: (actors, their facts) once every worker holds the model."""
    actors, refs = launch(spec, batching, n, **options)
    return actors, ready(actors, refs, spec)


def stop(actors: Sequence[Any]) -> None:
    """Kill the actors and wait until they are gone, so their `mlx` units are free for the next run."""
    import ray

    if ray.is_initialized() and actors:
        for a in actors:
            ray.kill(a, no_restart=True)
        ray.wait([a.facts.remote() for a in actors], num_returns=len(actors), timeout=10)
