"""The files and folders a command will write: output folders, output files, and the result cache file."""

from __future__ import annotations

import os
import secrets
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

from driver.checks.errors import BadUsage, Refused

CACHE_FILE = "results.sqlite"


# --- folders we will write ----------------------------------------------------------------------------------------


def writable_folder(path: str | os.PathLike, flag: str) -> Path:
    """`path` is a folder or can become one, and this user can write there. Creates nothing."""
    if not str(path).strip():  # lm-eval reads an empty output path as none: its results would not be written
        raise BadUsage(f"{flag} is empty: give a folder (e.g. orchard-out)")
    p = probe = Path(path).expanduser()
    try:
        if p.exists():
            if not p.is_dir():
                raise Refused(f"{flag} {path}: a file is in the way (give a folder)")
            probe = p
        else:
            probe = p.parent
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not probe.is_dir():
                raise Refused(f"{flag} {path}: {probe} is a file, not a folder")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise Refused(f"{flag} {path}: cannot write in {probe} ({e.strerror or type(e).__name__}): choose a writable folder") from None
    return p


def writable_file(path: str | os.PathLike, flag: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise Refused(f"{flag} {path}: a folder is in the way (give a file name such as vectors.safetensors)")
    writable_folder(p.parent if str(p.parent) else ".", flag)
    return p


# --- outputs, written atomically ---------------------------------------------------------------------------------


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` atomically (see write_atomic_with); str is written as UTF-8."""
    payload = data.encode() if isinstance(data, str) else data
    return write_atomic_with(path, lambda tmp: Path(tmp).write_bytes(payload))


def write_atomic_with(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temp file beside `path`, which then replaces `path` in one rename (parents created).

    The temp file is created with mode 0666 less the umask, as open() would make `path` itself (mkstemp's 0600
    would leave outputs unreadable to the group the umask allows). A failure leaves neither `path` half-written
    nor the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_temp(path)
    try:
        mode = tmp.stat().st_mode
        write(tmp)
        os.chmod(tmp, mode)  # a writer that makes its own file (safetensors' save_file: 0600) gets the umask's mode
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the output
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _fresh_temp(path: Path) -> Path:
    """An empty new file beside `path`, its mode 0666 less the umask (the kernel applies the umask)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


# --- the result cache ---------------------------------------------------------------------------------------------


def cache_problem(path: str | os.PathLike) -> str | None:
    """Why `path` (a results.sqlite) cannot be used as Orchard's result cache, or None (absent or fine).

    Opened read-only: nothing is created or changed here."""
    p = Path(path)
    if not p.exists():
        return None
    move = "move it away (Orchard never overwrites it) or pass --cache another folder"
    if not p.is_file():
        return f"{p} is not a file: {move}"
    try:
        db = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            columns = [(c[1], c[2].upper()) for c in db.execute("PRAGMA table_info(results)")]
        finally:
            db.close()
    except sqlite3.Error as e:
        return f"{p} is not an Orchard result cache ({e}): {move}"
    if not tables:
        return None  # an empty database: Orchard creates its table
    if "results" not in tables or columns != [("key", "BLOB"), ("value", "TEXT")]:
        found = ", ".join(sorted(tables)) or "none"
        return f"{p} is another program's database, not an Orchard result cache (tables: {found}): {move}"
    return None


def check_cache(folder: str | os.PathLike, flag: str) -> None:
    writable_folder(folder, flag)
    problem = cache_problem(Path(folder).expanduser() / CACHE_FILE)
    if problem:
        raise Refused(problem)
