"""`mlx-ray`: the `mlx` lm-eval model with its compute sharded over Ray actors, one per `mlx` node (Mac).

    simple_evaluate(model="mlx-ray", model_args="pretrained=PATH,workers=4,address=auto,cache=DIR")

Tokenization stays on the driver (OrchardLM), so every worker scores the same token ids. Importing this
module starts nothing: Ray is joined when the model is built.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from typing import Any

from lm_eval.api.registry import register_model
from tqdm import tqdm

from cluster import ClusterError, connect, mismatch, parse_workers, place, worker_count
from worker.generate import GenRequest
from worker.load import ModelLoadError
from worker.spec import Batching, ModelSpec

from .cache import Cache, identity, key
from .lm import OrchardLM, TokenPair, _bool
from .schedule import Merge, Pool, WorkersLost, cut, dispatch


def _start(actors: list) -> list[dict]:
    """Wait for every worker to load its model; its facts, or the one-line reason it could not."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get([a.facts.remote() for a in actors])
    except RayTaskError as e:
        if isinstance(e.cause, ModelLoadError):
            raise ModelLoadError(str(e.cause)) from None
        raise
    except RayActorError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ClusterError(f"a worker died while starting: {first}") from None


def _shutdown(actors: list, cache: Cache | None, connection) -> None:
    import ray

    if ray.is_initialized() and actors:
        for a in actors:
            ray.kill(a, no_restart=True)
        ray.wait([a.facts.remote() for a in actors], num_returns=len(actors), timeout=10)  # dead: `mlx` units free
    if cache is not None:
        cache.close()
    connection.close()


class RayExecutor:
    """Token-level requests sharded over worker actors: cached results skipped, new ones merged and cached."""

    def __init__(
        self,
        spec: ModelSpec,
        batching: Batching,
        *,
        model_identity: dict,
        max_length: int,
        workers: int | str = "all",
        address: str | None = None,
        cache_dir: str | None = None,
        dashboard: bool = False,
        threads: int | None = None,
        max_restarts: int = 3,
        delays: list[float] | None = None,
        crash_after: list[int | None] | None = None,
    ):
        """`threads` caps BLAS/OpenMP threads per worker (several workers on one machine); a crashed worker is
        restarted up to `max_restarts` times. `delays` (seconds per chunk) and `crash_after` (chunks before the
        process crashes, once) are per-worker test knobs."""
        from worker.actor import Worker

        requested = parse_workers(workers)
        self.connection = connect(address, local_workers=1 if requested == "all" else requested, dashboard=dashboard)
        self.actors: list = []
        try:
            n = worker_count(requested)
            delays, crash_after = delays or [0.0] * n, crash_after or [None] * n
            knobs = [
                {"delay": float(delays[i] or 0), "exit_after": None if crash_after[i] is None else int(crash_after[i])}
                for i in range(n)
            ]
            self.actors = place(Worker, n, spec, batching, max_restarts=max_restarts, threads=threads, per_worker=knobs)
            self.facts = _start(self.actors)
            problem = mismatch(self.facts)
            if problem:
                raise ClusterError(problem)
        except BaseException:
            _shutdown(self.actors, None, self.connection)
            raise
        self.batching, self.max_length = batching, max_length
        self.ident = identity({**model_identity, "weights": self.facts[0]["model_files"]})
        self.cache = Cache(cache_dir) if cache_dir else None
        self.names = [f"w{i}@{f['hostname']}" for i, f in enumerate(self.facts)]
        self.pool = Pool(self.actors, revive=lambda actor: actor.facts.options(max_task_retries=-1).remote())
        self.done: Counter = Counter()  # requests computed, per worker name
        self.cached = 0
        self.seconds = 0.0
        self._finalizer = weakref.finalize(self, _shutdown, self.actors, self.cache, self.connection)

    def loglikelihood(self, requests: list[TokenPair]) -> list[tuple[float, bool]]:
        from worker.score import families

        costs = [min(len(c) + len(x), self.max_length) for c, x in requests]
        groups = families(requests, self.max_length, self.batching.prefix_reuse)
        return [tuple(r) for r in self._run("loglikelihood", requests, costs, groups)]

    def generate(self, requests: list[GenRequest]) -> list[str]:
        costs = [min(len(r.context), self.max_length) + r.max_gen_toks for r in requests]
        return self._run("generate", requests, costs, [[i] for i in range(len(requests))])

    def _run(self, kind: str, requests: list, costs: list[int], groups: list[list[int]]) -> list:
        start = time.monotonic()
        merge = Merge(len(requests))
        keys = [key(self.ident, kind, r) for r in requests] if self.cache is not None else []
        if self.cache is not None:
            hits = self.cache.get(keys)
            found = [i for i, k in enumerate(keys) if k in hits]
            merge.add(found, [hits[keys[i]] for i in found])
            self.cached += len(found)
        todo = merge.filled
        groups = [g for g in ([i for i in g if not todo[i]] for g in groups) if g]
        chunks = cut(
            costs,
            groups,
            workers=max(1, len(self.pool.alive)),
            max_tokens=8 * self.batching.max_batch_tokens,
            min_tokens=max(1, self.batching.max_batch_tokens // 8),
        )
        bar = tqdm(total=len(requests), initial=merge.count, unit="req", desc=f"{kind} on {len(self.pool.alive)} workers")

        def submit(actor, c: int):
            return getattr(actor, kind).remote(chunks[c], [requests[i] for i in chunks[c]])

        def on_result(w: int, c: int, value: tuple[list[int], list]) -> None:
            indices, results = value
            merge.add(indices, results)
            if self.cache is not None:
                self.cache.put((keys[i], r) for i, r in zip(indices, results))
            self.done[self.names[w]] += len(indices)
            total = sum(self.done.values())
            shares = (f"{name.split('@')[0]} {self.done[name] / total:.0%}" for name in self.names)
            bar.set_postfix_str(" ".join(shares), refresh=False)
            bar.update(len(indices))

        try:
            dispatch(chunks, [sum(costs[i] for i in ch) for ch in chunks], self.pool, submit, on_result)
        except WorkersLost as e:
            kept = (
                f"they are cached in {self.cache.path.parent}: rerun the same command to resume"
                if self.cache is not None
                else "pass --cache DIR to keep finished work"
            )
            raise ClusterError(f"{e}: {merge.count} of {len(requests)} {kind} requests finished; {kept}") from None
        finally:
            bar.close()
            self.seconds += time.monotonic() - start
        return merge.result()

    def info(self) -> dict:
        seconds = self.seconds or 1e-9
        return {
            "executor": "ray",
            "address": self.connection.address,
            "workers": len(self.facts),
            "workers_alive": len(self.pool.alive),
            "nodes": len({f["node_id"] for f in self.facts}),
            "requests_computed": dict(self.done),
            "requests_cached": self.cached,
            "requests_per_s": {n: round(k / seconds, 2) for n, k in self.done.items()},
            "seconds": round(self.seconds, 3),
            "cache": str(self.cache.path) if self.cache is not None else None,
            "facts": self.facts,
        }

    def close(self) -> None:
        self._finalizer()


def _list(value: Any) -> list | None:
    """A per-worker list from model_args: a list, or a string such as "0:0:0.05" (commas split model_args)."""
    if value is None or isinstance(value, list):
        return value
    return [None if v in ("", "none") else v for v in str(value).split(":")]


@register_model("mlx-ray")
class MLXRayLM(OrchardLM):
    """`mlx` plus workers (a count or "all"), address (auto | HOST:PORT | local), cache (a folder), threads,
    max_restarts and dashboard (embedded Ray only). Test knobs: delays and crash_after, per-worker lists (or
    strings such as "0:0:0.5", as commas separate model_args)."""

    def _init_extra(self, kwargs: dict) -> None:
        self.ray_args = {
            "workers": kwargs.pop("workers", "all"),
            "address": kwargs.pop("address", None),
            "cache_dir": kwargs.pop("cache", None),
            "dashboard": _bool(kwargs.pop("dashboard", False)),
            "delays": _list(kwargs.pop("delays", None)),
            "crash_after": _list(kwargs.pop("crash_after", None)),
        }
        for name in ("threads", "max_restarts"):
            if kwargs.get(name) not in (None, ""):
                self.ray_args[name] = int(kwargs[name])
            kwargs.pop(name, None)
        super()._init_extra(kwargs)

    def make_executor(self, spec: ModelSpec, batching: Batching) -> RayExecutor:
        return RayExecutor(spec, batching, model_identity=self.identity, max_length=self.max_length, **self.ray_args)
