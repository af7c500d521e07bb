"""`mlx-ray`: the `mlx` lm-eval model with its compute sharded over Ray actors, one per `mlx` node (Mac).

    simple_evaluate(model="mlx-ray", model_args="pretrained=PATH,workers=4,address=auto,cache=DIR")

Tokenization stays on the driver (OrchardLM), so every worker scores the same token ids. Importing this
module starts nothing: Ray is joined when the model is built, or, when the result cache already holds this
model's results, at the first request it lacks (a fully cached rerun starts no worker).
"""

from __future__ import annotations

import heapq
import math
import sys
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lm_eval.api.registry import register_model

from cluster import ClusterError, Pool, WorkerActor, connect, held_files, launch, parse_workers, ready, stop, worker_count
from cluster.limits import check_local
from worker.grid import GRID_BLOCK, distinct, split_point
from worker.grid import KINDS as GRID_KINDS
from worker.load import is_local
from worker.score import families
from worker.spec import Batching, Job, ModelSpec, Steering

from driver.lm.cache import Cache, grid_keys, identity, job_prefix
from driver.lm.cache import keys as cache_keys
from driver.lm.mlx import OrchardLM, _bool
from driver.lm.progress import Progress
from cluster.schedule import PER_WORKER, POLL_IDLE, Feed, Merge, WorkersLost, cut, dispatch
from driver.steering.spec import warn_once


@dataclass
class _Held:
    """What a RayExecutor holds open (released by close(), or when it is collected)."""

    cache: Cache | None
    connection: Any = None
    actors: list = field(default_factory=list)


def _shutdown(held: _Held) -> None:
    if held.connection is not None:
        if not held.connection.embedded:  # an embedded Ray goes down whole with its actors; a cluster stays up
            stop(held.actors)
        held.connection.close()
    if held.cache is not None:
        held.cache.close()


# Results as the cache stores them (JSON) and back: capture arrays travel as nested lists.
_TO_CACHE = {"capture": lambda a: a.tolist()}
_FROM_CACHE = {"capture": lambda v: np.asarray(v, dtype=np.float32)}


def _stage(spec: ModelSpec) -> str:
    """Stage the model on every `mlx` node (cluster.stage); the model string the workers load. A staging
    failure is a ClusterError: one line, as every other cluster problem."""
    from cluster.stage import stage
    from worker.staged import StageError

    try:
        report = stage(spec.model, revision=spec.revision)
    except StageError as e:
        raise ClusterError(" ".join(str(e).split())) from None
    moved = sum(n.bytes_sent for n in report.nodes) / 1e6
    print(f"staged {spec.model} on {len(report.nodes)} nodes ({moved:.1f} MB moved)", file=sys.stderr)
    return report.staged_model


def _even_blocks(members: list[int], n: int) -> list[tuple[int, ...]]:
    """`members` in n consecutive blocks whose sizes differ by at most one."""
    size, extra = divmod(len(members), n)
    out, at = [], 0
    for b in range(n):
        out.append(tuple(members[at : at + size + (b < extra)]))
        at += size + (b < extra)
    return out


def _makespan(costs: list[float], workers: int) -> float:
    """When the last of `workers` finishes, the longest job first onto the least loaded worker."""
    loads = [0.0] * workers
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


class _Intake:
    """One run's requests as the head hands them over, piece by piece: each piece read from the cache as it
    comes, and cut into chunks of what the cache lacks when `dispatch` asks for more."""

    def __init__(self, executor: RayExecutor, job: Job, feed: Feed, total: int) -> None:
        self.ex, self.kind, self.feed, self.total = executor, job.kind, feed, total
        self.prefix = job_prefix(executor.ident, job) if executor.cache is not None else b""
        self.merge = Merge(total)
        self.todo: list = []  # every request so far, by global index
        self.keys: list[bytes] = []
        self.chunks: list[list[int]] = []
        self.waiting: list[tuple[int, list]] = []  # (offset, piece): not cut into chunks yet
        self.over = False  # the feed has ended

    def take(self, timeout: float) -> None:
        """The next piece, if one comes within `timeout` s, with its cached results read back."""
        try:
            piece = self.feed.take(timeout)
        except StopIteration:
            self.over = True
            return
        if not piece:
            return
        offset, ex = len(self.todo), self.ex
        self.todo.extend(piece)
        self.waiting.append((offset, piece))
        if ex.cache is not None:
            before = self.merge.count
            self.keys.extend(cache_keys(self.prefix, self.kind, piece))
            ex._from_cache(self.kind, self.merge, self.keys[offset:], offset)
            ex.progress.expect(0, self.merge.count - before, self.kind)

    def all_cached(self) -> bool:
        """Every request so far answered from the cache."""
        return self.merge.count == len(self.todo)

    def more(self, timeout: float) -> list[float] | None:
        """`dispatch`'s feed: costs of the chunks just cut (appended to `chunks`), [] if none yet, None at the end."""
        if not self.waiting and not self.over:
            self.take(timeout)
        if not self.waiting:
            return None if self.over else []
        filled, new = self.merge.filled, []
        for at, piece in self.waiting:
            new += self.ex._cut(self.kind, piece, at, filled, later=self.total - at - len(piece))
        self.waiting.clear()
        self.chunks.extend(indices for indices, _ in new)
        return [cost for _, cost in new]


class RayExecutor:
    """Token-level jobs sharded over worker actors: cached results skipped, new ones merged and cached."""

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
        stage: bool = False,
        actor_cls: type = WorkerActor,
        files: dict | None = None,
    ):
        """`threads` caps BLAS/OpenMP threads per worker (several workers on one machine); a crashed worker is
        restarted up to `max_restarts` times. `actor_cls` is the actor class to place (tests pass a subclass).

        `files`: what every worker must hold ({"weights": fingerprint, "adapter": fingerprint}), when the head
        knows it (a local model: the head's copy). The cache identity is then known before any worker starts,
        and when the cache already holds results of this model (a rerun, a resumed run) Ray and the workers
        start only at the first request it does not hold: a fully cached rerun starts none. Otherwise they
        start now and load the model while lm-eval builds its requests.
        """
        self._requested = parse_workers(workers)
        check_local(self._requested, address, spec.model)  # before anything starts: workers this machine can hold
        self._options = {"address": address, "dashboard": dashboard, "stage": stage, "threads": threads,
                        "max_restarts": max_restarts, "actor_cls": actor_cls}  # fmt: skip
        self.spec, self.batching, self.max_length = spec, batching, max_length
        self.model_identity, self.files = model_identity, files
        self.ident = identity({**model_identity, **files}) if files is not None else None
        self.cache = Cache(cache_dir) if cache_dir else None
        self.pool = Pool([])
        self._facts: list[dict] | None = None
        self.names: list[str] = []
        self.progress = Progress()
        self.done: Counter = Counter()  # requests computed, per worker name
        self.cached = 0
        self.seconds = 0.0
        self._remembered = False
        self._held = _Held(self.cache)
        self._finalizer = weakref.finalize(self, _shutdown, self._held)
        if self.ident is None or self.cache is None or not self.cache.knows(self.ident):
            self._start()

    def _start(self) -> None:
        """Join (or start) Ray and place the workers; they load the model in the background (`wait_ready`)."""
        o, requested = self._options, self._requested
        connection = connect(o["address"], local_workers=1 if requested == "all" else requested, dashboard=o["dashboard"])
        try:
            n = worker_count(requested)
            if o["stage"]:  # every node gets its own verified copy first; the workers load that
                self.spec = self.spec.model_copy(update={"model": _stage(self.spec)})
            actors, self._launched = launch(
                self.spec, self.batching, n, actor_cls=o["actor_cls"], threads=o["threads"], max_restarts=o["max_restarts"]
            )
        except BaseException:
            connection.close()
            raise
        self._held.connection, self._held.actors = connection, actors
        self.pool = Pool(actors)

    @property
    def connection(self):
        """The Ray connection, None until the workers are started."""
        return self._held.connection

    @property
    def actors(self) -> list:
        """The worker actors, [] until they are started."""
        return self._held.actors

    @property
    def facts(self) -> list[dict]:
        """Each worker's facts, once every worker holds the model (starting them if they are not yet)."""
        return self.wait_ready()

    def wait_ready(self) -> list[dict]:
        """Block until every worker holds the model; a load failure surfaces here, in one line."""
        if self._facts is None:
            if self.connection is None:
                self._start()
            facts = ready(self.actors, self._launched, self.spec, self.files)  # the same files on every worker
            self.ident = identity({**self.model_identity, **held_files(facts[0])})
            self.names = [f"w{i}@{f['hostname']}" for i, f in enumerate(facts)]
            self.progress.workers(self.names)
            self._facts = facts
        return self._facts

    def _wait_time(self) -> float:
        """`wait_ready`, returning the seconds it took (not scoring time)."""
        start = time.monotonic()
        self.wait_ready()
        return time.monotonic() - start

    def _plan(self, kind: str, requests: list) -> tuple[list[int], list[list[int]]]:
        """Token cost per request, and the groups a chunk must keep whole (shared inputs and prefixes)."""
        if kind == "loglikelihood":
            costs = [min(len(c) + len(x), self.max_length) for c, x in requests]
            return costs, families(requests, self.max_length, self.batching.prefix_reuse)
        if kind == "generate":
            costs = [min(len(r.context), self.max_length) + r.max_gen_toks for r in requests]
        else:
            costs = [min(len(tokens), self.max_length) for tokens, _ in requests]
        return costs, [[i] for i in range(len(requests))]

    def _from_cache(self, kind: str, merge: Merge, keys: list[bytes], offset: int = 0) -> None:
        hits = self.cache.get(keys)
        found = [i for i, k in enumerate(keys) if k in hits]
        decode = _FROM_CACHE.get(kind, lambda v: v)
        merge.add([offset + i for i in found], [decode(hits[keys[i]]) for i in found])
        self.cached += len(found)
        if found:
            self._remember()

    def _store(self, items: Iterable[tuple[bytes, Any]]) -> None:
        self.cache.put(items)
        self._remember()

    def _remember(self) -> None:
        """Note in the cache that it holds this model's results (a later run then starts workers lazily)."""
        if not self._remembered:
            self.cache.remember(self.ident)
            self._remembered = True

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        """Results of `job` on every request, in order: cached ones read back, the rest computed and cached.

        `requests` is a list, or (with `total`) an iterable of lists whose lengths add up to `total`: the head
        still tokenizing while workers run. Each piece is looked up in the cache, planned and its chunks
        dispatched as soon as it comes; no worker is waited for (or started) while every request so far is cached.
        """
        feed = Feed([requests] if total is None else requests)  # made on its own thread while workers get ready
        total = len(requests) if total is None else total
        if self.cache is not None and self.ident is None:
            self.wait_ready()  # the cache keys need the workers' files
        start_time = time.monotonic()
        self.progress.expect(total, 0, job.kind)
        intake = _Intake(self, job, feed, total)
        encode = _TO_CACHE.get(job.kind, lambda v: v)

        def submit(actor, c: int):
            indices = intake.chunks[c]
            return actor.run.remote(job, indices, [intake.todo[i] for i in indices])

        def on_result(w: int, c: int, value: tuple[list[int], list]) -> None:
            indices, results = value
            warn_once(results)  # the steering's notes (e.g. it swamps the residual stream), once per run
            intake.merge.add(indices, results)
            if self.cache is not None:
                self._store((intake.keys[i], encode(r)) for i, r in zip(indices, results))
            self._count(w, len(indices))

        try:
            while intake.all_cached() and not intake.over:  # no worker is needed (nor started) yet
                intake.take(POLL_IDLE)
            if not intake.all_cached():
                start_time += self._wait_time()
                dispatch([], self.pool, submit, on_result, more=intake.more)
        except WorkersLost as e:
            raise ClusterError(f"{e}: {intake.merge.count} of {total} {job.kind} requests finished; {self._kept()}") from None
        finally:
            self.seconds += time.monotonic() - start_time
        if len(intake.todo) != total:
            raise RuntimeError(f"the head made {len(intake.todo)} {job.kind} requests where it announced {total}")
        return intake.merge.result()

    def _cut(self, kind: str, piece: list, offset: int, filled: bytearray, later: int = 0) -> list[tuple[list[int], int]]:
        """(global request indices, token cost) per chunk of one piece's requests not answered yet; `later`
        requests are still to come (costed at this piece's mean), so the piece's last chunks stay full size."""
        costs, groups = self._plan(kind, piece)
        groups = [g for g in ([i for i in g if not filled[offset + i]] for g in groups) if g]
        chunks = cut(
            costs,
            groups,
            workers=max(1, len(self.pool.alive)),
            max_tokens=8 * self.batching.max_batch_tokens,
            min_tokens=max(1, self.batching.max_batch_tokens // 8),
            after=later * sum(costs) // max(1, len(costs)),
        )
        return [([offset + i for i in ch], sum(costs[i] for i in ch)) for ch in chunks]

    def _kept(self) -> str:
        if self.cache is not None:
            return f"they are cached in {self.cache.path.parent}: rerun the same command to resume"
        return "pass --cache DIR to keep finished work"

    def run_grid(self, kind: str, steerings: Sequence[Steering], requests: list) -> list[list]:
        """Results [configuration][request], each equal to `run(Job(kind=kind, steering=s), requests)[i]`.

        Every missing (configuration, request) cell of the whole grid goes out in one dispatch: chunks are
        blocks of configurations x groups of requests (on the worker, worker.grid runs a chunk's unsteered
        blocks once and each configuration only the blocks from its steered layer up). Cells are cached under
        exactly the keys `run` uses, so a later `run` of one configuration, a rerun or a grown grid computes
        only what is missing. One progress bar counts cells (configurations done in its postfix); info()'s
        requests_computed / requests_cached count cells too. An empty Steering is the unsteered baseline;
        identical configurations are computed once.
        """
        if kind not in GRID_KINDS:
            raise ValueError(f"a grid runs {' or '.join(GRID_KINDS)} work, not {kind!r}")
        if self.cache is not None and self.ident is None:
            self.wait_ready()  # the cache keys need the workers' files
        start_time = time.monotonic()
        configs, owner = distinct(steerings)
        n_configs, n = len(configs), len(requests)
        merges, keys = self._grid_from_cache(kind, configs, requests)
        chunks: list[tuple[tuple[int, ...], list[int]]] = []
        self.progress.expect(n_configs * n, sum(m.count for m in merges), f"{kind} grid of {n_configs} configuration{'s' * (n_configs != 1)}")
        encode = _TO_CACHE.get(kind, lambda v: v)
        done_configs = [sum(m.count == n for m in merges)]

        def submit(actor, c: int):
            block, indices = chunks[c]
            job = Job(kind=kind, grid=tuple(configs[g] for g in block))
            return actor.run.remote(job, indices, [requests[i] for i in indices])

        def on_result(w: int, c: int, value: tuple[list[int], list]) -> None:
            indices, results = value
            block = chunks[c][0]
            cells = []
            for j, g in enumerate(block):
                column = [r[j] for r in results]
                merges[g].add(indices, column)
                done_configs[0] += merges[g].count == n
                if self.cache is not None:
                    cells.extend((keys[g][i], encode(r)) for i, r in zip(indices, column))
            if cells:
                self._store(cells)
            self._count(w, len(indices) * len(block), f"configs {done_configs[0]}/{n_configs}")

        try:
            if any(m.count < n for m in merges):  # else no worker is needed (nor started)
                start_time += self._wait_time()
                costs, groups = self._plan(kind, requests)
                planned, chunk_costs = self._grid_chunks(configs, costs, groups, merges)
                chunks.extend(planned)
                dispatch(chunk_costs, self.pool, submit, on_result)
        except WorkersLost as e:
            finished = sum(m.count for m in merges)
            raise ClusterError(
                f"{e}: {finished} of {n_configs * n} (configuration, request) {kind} results finished; {self._kept()}"
            ) from None
        finally:
            self.seconds += time.monotonic() - start_time
        results = [m.result() for m in merges]
        return [list(results[o]) for o in owner]

    def _grid_from_cache(self, kind: str, configs: list[Steering], requests: list) -> tuple[list[Merge], list[list[bytes]]]:
        """One Merge per configuration, its cached cells filled in, and every cell's key ([] without a cache)."""
        merges = [Merge(len(requests)) for _ in configs]
        if self.cache is None or not requests:
            return merges, []
        keys = grid_keys(self.ident, kind, configs, requests)
        for merge, row in zip(merges, keys):
            self._from_cache(kind, merge, row)
        return merges, keys

    def _grid_chunks(
        self, configs: list[Steering], costs: list[int], groups: list[list[int]], merges: list[Merge]
    ) -> tuple[list[tuple[tuple[int, ...], list[int]]], list[float]]:
        """(configuration block, request indices) chunks covering every missing cell exactly once, and their costs.

        Configurations missing the same requests are planned together: their requests cut as `run` cuts them
        (groups kept whole), the configurations, ordered by the layer where their steering starts, in even
        blocks of at most GRID_BLOCK. A chunk costs its request tokens x the decoder blocks it runs (the
        unsteered ones once, each configuration's own). Few request chunks for the workers: as many blocks
        as minimise the estimated makespan (longest chunk first onto the least loaded worker), so a large grid
        on a small task still keeps every worker busy, at the price of running the shared blocks once per block.
        """
        workers = max(1, len(self.pool.alive))
        n_layers = self.facts[0].get("n_layers") or 0
        splits = [split_point(c, n_layers) if n_layers else 0 for c in configs]

        def unit(block: tuple[int, ...]) -> float:
            # Cost per request token, in whole-model forwards: the unsteered blocks up to the block's highest
            # split once, each configuration its own blocks (at least a quarter block: the LM head, the gather).
            if not n_layers:
                return float(len(block))
            own = sum(max(n_layers - splits[g], 0.25) for g in block)
            return (max(splits[g] for g in block) + own) / n_layers

        alike: dict[bytes, list[int]] = {}
        for g, merge in enumerate(merges):
            if merge.count < len(merge.filled):
                alike.setdefault(bytes(merge.filled), []).append(g)
        chunks: list[tuple[tuple[int, ...], list[int]]] = []
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
                max_tokens=max(2 * self.batching.max_batch_tokens, 16 * self.batching.max_batch_tokens // width),
                min_tokens=max(1, self.batching.max_batch_tokens // 8),
            )
            tokens = [sum(todo[i] for i in indices) for indices in request_chunks]
            fewest = math.ceil(len(members) / GRID_BLOCK)
            best = _even_blocks(members, fewest)
            if workers > 1 and len(request_chunks) < PER_WORKER * workers:
                options = [_even_blocks(members, nb) for nb in range(fewest, max(fewest, min(len(members), 4 * workers)) + 1)]
                spans = [_makespan([t * unit(b) for t in tokens for b in blocks], workers) for blocks in options]
                best = next(b for b, t in zip(options, spans) if t <= 1.01 * min(spans))  # fewest blocks on a near tie
            for indices, t in zip(request_chunks, tokens):
                for block in best:
                    chunks.append((block, indices))
                    chunk_costs.append(t * unit(block))
        return chunks, chunk_costs

    def _count(self, w: int, n: int, note: str = "") -> None:
        self.done[self.names[w]] += n
        self.progress.advance(w, n, note)

    def info(self) -> dict:
        """What ran where; never waits for (or starts) workers: `workers` is 0 when every result was cached."""
        seconds, facts = self.seconds or 1e-9, self._facts or []
        return {
            "executor": "ray",
            "address": self.connection.address if self.connection is not None else None,
            "workers": len(self.actors),
            "workers_alive": len(self.pool.alive),
            "nodes": len({f["node_id"] for f in facts}),
            "requests_computed": dict(self.done),
            "requests_cached": self.cached,
            "requests_per_s": {n: round(k / seconds, 2) for n, k in self.done.items()},
            "seconds": round(self.seconds, 3),
            "cache": str(self.cache.path) if self.cache is not None else None,
            "facts": facts,
        }

    def close(self) -> None:
        self.progress.close()  # the run's progress bar ends before its results are printed
        self._finalizer()


@register_model("mlx-ray")
class MLXRayLM(OrchardLM):
    """`mlx` plus workers (a count or "all"), address (auto | HOST:PORT | local), cache (a folder), threads,
    max_restarts and dashboard (embedded Ray only)."""

    actor_cls: type = WorkerActor  # the actor class placed on each node

    def _init_extra(self, kwargs: dict) -> None:
        self.ray_args = {
            "workers": kwargs.pop("workers", "all"),
            "address": kwargs.pop("address", None),
            "cache_dir": kwargs.pop("cache", None),
            "dashboard": _bool(kwargs.pop("dashboard", False)),
            "stage": _bool(kwargs.pop("stage", False)),
        }
        for name in ("threads", "max_restarts"):
            if kwargs.get(name) not in (None, ""):
                self.ray_args[name] = int(kwargs[name])
            kwargs.pop(name, None)
        super()._init_extra(kwargs)

    def make_executor(self, spec: ModelSpec, batching: Batching) -> RayExecutor:
        files = None
        if is_local(spec.model):  # the workers load the head's folder (or a staged copy): the same content
            files = {"weights": self.identity["files"]} | ({"adapter": self.identity["adapter"]} if self.identity["adapter"] else {})
        return RayExecutor(
            spec, batching, model_identity=self.identity, max_length=self.max_length, actor_cls=self.actor_cls,
            files=files, **self.ray_args,
        )  # fmt: skip
