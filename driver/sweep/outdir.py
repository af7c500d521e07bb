"""One writer per sweep output folder (an flock on OUTPUT/.sweep.lock), and the outputs a sweep writes there.

The lock is `fcntl.flock` on a file that is never deleted: the kernel releases it when its holder exits, however
it exits, so a lock file left by a killed sweep is never "stale". A rerun into a used folder replaces exactly
the files `driver sweep` writes (OUTPUTS) once its new outputs are written; the result cache and anything else
in the folder stay.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".sweep.lock"
OUTPUTS = ("results.csv", "results.jsonl", "generations.jsonl", "samples.jsonl", "steerability.csv", "summary.md", "run.json",
           "plots/heatmap-*.png", "plots/lines-*.png", "plots/heads-*.png", "plots/steerability-*.png", "plots/pareto-*.png",
           "lm-eval/*.json")  # fmt: skip


class FolderBusy(RuntimeError):
    """Another sweep is writing to the folder."""


def _busy(folder: Path) -> FolderBusy:
    return FolderBusy(
        f"--output {folder}: another sweep is writing to this folder (it holds {folder / LOCK_NAME}); "
        "wait for it to finish, or give another --output"
    )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def refuse_if_busy(folder: str | os.PathLike) -> None:
    """Fail fast, writing nothing, if a running sweep holds `folder`'s lock (checked again by `lock`)."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: no sweep has written here
        return
    try:
        if not _try_lock(fd):
            raise _busy(Path(folder))
    finally:
        os.close(fd)  # closing releases a lock taken here


def lock(folder: str | os.PathLike) -> int:
    """Take `folder`'s writer lock (creating the folder); returns the fd that holds it until `unlock` or exit."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    if not _try_lock(fd):
        os.close(fd)
        raise _busy(folder)
    return fd


def unlock(fd: int) -> None:
    os.close(fd)


def stale_outputs(folder: str | os.PathLike, written: set[Path]) -> list[Path]:
    """This command's output files in `folder` that the latest sweep did not write (a previous sweep's)."""
    folder = Path(folder)
    found = {p for pattern in OUTPUTS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found - {Path(p) for p in written})


def remove_stale(folder: str | os.PathLike, written: set[Path]) -> list[Path]:
    removed = stale_outputs(folder, written)
    for p in removed:
        p.unlink(missing_ok=True)
    return removed
