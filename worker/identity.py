"""What a model is, by content: a full sha256 of every file that can change a number, remembered per file.

The result cache keys every number by the model's identity, so the identity must change whenever any byte of
the weights, an adapter, the tokenizer, the config or a chat template does. Hashing a large model takes a
while, so each file's digest is remembered in a small sqlite memo under the file's stat facts (resolved path,
size, mtime_ns, ctime_ns, inode, device): a file is read again only when one of them changes. ctime cannot be
set back by a user (`os.utime` restores mtime, not ctime), so rewriting bytes in place and restoring the
mtime still invalidates the entry. The memo is a cache and nothing more: a corrupt, locked or unwritable
memo is set aside or ignored and the digests are computed again.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MEMO_FILE = "file-hashes.sqlite"
CHUNK = 1 << 20
# A file changed less than this long ago may be changed again within the same timestamp tick (1-2 s on some
# filesystems) without its stat facts moving: its digest is computed but not remembered ("racy git").
RACY_NS = 2_000_000_000
# Files that can change a number: weights and adapters, configs, tokenizer files, chat templates, and the
# model code `trust_remote_code` would run.
SUFFIXES = frozenset({".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken", ".py", ".bpe", ".vocab"})


def memo_path() -> Path:
    """$ORCHARD_HOME/file-hashes.sqlite, else ~/.cache/orchard/file-hashes.sqlite ($XDG_CACHE_HOME honoured)."""
    home = os.environ.get("ORCHARD_HOME")
    if home:
        return Path(home).expanduser() / MEMO_FILE
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "orchard" / MEMO_FILE


def identity_files(folder: Path) -> list[Path]:
    """The files under `folder` that can change a number, sorted; hidden files and folders are skipped.

    (A file given instead of a folder is its own only identity file.)"""
    found: list[Path] = []
    if Path(folder).is_file():
        return [Path(folder)]

    def walk(d: Path) -> None:
        for entry in sorted(d.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                if not entry.is_symlink():  # a linked folder could loop
                    walk(entry)
            elif entry.is_file() and (entry.suffix in SUFFIXES or entry.name.startswith("tokenizer")):
                found.append(entry)

    walk(Path(folder))
    return found


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def sha256_file(path: Path) -> str:
    """The full-content sha256 of one file (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


class Memo:
    """sqlite table of (path -> stat facts, sha256); every failure degrades to 'not remembered'."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else memo_path()
        self.db: sqlite3.Connection | None = None
        self.lock = threading.Lock()  # one connection, shared by the hashing threads
        try:
            self.db = self._open()
        except (sqlite3.Error, OSError):
            self._set_aside()
            try:
                self.db = self._open()
            except (sqlite3.Error, OSError):
                self.db = None  # no memo this time: every file is hashed

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                "ctime_ns INTEGER, ino INTEGER, dev INTEGER, sha256 TEXT NOT NULL)"
            )
            db.execute("SELECT path, size, mtime_ns, ctime_ns, ino, dev, sha256 FROM files LIMIT 1").fetchall()
        except BaseException:
            db.close()
            raise
        return db

    def _set_aside(self) -> None:
        """Move a corrupt memo (and its WAL files) out of the way; another process may have done it already."""
        for suffix in ("", "-wal", "-shm"):
            p = Path(f"{self.path}{suffix}")
            try:
                if p.exists():
                    p.replace(Path(f"{p}.corrupt-{os.getpid()}"))
            except OSError:
                pass

    def get(self, path: str, stat_key: tuple) -> str | None:
        if self.db is None:
            return None
        try:
            with self.lock:
                row = self.db.execute(
                    "SELECT size, mtime_ns, ctime_ns, ino, dev, sha256 FROM files WHERE path = ?", (path,)
                ).fetchone()
        except sqlite3.Error:
            return None
        if row is None or tuple(row[:5]) != stat_key or not isinstance(row[5], str) or len(row[5]) != 64:
            return None
        return row[5]

    def put(self, path: str, stat_key: tuple, digest: str) -> None:
        if self.db is None:
            return
        try:
            with self.lock:
                self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (path, *stat_key, digest))
        except sqlite3.Error:
            pass  # locked for too long, read-only, disk full: only the memo is lost

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


def file_digest(path: Path, memo: Memo) -> tuple[int, str]:
    """(size, sha256) of one file, from the memo when its stat facts are unchanged; remembered when safe."""
    real = os.path.realpath(path)
    for _ in range(3):
        before = os.stat(real)
        key = _stat_key(before)
        hit = memo.get(real, key)
        if hit is not None:
            return before.st_size, hit
        digest = sha256_file(Path(real))
        after = os.stat(real)
        if _stat_key(after) != key:
            continue  # written while it was read: hash it again
        if time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_NS:
            memo.put(real, key, digest)
        return after.st_size, digest
    raise OSError(f"{path} keeps changing while it is hashed: wait until it is fully written")


def file_digests(folder: Path, memo: Memo | None = None) -> list[tuple[str, int, str]]:
    """(path relative to `folder`, size, sha256) for each identity file, in sorted order."""
    folder = Path(folder)
    files = identity_files(folder)
    own = memo is None
    memo = memo or Memo()
    try:
        with ThreadPoolExecutor(max_workers=min(4, max(1, len(files)))) as pool:  # sha256 releases the GIL
            digests = list(pool.map(lambda f: file_digest(f, memo), files))
    finally:
        if own:
            memo.close()
    base = folder if folder.is_dir() else folder.parent
    return [(f.relative_to(base).as_posix(), size, d) for f, (size, d) in zip(files, digests)]


def folder_identity(folder: Path, memo: Memo | None = None) -> str:
    """One digest of every identity file's name, size and full content (32 hex chars)."""
    h = hashlib.sha256(b"orchard-model-files-v2\n")
    for name, size, digest in file_digests(folder, memo):
        h.update(f"{name}\0{size}\0{digest}\n".encode())
    return h.hexdigest()[:32]
