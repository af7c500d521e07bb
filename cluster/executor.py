"""The executor that feeds Ray actors: token-level jobs sharded over worker actors as plain code around `ray.wait`
(cluster.schedule.dispatch: chunks in flight, a lost worker's chunks requeued, a restarted one taken back);
cached results skipped, new ones merged and cached. It is handed its result cache, progress bar and a callback
for the workers' notes by its caller (driver.lm.mlx_ray), so it knows nothing of the head's other rooms."""

from __future__ import annotations

import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.grid import KINDS as GRID_KINDS
from worker.grid import distinct
from worker.spec import Batching, Grouping, Job, ModelSpec, Steering

from . import groups
from .actor import Pool, WorkerActor, held_files, launch, ready, stop
from .connect import ClusterError, connect, signals_held
from .groups.pool import DEADLINE
from .intake import Intake, Stored, encoder
from .limits import check_local
from .place import parse_workers, worker_count
from .plan import cut_piece, grid_chunks, request_costs
from .schedule import POLL_IDLE, Feed, Merge, WorkersLost, dispatch


@dataclass
class _Held:
    """What an executor holds open (released by close(), or when it is collected)."""

    connection: Any = None
    actors: list = field(default_factory=list)
    placements: list = field(default_factory=list)  # worker groups' placement groups (their `mlx` units)


def _shutdown(held: _Held, cache: Any) -> None:
    with signals_held():  # a second Ctrl-C must not cut Ray's shutdown or the cache's last write in half
        if held.connection is not None:
            if not held.connection.embedded:  # an embedded Ray goes down whole with its actors; a cluster stays up
                stop(held.actors)
                _remove(held.placements)
            held.connection.close()
        if cache is not None:
            cache.close()


def _remove(placements: list) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    if ray.is_initialized():
        for pg in placements:
            remove_placement_group(pg)
    placements.clear()


class Workers:
    """An executor's worker actors: their count checked against this machine before anything starts, Ray joined
    and the actors placed on demand (`start`), every one holding the model after `ready`."""

    def __init__(
        self,
        spec: ModelSpec,
        batching: Batching,
        *,
        workers: int | str = "all",
        address: str | None = None,
        dashboard: bool = False,
        threads: int | None = None,
        max_restarts: int = 3,
        stage: bool = False,
        actor_cls: type = WorkerActor,
        files: dict | None = None,
        grouping: Grouping = Grouping(),
        group_deadline: float = DEADLINE,
    ):
        """`threads` caps BLAS/OpenMP threads per worker (several workers on one machine); a crashed worker is
        restarted up to `max_restarts` times. `actor_cls` is the actor class to place (tests pass a subclass).
        `files`: what every worker must hold ({"weights": fingerprint, "adapter": fingerprint}), when the head
        knows it (a local model: the head's copy). `grouping`: N workers are N groups of `grouping.size` ranks
        holding one model split across them (cluster.groups); a group that makes no progress for `group_deadline`
        s while it holds chunks is lost."""
        self.requested = parse_workers(workers)
        check_local(self.requested, address, spec.model, grouping.size)  # before anything starts: what this machine holds
        self.options = {"address": address, "dashboard": dashboard, "stage": stage, "threads": threads,
                        "max_restarts": max_restarts, "actor_cls": actor_cls, "deadline": group_deadline}  # fmt: skip
        self.spec, self.batching, self.files, self.grouping = spec, batching, files, grouping
        self.held = _Held()
        self.pool = Pool([])
        self.facts: list[dict] | None = None  # each worker's facts, once every one holds the model
        self.names: list[str] = []
        self._launched: Any = None
        self._formed: Any = None  # the worker groups (cluster.groups.Formed) when grouping.size > 1
        self.tell: Callable[[Any], None] = lambda results: None  # the executor's notes callback (ranks > 0's notes)

    def say(self, line: str) -> None:
        """A line for the user (the staging report); the CLI's workers say it their way."""
        print(line, file=sys.stderr)

    def start(self) -> None:
        """Join (or start) Ray and place the workers; they load the model in the background (`ready`)."""
        o, requested, size = self.options, self.requested, self.grouping.size
        local = (1 if requested == "all" else requested) * size  # the embedded Ray: one unit per rank
        connection = connect(o["address"], local_workers=local, dashboard=o["dashboard"])
        try:
            n = worker_count(requested) if size == 1 else groups.group_count(requested, size)
            if o["stage"]:  # every node gets its own verified copy first; the workers load that
                from .stage import stage_model

                self.spec = self.spec.model_copy(update={"model": stage_model(self.spec, self.say)})
            if size == 1:
                actors, self._launched = launch(
                    self.spec, self.batching, n, actor_cls=o["actor_cls"], threads=o["threads"], max_restarts=o["max_restarts"]
                )
                self.pool = Pool(actors)
            else:
                actors = self._launch_groups(n)
        except BaseException:
            connection.close()
            raise
        self.held.connection, self.held.actors = connection, actors

    def _launch_groups(self, n: int) -> list:
        """Place n groups; their ranks join and load in the background (`ready`). All their rank actors."""
        o = self.options
        rank_cls = o["actor_cls"] if issubclass(o["actor_cls"], groups.GroupRank) else groups.GroupRank
        self._formed, self._launched = groups.launch(self.spec, self.batching, n, self.grouping, actor_cls=rank_cls, threads=o["threads"])
        formed, actors = self._formed, self._formed.actors()
        self.held.placements = formed.placements
        recipe = groups.Recipe(self.spec, self.batching, self.grouping, rank_cls, o["threads"], groups.strategy(self.grouping.size),
                               actors=actors, placements=formed.placements)  # fmt: skip
        handles = [groups.GroupHandle(r, g, pg) for g, (r, pg) in enumerate(zip(formed.ranks, formed.placements))]
        pool = groups.GroupPool(handles, o["deadline"], recipe=recipe, max_restarts=o["max_restarts"], tell=self.tell)
        self.pool = pool  # a lost group is re-formed; its ranks > 0 tell their steering notes
        return actors  # the executor's list: a re-formed group's ranks join it, to be stopped at close

    def ready(self) -> list[dict]:
        """Block until every worker holds the model (starting them if they are not yet); a load failure surfaces
        here, in one line."""
        if self.held.connection is None:
            self.start()
        if self._formed is not None:  # one worker per group: rank 0's facts, every rank's under "ranks"
            facts = groups.ready_groups(self._formed, self._launched, self.spec, self.files)
            self.names = groups.names(facts)
            self.pool.facts = facts  # a re-formed group's facts replace the lost one's
        else:
            facts = ready(self.held.actors, self._launched, self.spec, self.files)  # the same files on every worker
            self.names = [f"w{i}@{f['hostname']}" for i, f in enumerate(facts)]
        self.facts = facts
        return facts


class RayExecutor:
    """Token-level jobs sharded over worker actors: cached results skipped, new ones merged and cached."""

    def __init__(
        self, workers: Workers, *, cache: Any, progress: Any, notes: Callable[[Any], None], model_identity: dict, max_length: int
    ):
        """`cache`: the result cache (None: none; its methods: see cluster.intake.Stored); `progress`: the bar
        (`expect`, `workers`, `advance`, `close`); `notes(results)`: shows what workers attached to results.

        When the head knows the workers' files, the cache identity is known before any worker starts, and when
        the cache already holds results of this model (a rerun, a resumed run) Ray and the workers start only at
        the first request it does not hold: a fully cached rerun starts none. Otherwise they start now and load
        the model while lm-eval builds its requests.
        """
        self.workers, self.progress, self.notes = workers, progress, notes
        self.model_identity, self.max_length = model_identity, max_length
        self.stored = Stored(cache)
        workers.tell = notes  # a group's ranks > 0 hold the steered layers they own: their notes come this way
        if workers.files is not None:
            self.stored.identify({**model_identity, **workers.files})
        self.done: Counter = Counter()  # requests computed, per worker name
        self.seconds = 0.0
        self._finalizer = weakref.finalize(self, _shutdown, workers.held, cache)
        if not self.stored.holds_model():
            workers.start()

    @property
    def connection(self):
        """The Ray connection, None until the workers are started."""
        return self.workers.held.connection

    @property
    def actors(self) -> list:
        """The worker actors, [] until they are started."""
        return self.workers.held.actors

    @property
    def pool(self) -> Pool:
        return self.workers.pool

    @property
    def facts(self) -> list[dict]:
        """Each worker's facts, once every worker holds the model (starting them if they are not yet)."""
        return self.wait_ready()

    def wait_ready(self) -> list[dict]:
        """Block until every worker holds the model; a load failure surfaces here, in one line."""
        if self.workers.facts is None:
            facts = self.workers.ready()
            self.stored.identify({**self.model_identity, **held_files(facts[0])})
            self.progress.workers(self.workers.names)
        return self.workers.facts

    def _wait_time(self) -> float:
        """`wait_ready`, returning the seconds it took (not scoring time)."""
        start = time.monotonic()
        self.wait_ready()
        return time.monotonic() - start

    def _cut(self, kind: str, piece: list, offset: int, filled: bytearray, later: int = 0) -> list[tuple[list[int], int]]:
        """cluster.plan.cut_piece for the workers alive now."""
        workers, batching = max(1, len(self.pool.alive)), self.workers.batching
        return cut_piece(kind, piece, offset, filled, workers=workers, batching=batching, max_length=self.max_length, later=later)

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        """Results of `job` on every request, in order: cached ones read back, the rest computed and cached.

        `requests` is a list, or (with `total`) an iterable of lists whose lengths add up to `total`: the head
        still tokenizing while workers run. Each piece is looked up in the cache, planned and its chunks
        dispatched as soon as it comes; no worker is waited for (or started) while every request so far is cached.
        """
        feed = Feed([requests] if total is None else requests)  # made on its own thread while workers get ready
        total = len(requests) if total is None else total
        if self.stored.needs_ident():
            self.wait_ready()  # the cache keys need the workers' files
        start_time = time.monotonic()
        self.progress.expect(total, 0, job.kind)
        intake = Intake(self.stored, self.progress, self._cut, job, feed, total)

        def submit(actor, c: int):
            indices = intake.chunks[c]
            return actor.run.remote(job, indices, [intake.todo[i] for i in indices])

        def on_result(w: int, c: int, value: tuple[list[int], list]) -> None:
            indices, results = value
            self.notes(results)  # the steering's notes (e.g. it swamps the residual stream), once per run
            intake.store(indices, results)
            self._count(w, len(indices))

        try:
            while intake.all_cached() and not intake.over:  # no worker is needed (nor started) yet
                intake.take(POLL_IDLE)
            if not intake.all_cached():
                start_time += self._wait_time()
                dispatch([], self.pool, submit, on_result, more=intake.more)
        except WorkersLost as e:
            raise ClusterError(f"{e}: {intake.merge.count} of {total} {job.kind} requests finished; {self.stored.kept()}") from None
        finally:
            self.seconds += time.monotonic() - start_time
        if len(intake.todo) != total:
            raise RuntimeError(f"the head made {len(intake.todo)} {job.kind} requests where it announced {total}")
        return intake.merge.result()

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
        if self.stored.needs_ident():
            self.wait_ready()  # the cache keys need the workers' files
        start_time = time.monotonic()
        configs, owner = distinct(steerings)
        grid = _Grid(self, kind, configs, requests)
        try:
            if not grid.complete():  # else no worker is needed (nor started)
                start_time += self._wait_time()
                dispatch(grid.plan(), self.pool, grid.submit, grid.on_result)
        except WorkersLost as e:
            raise ClusterError(
                f"{e}: {grid.finished()} of {len(configs) * len(requests)} (configuration, request) {kind} results finished; "
                f"{self.stored.kept()}"
            ) from None
        finally:
            self.seconds += time.monotonic() - start_time
        results = [m.result() for m in grid.merges]
        return [list(results[o]) for o in owner]

    def _count(self, w: int, n: int, note: str = "") -> None:
        self.done[self.workers.names[w]] += n
        self.progress.advance(w, n, note)

    def info(self) -> dict:
        """What ran where; never waits for (or starts) workers: `workers` is 0 when every result was cached."""
        seconds, facts, cache = self.seconds or 1e-9, self.workers.facts or [], self.stored.cache
        return {
            "executor": "ray",
            "address": self.connection.address if self.connection is not None else None,
            "workers": len(self.pool.workers),  # groups, when grouped
            "workers_alive": len(self.pool.alive),
            "nodes": len({r["node_id"] for f in facts for r in f.get("ranks", [f])}),
            "requests_computed": dict(self.done),
            "requests_cached": self.stored.cached,
            "requests_per_s": {n: round(k / seconds, 2) for n, k in self.done.items()},
            "seconds": round(self.seconds, 3),
            "cache": str(cache.path) if cache is not None else None,
            "facts": facts,
            "prefix_store": self.pool.prefix_stores(),  # per worker (a group's: its rank 0's; every rank stores alike)
            **({"groups": self.groups()} if self.workers._formed is not None else {}),
        }

    def groups(self) -> list[dict]:
        """Per group: its split and ranks (node, layers held, peak memory now, seconds busy and waiting in pipelined jobs, when it can answer at once); how
        many times it was re-formed, why it was lost, and the chunks its current ranks finished."""
        pool, facts = self.pool, self.workers.facts or []
        if not isinstance(pool, groups.GroupPool):
            return []
        peaks, lost = pool.peaks(), {}
        for g, line in pool.losses:
            lost.setdefault(g, []).append(line)
        return [
            {"group": f["group"], "size": f.get("group_size"), "split": f.get("split"), "alive": g in pool.alive,
             "reformed": pool.reformed[g], "lost": lost.get(g, []), "chunks": pool.workers[g].chunks,
             "re_forming": pool.reforms[g].step if g in pool.reforms else None,  # place (waiting for nodes), address, form
             "ranks": [{**r, **peaks.get((g, r["rank_in_group"]), {})} for r in f["ranks"]]}
            for g, f in enumerate(facts)
        ]  # fmt: skip

    def close(self) -> None:
        self.progress.close()  # the run's progress bar ends before its results are printed
        self._finalizer()


class _Grid:
    """One `run_grid` call: a Merge per configuration with its cached cells, the chunks of the missing ones,
    and each chunk's results split back into its configurations' columns."""

    def __init__(self, ex: RayExecutor, kind: str, configs: list[Steering], requests: list) -> None:
        self.ex, self.kind, self.configs, self.requests = ex, kind, configs, requests
        n = len(requests)
        self.merges = [Merge(n) for _ in configs]
        self.keys: list[list[bytes]] = []
        if ex.stored.cache is not None and requests:
            self.keys = ex.stored.grid_keys(kind, configs, requests)
            for merge, row in zip(self.merges, self.keys):
                ex.stored.read(kind, merge, row)
        self.chunks: list[tuple[tuple[int, ...], list[int]]] = []
        self.done_configs = sum(m.count == n for m in self.merges)
        n_configs = len(configs)
        ex.progress.expect(n_configs * n, self.finished(), f"{kind} grid of {n_configs} configuration{'s' * (n_configs != 1)}")

    def complete(self) -> bool:
        return all(m.count == len(self.requests) for m in self.merges)

    def finished(self) -> int:
        return sum(m.count for m in self.merges)

    def plan(self) -> list[float]:
        """The chunks of every missing cell (kept in `chunks`), and their costs."""
        ex = self.ex
        costs, groups = request_costs(self.kind, self.requests, ex.max_length, ex.workers.batching.prefix_reuse)
        n_layers = ex.facts[0].get("n_layers") or 0
        self.chunks, chunk_costs = grid_chunks(
            self.configs, costs, groups, self.merges, workers=max(1, len(ex.pool.alive)), n_layers=n_layers,
            max_batch_tokens=ex.workers.batching.max_batch_tokens,
        )  # fmt: skip
        return chunk_costs

    def submit(self, actor, c: int):
        block, indices = self.chunks[c]
        job = Job(kind=self.kind, grid=tuple(self.configs[g] for g in block))
        return actor.run.remote(job, indices, [self.requests[i] for i in indices])

    def on_result(self, w: int, c: int, value: tuple[list[int], list]) -> None:
        indices, results = value
        block, n, encode = self.chunks[c][0], len(self.requests), encoder(self.kind)
        cells = []
        for j, g in enumerate(block):
            column = [r[j] for r in results]
            self.merges[g].add(indices, column)
            self.done_configs += self.merges[g].count == n
            if self.keys:
                cells.extend((self.keys[g][i], encode(r)) for i, r in zip(indices, column))
        if cells:
            self.ex.stored.store(cells)
        self.ex._count(w, len(indices) * len(block), f"configs {self.done_configs}/{len(self.configs)}")
