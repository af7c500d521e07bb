"""Results on disk, so an interrupted run resumes: one sqlite row per request, written as each chunk arrives.

A row's key is a hash of what decides the number (the model's identity: path or repo, revision, weights and
tokenizer files, adapter, dtype, max length, steering configuration) and of the request's token ids. Nothing
about who computed it (worker count, rank, node) is in it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from worker.spec import Job, Steering

FILE = "results.sqlite"


def identity(model: dict) -> bytes:
    """A digest of everything about the model that changes a number (`model`: plain JSON-able facts)."""
    return hashlib.blake2b(json.dumps(model, sort_keys=True).encode(), digest_size=16).digest()


def _ids(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens)


def job_prefix(ident: bytes, job: Job) -> bytes:
    """What every key of one job starts from: the model, the kind, the steering (vectors by hash), the points."""
    h = hashlib.blake2b(ident, digest_size=16)
    h.update(job.key().encode())
    return h.digest()


def _request_bytes(kind: str, request: Any) -> bytes:
    if kind == "loglikelihood":
        context, continuation = request
        return _ids(context) + _ids(continuation)
    if kind == "generate":
        return json.dumps(asdict(request), sort_keys=True).encode()
    if kind == "capture":
        tokens, position = request
        return _ids(tokens) + struct.pack("<q", position)
    if kind == "patch":  # worker.patch.spec.PatchRequest: the pair's tokens, answers and cell
        return request.model_dump_json().encode()
    raise ValueError(f"no cache key for request kind {kind!r}")


def key(prefix: bytes, kind: str, request: Any) -> bytes:
    """Key of one request of a job, spelled out per kind:
    loglikelihood (context_ids, continuation_ids) · generate a GenRequest · capture (token_ids, position) · patch a
    PatchRequest."""
    h = hashlib.blake2b(prefix, digest_size=16)
    h.update(_request_bytes(kind, request))
    return h.digest()


def keys(prefix: bytes, kind: str, requests: Sequence[Any]) -> list[bytes]:
    """`[key(prefix, kind, r) for r in requests]`, faster: a loglikelihood context shared by several requests
    (MMLU's answer choices; one tuple object from the head's tokenizer) is packed and hashed once."""
    if kind != "loglikelihood":
        return [key(prefix, kind, r) for r in requests]
    base = hashlib.blake2b(prefix, digest_size=16)
    by_context: dict[int, Any] = {}  # id(context) -> the hash state after it (the contexts outlive this call)
    out = []
    for context, continuation in requests:
        state = by_context.get(id(context))
        if state is None:
            state = by_context[id(context)] = base.copy()
            state.update(_ids(context))
        h = state.copy()
        h.update(_ids(continuation))
        out.append(h.digest())
    return out


def grid_keys(ident: bytes, kind: str, steerings: Sequence[Steering], requests: Sequence[Any]) -> list[list[bytes]]:
    """[configuration][request] keys of a grid: each exactly `key(job_prefix(ident, Job(kind=kind, steering=s)),
    kind, request)`, so a grid's results serve later plain runs of each configuration and the other way round."""
    data = [_request_bytes(kind, r) for r in requests]
    out = []
    for steering in steerings:
        base = hashlib.blake2b(job_prefix(ident, Job(kind=kind, steering=steering)), digest_size=16)
        row = []
        for d in data:
            h = base.copy()
            h.update(d)
            row.append(h.digest())
        out.append(row)
    return out


_UNUSABLE = object()


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def usable(kind: str | None, value: Any) -> bool:
    """Whether a stored value is a result of `kind` as the workers return it: loglikelihood [finite float, bool],
    generate a text, capture finite numbers (nested lists); None: anything JSON."""
    conditional = {"loglikelihood": 3, "generate": 2}.get(kind)  # conditional steering: the result, then "fired"
    if isinstance(value, list) and len(value) == conditional and isinstance(value[-1], bool):
        value = value[:-1] if kind == "loglikelihood" else value[0]
    if kind == "loglikelihood":
        return isinstance(value, list) and len(value) == 2 and _finite(value[0]) and isinstance(value[1], bool)
    if kind == "generate":
        return isinstance(value, str)
    if kind == "patch":  # (value, clean_ld, corrupt_ld)
        return isinstance(value, list) and len(value) == 3 and all(_finite(x) for x in value)
    if kind == "capture":
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            return False
        return isinstance(value, list) and array.size > 0 and bool(np.isfinite(array).all())
    return True


def _parsed(text: Any, kind: str | None) -> Any:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return _UNUSABLE
    return value if usable(kind, value) else _UNUSABLE


class Cache:
    """One sqlite connection, usable from any thread one call at a time (a lock): the executor that holds it
    may be closed by its finalizer on whichever thread collects it (sqlite's own check would refuse that).
    The key functions are its methods too, so an executor handed a Cache (cluster.executor) makes its keys."""

    identity = staticmethod(identity)
    job_prefix = staticmethod(job_prefix)
    keys = staticmethod(keys)
    grid_keys = staticmethod(grid_keys)

    def __init__(self, directory: str | Path):
        from driver.checks.files import cache_problem

        self.path = Path(directory).expanduser() / FILE
        problem = cache_problem(self.path)  # a corrupt or foreign file: refused, never written to
        if problem:
            raise ValueError(problem)
        self.lock = threading.Lock()
        self.said_unusable = False
        self.db: sqlite3.Connection | None = None
        self.closed = False
        if self.path.exists():
            self._open()

    def _open(self) -> sqlite3.Connection:
        """The connection; the folder, file and tables are made at the first write (a run refused before it
        writes anything, e.g. a worker refusing damaged weights, leaves no empty results.sqlite behind)."""
        if self.db is None:
            if self.closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")  # as sqlite says once opened
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS results (key BLOB PRIMARY KEY, value TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS models (identity BLOB PRIMARY KEY)")  # whose results are here
            self.db = db
        return self.db

    def _reader(self) -> sqlite3.Connection | None:
        """The connection for a read, None while no file exists (nothing is stored; another process may make one)."""
        return self._open() if self.db is not None or self.closed or self.path.exists() else None

    def get(self, keys: Sequence[bytes], kind: str | None = None) -> dict[bytes, Any]:
        """The stored results of `keys`. A row that is not JSON, or (given the requests' `kind`) not a result of
        that kind or not finite, is no result: it is deleted, said once on stderr, and so computed again."""
        found: dict[bytes, Any] = {}
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            with self.lock:
                db = self._reader()
                if db is None:
                    return found
                rows = db.execute(f"SELECT key, value FROM results WHERE key IN ({','.join('?' * len(part))})", part).fetchall()
            bad = []
            for k, v in rows:
                value = _parsed(v, kind)
                if value is _UNUSABLE:
                    bad.append(k)
                else:
                    found[k] = value
            if bad:
                self._drop(bad, kind)
        return found

    def _drop(self, keys: list[bytes], kind: str | None) -> None:
        with self.lock, self._open() as db:
            db.executemany("DELETE FROM results WHERE key = ?", [(k,) for k in keys])
        if not self.said_unusable:
            self.said_unusable = True
            what = f"{kind} result" if kind else "result"
            print(f"note: {len(keys)} row(s) of the result cache {self.path} are not a usable {what} (not JSON, the wrong "
                  "type, or NaN/inf): computing them again", file=sys.stderr)  # fmt: skip

    def put(self, items: Iterable[tuple[bytes, Any]]) -> None:
        """Store and commit (durable once this returns)."""
        rows = [(k, json.dumps(v)) for k, v in items]
        if not rows:
            return  # nothing to write: no file made for it
        with self.lock, self._open() as db:
            db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?)", rows)

    def remember(self, model: bytes) -> None:
        """Note that results of the model with this `identity` are stored here."""
        with self.lock, self._open() as db:
            db.execute("INSERT OR IGNORE INTO models VALUES (?)", (model,))

    def knows(self, model: bytes) -> bool:
        """Whether results of this model were stored here (a rerun or a resumed run is likely)."""
        with self.lock:
            db = self._reader()
            return db is not None and db.execute("SELECT 1 FROM models WHERE identity = ?", (model,)).fetchone() is not None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.db is not None:
                self.db.close()
