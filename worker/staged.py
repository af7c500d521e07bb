"""A node's local store of staged model folders, written piece by piece and verified (no Ray here).

`driver stage` (cluster.stage) copies a model onto every `mlx` node before a run; this module is the node's
side of it. A staged model lives in `$ORCHARD_HOME/models/<name>-<content id[:16]>/` (ORCHARD_HOME as
worker.identity picks it: else ~/.cache/orchard). Its content id is the sha256 of its manifest: every
identity file of the source folder (worker.identity: weights, configs, tokenizer, templates, code), each with
its relative path, size and full sha256. The staged folder therefore has the source's `fingerprint`: the
result cache sees the same model whether a worker loads the original or the staged copy.

Bookkeeping stays under the folder's hidden `.orchard/` (never part of the fingerprint, never read by mlx-lm):
the manifest, `partial/<file>` (a file being written, at its final size, holes where pieces are missing),
`journal/<file>` (the pieces written so far and each one's sha256, one line each, appended after the piece
is on disk), and `complete` (the content id, written once every file is verified). A file moves into the
model folder only when its full sha256 matches, so the model folder never holds a wrong byte for long.

Any number of writers may share one store (the nodes of `driver cluster up` on one machine, two `driver stage`
runs at once): every change to a staged folder happens under an exclusive lock on its `.orchard/lock` (fcntl),
small files are written under unique temporary names and renamed into place, and a writer that finds a file
already finished by another takes it as done.

Resuming: every journaled piece of a partial file is hashed again; good pieces are kept, the rest are asked
for. A finished file that no longer matches its sha256 is moved back to `partial/` and checked the same way,
so a flipped byte costs one piece, not the whole file.

A worker refers to a staged model by the model string `staged:<content id>` (`ModelSpec(model=...)`);
`resolve(model)` turns it into the local folder (or None for any other model string) and `staged_path`
raises StageError, in one line, when this node does not hold it complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .identity import Memo, file_digest, file_digests, memo_path, sha256_file

PIECE = 64 << 20  # bytes per piece: each is one Ray object, and macOS caps the object store at 2 GiB
PREFIX = "staged:"
STATE = ".orchard"
_VERSION = "orchard-stage-v1"


class StageError(RuntimeError):
    """Staging cannot go on (disk space, a model not staged here, a source that changed); one line."""


# --- the manifest and its content id ----------------------------------------------------------------------------


def manifest(folder: Path) -> list[dict]:
    """[{path, size, sha256}] of the folder's identity files, sorted; digests from worker.identity's memo."""
    return [{"path": rel, "size": size, "sha256": digest} for rel, size, digest in file_digests(Path(folder))]


def content_id(entries: list[dict]) -> str:
    """sha256 (64 hex) of the canonical manifest: the same files with the same bytes give the same id."""
    rows = sorted((e["path"], int(e["size"]), e["sha256"]) for e in entries)
    text = json.dumps({"version": _VERSION, "files": rows}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def store_root() -> Path:
    """$ORCHARD_HOME/models, else ~/.cache/orchard/models (beside worker.identity's memo)."""
    return memo_path().parent / "models"


def folder_for(name: str, cid: str, root: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "model"
    return Path(root or store_root()) / f"{safe[:80]}-{cid[:16]}"


def host() -> str:
    return socket.gethostname()


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One writer at a time in a staged folder, across processes (an exclusive flock, released on close)."""
    state = Path(folder) / STATE
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def write_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: a unique temporary file renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- what a node lacks ------------------------------------------------------------------------------------------


def n_pieces(size: int, piece_size: int) -> int:
    return -(-size // piece_size)


def _piece_len(size: int, index: int, piece_size: int) -> int:
    return min(piece_size, size - index * piece_size)


def _paths(folder: Path, rel: str) -> tuple[Path, Path, Path]:
    """(final, partial, journal) for one manifest file."""
    return folder / rel, folder / STATE / "partial" / rel, folder / STATE / "journal" / rel


def _header(entry: dict, piece_size: int) -> str:
    return json.dumps({"size": entry["size"], "sha256": entry["sha256"], "piece_size": piece_size}, sort_keys=True)


def _journal(path: Path, entry: dict, piece_size: int) -> dict[int, str] | None:
    """Journaled pieces {index: sha256}, or None when there is no journal for this very file and piece size."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if not lines or lines[0] != _header(entry, piece_size):
        return None
    pieces = {}
    for line in lines[1:]:  # a torn last line (killed mid-append) is skipped
        index, _, digest = line.partition(" ")
        if index.isdigit() and len(digest) == 64:
            pieces[int(index)] = digest
    return pieces


def _good_pieces(partial: Path, entry: dict, journal: dict[int, str], piece_size: int) -> dict[int, str]:
    """The journaled pieces whose bytes in the partial file still hash as journaled."""
    good = {}
    with open(partial, "rb") as f:
        for index, digest in sorted(journal.items()):
            if index >= n_pieces(entry["size"], piece_size):
                continue
            f.seek(index * piece_size)
            if hashlib.sha256(f.read(_piece_len(entry["size"], index, piece_size))).hexdigest() == digest:
                good[index] = digest
    return good


def _start_over(partial: Path, journal: Path, entry: dict, piece_size: int, keep: dict[int, str]) -> None:
    """A partial file at its final size (holes are free) and a journal listing only the pieces in `keep`."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "ab") as f:
        f.truncate(entry["size"])
    lines = [_header(entry, piece_size)] + [f"{i} {d}" for i, d in sorted(keep.items())]
    write_atomic(journal, "\n".join(lines) + "\n")


def file_needs(folder: Path, entry: dict, piece_size: int = PIECE, memo: Memo | None = None) -> list[int]:
    """The piece indices this node still needs for one manifest file ([] when its verified copy is in place)."""
    final, partial, journal_path = _paths(folder, entry["path"])
    if final.is_file() and final.stat().st_size == entry["size"]:
        if file_digest(final, memo or Memo())[1] == entry["sha256"]:
            partial.unlink(missing_ok=True)  # left by an adopted Hub file
            return []
    if final.exists() or final.is_symlink():  # wrong bytes: check it piece by piece, as a partial file
        partial.parent.mkdir(parents=True, exist_ok=True)
        final.replace(partial)
    journal = _journal(journal_path, entry, piece_size)
    keep = {}
    if journal and partial.is_file() and partial.stat().st_size == entry["size"]:
        keep = _good_pieces(partial, entry, journal, piece_size)
    elif partial.exists():
        partial.unlink()
    _start_over(partial, journal_path, entry, piece_size, keep)
    needed = [i for i in range(n_pieces(entry["size"], piece_size)) if i not in keep]
    if not needed:  # every piece is there (or the file is empty): verify and move it into place
        finalize(folder, entry)
    return needed


def needs(folder: Path, entries: list[dict], cid: str, piece_size: int = PIECE) -> dict[str, list[int]]:
    """{path: piece indices still needed} for every manifest file (empty lists for files in place).

    Writes the manifest first, and marks the folder complete when nothing is missing."""
    state = folder / STATE
    with locked(folder):
        write_atomic(state / "manifest.json", json.dumps({"content_id": cid, "files": entries}, indent=1))
        memo = Memo()
        try:
            missing = {e["path"]: file_needs(folder, e, piece_size, memo) for e in entries}
        finally:
            memo.close()
        if any(missing.values()):
            (state / "complete").unlink(missing_ok=True)
        else:
            mark_complete(folder, cid)
    return missing


def bytes_needed(entries: list[dict], missing: dict[str, list[int]], piece_size: int = PIECE) -> int:
    sizes = {e["path"]: e["size"] for e in entries}
    return sum(_piece_len(sizes[rel], i, piece_size) for rel, idx in missing.items() for i in idx)


def free_bytes(folder: Path) -> int:
    """Free space on the disk that holds `folder` (or its nearest existing parent)."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(folder: Path, need: int, free: int, name: str) -> None:
    """A one-line refusal when the pieces still to come do not fit (holes in partial files take no space)."""
    if need > free:
        raise StageError(
            f"{host()}: not enough disk space to stage {name}: {need / 1e6:.1f} MB needed in {folder.parent}, "
            f"{free / 1e6:.1f} MB free (free some space, or point ORCHARD_HOME at a larger disk on that node)"
        )


# --- writing pieces ---------------------------------------------------------------------------------------------


def write_piece(folder: Path, entry: dict, index: int, data, digest: str, piece_size: int = PIECE) -> bool:
    """Write one verified piece at its offset and journal it; False (nothing written) when `data` does not hash
    to `digest` (damaged on the way: the head sends it again). Finalizes the file after its last piece."""
    view = memoryview(data).cast("B")
    if len(view) != _piece_len(entry["size"], index, piece_size) or hashlib.sha256(view).hexdigest() != digest:
        return False
    with locked(folder):
        _write_piece(folder, entry, index, view, digest, piece_size)
    return True


def _write_piece(folder: Path, entry: dict, index: int, view: memoryview, digest: str, piece_size: int) -> None:
    final, partial, journal = _paths(folder, entry["path"])
    if not partial.is_file():
        if final.is_file() and final.stat().st_size == entry["size"]:
            return  # another writer of this store finished the file (its sha256 was checked then)
        _start_over(partial, journal, entry, piece_size, {})
    fd = os.open(partial, os.O_WRONLY)
    try:
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], index * piece_size + written)
        os.fsync(fd)  # on disk before the journal says so
    finally:
        os.close(fd)
    with open(journal, "a") as f:
        f.write(f"{index} {digest}\n")
    done = _journal(journal, entry, piece_size) or {}
    if len(done.keys() & set(range(n_pieces(entry["size"], piece_size)))) == n_pieces(entry["size"], piece_size):
        finalize(folder, entry)


def finalize(folder: Path, entry: dict) -> None:
    """Move a fully written file into the model folder, only if its full sha256 matches the manifest."""
    final, partial, journal = _paths(folder, entry["path"])
    if sha256_file(partial) != entry["sha256"]:
        partial.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        raise StageError(
            f"{host()}: {entry['path']} arrived complete but its sha256 does not match the manifest "
            "(did the file change on the head while staging?): run `driver stage` again"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    partial.replace(final)  # the journal stays: a later damaged byte is found piece by piece


def adopt(folder: Path, entries: list[dict], snapshot: Path) -> int:
    """Files of a local snapshot (the node's own Hub download) whose size and sha256 are the manifest's, linked
    (else copied) into place; returns how many. The rest still come from the head."""
    with locked(folder):
        return _adopt(folder, entries, snapshot)


def _adopt(folder: Path, entries: list[dict], snapshot: Path) -> int:
    memo, adopted = Memo(), 0
    try:
        for e in entries:
            final, src = folder / e["path"], Path(snapshot) / e["path"]
            if final.is_file() or not src.is_file() or src.stat().st_size != e["size"]:
                continue
            if file_digest(src, memo)[1] != e["sha256"]:
                continue  # another revision than the head's
            tmp = folder / STATE / "adopt" / f"{e['path']}.{os.getpid()}"  # unique: another process may adopt too
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)
            try:
                os.link(os.path.realpath(src), tmp)
            except OSError:  # another disk than the Hub cache's
                shutil.copyfile(src, tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp.replace(final)
            adopted += 1
    finally:
        memo.close()
    return adopted


def mark_complete(folder: Path, cid: str) -> None:
    write_atomic(folder / STATE / "complete", cid + "\n")


def finish(folder: Path, cid: str) -> None:
    """Mark the folder complete once every manifest file is in place; StageError (one line) if one is not."""
    with locked(folder):
        if not present(folder):
            raise StageError(f"{host()}: {folder} is still incomplete after staging: run `driver stage` again")
        mark_complete(folder, cid)


def present(folder: Path) -> bool:
    """Every manifest file is in place at its size (sha256 was checked when each one arrived)."""
    try:
        info = json.loads((folder / STATE / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return all((folder / e["path"]).is_file() and (folder / e["path"]).stat().st_size == e["size"] for e in info["files"])


# --- the worker's side: which folder is `staged:<id>` ----------------------------------------------------------


def staged_path(cid: str, root: Path | None = None) -> Path:
    """The complete local folder of a staged model; StageError (one line) when this node does not hold it."""
    if not re.fullmatch(r"[0-9a-f]{16,64}", cid or ""):
        raise StageError(f"staged:{cid} is not a staged model id (staged:<64 hex digits>, as `driver stage` prints it)")
    base = Path(root or store_root())
    for folder in sorted(base.glob(f"*-{cid[:16]}")) if base.is_dir() else []:
        try:
            done = (folder / STATE / "complete").read_text().strip()
        except OSError:
            continue
        if done.startswith(cid) and present(folder):
            return folder
    raise StageError(
        f"{host()} does not hold staged:{cid[:16]} complete under {base}: run `driver stage --model ...` against "
        "this cluster first"
    )


def resolve(model: str) -> Path | None:
    """`staged:<content id>` -> the local folder (StageError if absent); None for any other model string."""
    if not model.startswith(PREFIX):
        return None
    return staged_path(model[len(PREFIX) :].strip())
