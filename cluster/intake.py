"""Requests on their way to the workers: the result cache as the executor sees it (`Stored`), and one run's
pieces as the head hands them over (`Intake`), read from the cache and cut into chunks of what it lacks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from worker.spec import Job, Steering

from .schedule import Feed, Merge

# Results as the cache stores them (JSON) and back: capture arrays travel as nested lists.
ENCODE = {"capture": lambda a: a.tolist()}
DECODE = {"capture": lambda v: np.asarray(v, dtype=np.float32)}


def encoder(kind: str) -> Callable[[Any], Any]:
    """How a result of this kind is stored."""
    return ENCODE.get(kind, lambda v: v)


class Stored:
    """The result cache the executor is handed (None: none), seen through this model's identity: keys of its
    requests, cached results read into a Merge, new ones written. The cache object brings the key functions
    (`identity`, `job_prefix`, `keys`, `grid_keys`) and `get`, `put`, `remember`, `knows`, `close`, `path`."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.ident: bytes | None = None  # the model's identity, once known (from the head's files or the workers')
        self.cached = 0  # requests answered from the cache
        self._remembered = False

    def identify(self, model: dict) -> None:
        """The model's identity from its facts (nothing without a cache: nothing is keyed)."""
        if self.cache is not None:
            self.ident = self.cache.identity(model)

    def needs_ident(self) -> bool:
        """Whether keys cannot be made yet: a cache, and the workers' files still unknown."""
        return self.cache is not None and self.ident is None

    def holds_model(self) -> bool:
        """Whether the cache already holds results of this model (a rerun or a resumed run is likely)."""
        return self.ident is not None and self.cache is not None and self.cache.knows(self.ident)

    def prefix(self, job: Job) -> bytes:
        return self.cache.job_prefix(self.ident, job) if self.cache is not None else b""

    def grid_keys(self, kind: str, configs: list[Steering], requests: list) -> list[list[bytes]]:
        return self.cache.grid_keys(self.ident, kind, configs, requests)

    def read(self, kind: str, merge: Merge, keys: list[bytes], offset: int = 0) -> None:
        """Cached results of `keys` (requests offset, offset+1, ...) into `merge`."""
        hits = self.cache.get(keys, kind)  # a row that is not a result of this kind is left out: computed again
        found = [i for i, k in enumerate(keys) if k in hits]
        decode = DECODE.get(kind, lambda v: v)
        merge.add([offset + i for i in found], [decode(hits[keys[i]]) for i in found])
        self.cached += len(found)
        if found:
            self._remember()

    def store(self, items: Iterable[tuple[bytes, Any]]) -> None:
        self.cache.put(items)
        self._remember()

    def _remember(self) -> None:
        """Note in the cache that it holds this model's results (a later run then starts workers lazily)."""
        if not self._remembered:
            self.cache.remember(self.ident)
            self._remembered = True

    def kept(self) -> str:
        """Where finished work stays when a run fails."""
        if self.cache is not None:
            return f"they are cached in {self.cache.path.parent}: rerun the same command to resume"
        return "pass --cache DIR to keep finished work"


Cutter = Callable[..., list[tuple[list[int], int]]]  # cluster.plan.cut_piece with the executor's workers bound


class Intake:
    """One run's requests as the head hands them over, piece by piece: each piece read from the cache as it
    comes, and cut into chunks of what the cache lacks when `dispatch` asks for more."""

    def __init__(self, stored: Stored, progress: Any, cutter: Cutter, job: Job, feed: Feed, total: int) -> None:
        self.stored, self.progress, self.cutter = stored, progress, cutter
        self.kind, self.feed, self.total = job.kind, feed, total
        self.prefix = stored.prefix(job)
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
        offset, stored = len(self.todo), self.stored
        self.todo.extend(piece)
        self.waiting.append((offset, piece))
        if stored.cache is not None:
            before = self.merge.count
            self.keys.extend(stored.cache.keys(self.prefix, self.kind, piece))
            stored.read(self.kind, self.merge, self.keys[offset:], offset)
            self.progress.expect(0, self.merge.count - before, self.kind)

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
            new += self.cutter(self.kind, piece, at, filled, later=self.total - at - len(piece))
        self.waiting.clear()
        self.chunks.extend(indices for indices, _ in new)
        return [cost for _, cost in new]

    def store(self, indices: list[int], results: list) -> None:
        """Finished results into the merge and, with a cache, the cache."""
        self.merge.add(indices, results)
        if self.stored.cache is not None:
            encode = encoder(self.kind)
            self.stored.store((self.keys[i], encode(r)) for i, r in zip(indices, results))
