"""Cut requests into chunks, hand them to workers as they ask for work, and merge results by global index.

Pull-based: each worker holds at most `depth` chunks (one running, one queued behind it), so a fast Mac comes
back for more sooner and takes more chunks. Once the queue is empty, an idle worker runs a copy of the chunk
expected to finish last (a backup, as in MapReduce); the first copy to arrive wins and later ones are dropped.
A worker that dies gives its chunks back to the queue; it rejoins if Ray restarts it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster import Pool

PER_WORKER = 8  # a chunk's budget is at most 1/(PER_WORKER * workers) of the tokens left to cut
POLL = 0.02  # s between looks at the feed while chunks run (the head still tokenizing)
POLL_IDLE = 0.5  # s to wait on the feed when every chunk made so far is done


class WorkersLost(RuntimeError):
    """Every worker is gone: the run cannot finish."""


def cut(
    costs: Sequence[int],
    families: Sequence[Sequence[int]],
    *,
    workers: int,
    max_tokens: int,
    min_tokens: int,
    after: int = 0,
    per_worker: int = PER_WORKER,
) -> list[list[int]]:
    """Chunks of request indices: longest families first, a family whole unless it alone exceeds `max_tokens`.

    The budget of each chunk is a share of the tokens not yet cut, within [min_tokens, max_tokens]: chunks shrink
    toward the end of the queue, so the last ones finish close together even on uneven workers. `after`: tokens
    still to come in later pieces of a streamed run (the end of this piece is not the end of the queue).
    `per_worker`: chunks per worker the budget aims at (fewer for heavier chunks).
    """
    order = sorted(families, key=lambda f: -max(costs[i] for i in f))
    remaining = sum(costs) + after
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    budget = max_tokens

    def close() -> None:
        nonlocal current, used, budget
        if current:
            chunks.append(current)
        current, used = [], 0
        budget = max(min_tokens, min(max_tokens, math.ceil(remaining / (per_worker * workers))))

    close()
    for family in order:
        size = sum(costs[i] for i in family)
        if used and used + size > budget:
            close()
        for i in family:  # a family over max_tokens is split into budget-sized pieces, in order
            if used and used + costs[i] > budget and size > max_tokens:
                close()
            current.append(i)
            used += costs[i]
            remaining -= costs[i]
    close()
    return chunks


def gather(requests: Iterable, total: int | None) -> list:
    """`Executor.run`'s requests as one list: they are a list, or (with `total`) pieces of one."""
    if total is None:
        return list(requests)
    whole = [r for piece in requests for r in piece]
    if len(whole) != total:
        raise RuntimeError(f"{len(whole)} requests where {total} were announced")
    return whole


class Merge:
    """Results placed at their global index; each index exactly once."""

    def __init__(self, n: int):
        self.values: list[Any] = [None] * n
        self.filled = bytearray(n)
        self.count = 0

    def add(self, indices: Sequence[int], values: Sequence[Any]) -> None:
        assert len(indices) == len(values), f"{len(values)} results for {len(indices)} requests"
        for i, v in zip(indices, values):
            assert not self.filled[i], f"request {i} arrived twice"
            self.filled[i] = 1
            self.values[i] = v
        self.count += len(indices)

    def missing(self) -> list[int]:
        return [i for i, f in enumerate(self.filled) if not f]

    def result(self) -> list[Any]:
        missing = self.missing()
        assert not missing, f"{len(missing)} requests never arrived (first: {missing[:5]})"
        return self.values


class _Flight:
    """What dispatch knows between two results: chunks queued, in flight (per worker), done; worker speeds."""

    def __init__(self, costs: Sequence[float], pool: "Pool", submit: Callable) -> None:
        self.costs, self.pool, self.submit = list(costs), pool, submit
        self.start = time.monotonic()
        n = len(pool.workers)
        self.queue = list(range(len(costs)))[::-1]  # pop() takes the next chunk
        self.done = [False] * len(costs)
        self.copies = [0] * len(costs)  # copies in flight
        self.refs: dict[Any, tuple[int, int]] = {}  # ref -> (worker index, chunk index)
        self.held: list[list[int]] = [[] for _ in range(n)]  # chunks in flight per worker, in submission order
        self.since = [self.start] * n  # when each worker's first held chunk started running (at best)
        self.work = [0.0] * n  # cost finished per worker: its speed is work / elapsed

    def add(self, costs: Sequence[float]) -> None:
        """More chunks (numbered on from the last), queued behind those already waiting."""
        first = len(self.costs)
        self.costs.extend(costs)
        self.done.extend([False] * len(costs))
        self.copies.extend([0] * len(costs))
        self.queue[:0] = range(len(self.costs) - 1, first - 1, -1)

    def send(self, w: int, c: int) -> None:
        if not self.held[w]:
            self.since[w] = time.monotonic()
        self.refs[self.submit(self.pool.workers[w], c)] = (w, c)
        self.held[w].append(c)
        self.copies[c] += 1

    def speed(self, w: int) -> float:
        return self.work[w] / max(time.monotonic() - self.start, 1e-9) or 1e-9

    def backup_for(self, w: int) -> int | None:
        """The single-copy chunk expected to finish last, if a copy on idle worker w would finish sooner."""
        now, best, latest = time.monotonic(), None, 0.0
        for v in self.pool.alive:
            finish = self.since[v]
            for c in self.held[v]:
                finish += self.costs[c] / self.speed(v)
                if self.copies[c] == 1 and not self.done[c] and finish > latest:
                    best, latest = c, finish
        if best is not None and (self.work[w] == 0 or now + self.costs[best] / self.speed(w) < latest):
            return best
        return None

    def fill(self, depth: int, backups: bool = True) -> None:
        """Top every live worker up to `depth` chunks, one level at a time so work spreads evenly."""
        for level in range(1, depth + 1):
            for w in sorted(self.pool.alive):
                if len(self.held[w]) >= level:
                    continue
                while self.queue and self.done[self.queue[-1]]:
                    self.queue.pop()
                c = self.queue.pop() if self.queue else (self.backup_for(w) if backups and not self.held[w] else None)
                if c is not None:
                    self.send(w, c)

    def landed(self, ref: Any) -> tuple[int, int]:
        w, c = self.refs.pop(ref)
        self.held[w].remove(c)
        self.copies[c] -= 1
        return w, c

    def lost(self, w: int, c: int) -> None:
        """The worker died (or its node did): its chunk goes back to the queue unless a copy still runs."""
        self.pool.lost(w)
        if not self.done[c] and not self.copies[c]:
            self.queue.append(c)

    def finished(self, w: int, c: int) -> bool:
        """Record a result; True when it is the chunk's first copy."""
        self.since[w] = time.monotonic()
        self.work[w] += self.costs[c]
        first, self.done[c] = not self.done[c], True
        return first


def dispatch(
    costs: Sequence[float],
    pool: "Pool",
    submit: Callable[[Any, int], Any],
    on_result: Callable[[int, int, Any], None],
    *,
    depth: int = 2,
    revive_timeout: float = 600.0,
    more: Callable[[float], Sequence[float] | None] | None = None,
) -> None:
    """Run every chunk (chunk i costs `costs[i]`) once on some worker; `on_result(worker_index, chunk_index,
    value)` gets the first copy.

    `submit(worker, chunk_index)` returns a Ray object ref. `more(timeout)`, when given, is asked between results
    for chunks made meanwhile (the head still tokenizing): it returns the costs of chunks it appended to the
    caller's list (numbered on from the last), [] when none is ready yet, None once nothing more will come.
    Backups wait until the feed is over. Raises WorkersLost when no worker is left and none comes back within
    `revive_timeout` seconds; results already passed to `on_result` stay delivered.
    """
    import ray
    from ray.exceptions import RayActorError

    f = _Flight(costs, pool, submit)
    left = len(costs)
    feeding = more is not None
    while left or feeding:
        if feeding:
            new = more(0.0 if left else POLL_IDLE)
            if new is None:
                feeding = False
            else:
                f.add(new)
                left += len(new)
            if not left:
                continue
        f.fill(depth, backups=not feeding)
        if not f.refs and not pool.reviving:
            raise WorkersLost(pool.gone())
        timeout = _soonest((POLL if feeding else None) if f.refs else revive_timeout, pool.due())
        watched = pool.watched()  # a group's other ranks: first, so a rank's death is seen before rank 0's error
        ready, _ = ray.wait(list(watched) + list(f.refs) + list(pool.reviving), num_returns=1, timeout=timeout)
        if not ready:
            if f.refs or pool.due() is not None:
                pool.expire()  # a group past its deadline is killed: its chunks come back as lost (a re-forming one left lost)
                continue  # else only polling the feed
            raise WorkersLost(f"every worker is lost and none came back within {revive_timeout:.0f} s")
        ref = ready[0]
        if ref in watched:
            pool.settle(ref)
            continue
        if ref in pool.reviving:
            pool.back(ref)
            continue
        w, c = f.landed(ref)
        try:
            value = ray.get(ref)
        except RayActorError:
            f.lost(w, c)
            continue
        except Exception as e:  # a group's rank 0 whose ring broke (a peer died) lost its group; any other error stands
            if not pool.broken(w, e):
                raise
            f.lost(w, c)
            continue
        if f.finished(w, c):
            left -= 1
            on_result(w, c, value)
    for ref in f.refs:  # backups still running: their results are no longer needed (a group's just finish)
        pool.drop(ref)


def _soonest(*timeouts: float | None) -> float | None:
    """The smallest of the timeouts that are set; None (wait forever) when none is."""
    set_ = [t for t in timeouts if t is not None]
    return min(set_) if set_ else None


class Feed:
    """Pieces of work made by a background thread (the head tokenizing lm-eval's requests) while dispatch runs;
    the thread's error, if any, is raised by `take`."""

    _END = object()

    def __init__(self, pieces: Iterable[Any]) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._over = False
        self._thread = threading.Thread(target=self._produce, args=(pieces,), daemon=True, name="orchard-feed")
        self._thread.start()

    def _produce(self, pieces: Iterable[Any]) -> None:
        try:
            for piece in pieces:
                self._queue.put(piece)
            self._queue.put(self._END)
        except BaseException as e:  # handed to the consumer, which raises it in the main thread
            self._queue.put(e)

    def take(self, timeout: float) -> Any:
        """The next piece, waiting up to `timeout` s; None if none is ready yet; raises StopIteration at the end."""
        if self._over:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is self._END:
            self._over = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._over = True
            raise item
        return item
