"""Results on disk, so an interrupted run resumes: one sqlite row per request, written as each chunk arrives.

A row's key is a hash of what decides the number (the model's identity: path or repo, revision, weights and
tokenizer files, adapter, dtype, max length, steering configuration) and of the request's token ids. Nothing
about who computed it (worker count, rank, node) is in it.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

FILE = "results.sqlite"


def identity(model: dict, steering: dict | None = None) -> bytes:
    """A digest of everything about the model that changes a number (`model`: plain JSON-able facts)."""
    blob = json.dumps({"model": model, "steering": steering or {}}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).digest()


def key(ident: bytes, kind: str, request: Any) -> bytes:
    """Key of one request: `kind` "loglikelihood" takes (context_ids, continuation_ids); "generate" a GenRequest."""
    h = hashlib.blake2b(ident, digest_size=16)
    h.update(kind.encode())
    if kind == "loglikelihood":
        context, continuation = request
        h.update(struct.pack(f"<{len(context)}q", *context) + b"|" + struct.pack(f"<{len(continuation)}q", *continuation))
    else:
        h.update(json.dumps(vars(request), sort_keys=True).encode())
    return h.digest()


class Cache:
    def __init__(self, directory: str | Path):
        self.path = Path(directory).expanduser() / FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS results (key BLOB PRIMARY KEY, value TEXT NOT NULL)")

    def get(self, keys: Sequence[bytes]) -> dict[bytes, Any]:
        found: dict[bytes, Any] = {}
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            rows = self.db.execute(f"SELECT key, value FROM results WHERE key IN ({','.join('?' * len(part))})", part)
            found.update((k, json.loads(v)) for k, v in rows)
        return found

    def put(self, items: Iterable[tuple[bytes, Any]]) -> None:
        """Store and commit (durable once this returns)."""
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?)", ((k, json.dumps(v)) for k, v in items))

    def close(self) -> None:
        self.db.close()
