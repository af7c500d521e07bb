"""What an embedded Ray leaves on this machine, and how a command leaves none of it.

A Ctrl-C while `ray.init` starts it is answered at once: waiting for ray.init took 15-19 s on a busy machine,
and cutting it inside Python left its processes running and could leave `logging`'s lock held. Instead the
processes it started so far are killed, their session folder removed, and the process ends (exit 130). On a
normal exit the run's own `session_*` folder is removed after Ray shut down (one was left per run), and the first
embedded Ray of a machine creating `~/.ray/auth_token` is said once."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

_SESSION = re.compile(r"(/[^\s=,;:'\"]*/session_\d{4}-\d\d-\d\d_[\d-]+_\d+_\d+)")  # Ray's own session folder names


def _descendants() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _sessions_of(procs: list) -> set[str]:
    """The session folders the processes' command lines name."""
    import psutil

    found: set[str] = set()
    for p in procs:
        try:
            found.update(_SESSION.findall(" ".join(p.cmdline())))
        except psutil.Error:
            pass
    return found


def remove_session(folder: str | None) -> None:
    """A session folder (and `session_latest` when it points there); only a folder named as Ray names them."""
    if not folder or not _SESSION.fullmatch(folder):
        return
    shutil.rmtree(folder, ignore_errors=True)
    latest = Path(folder).parent / "session_latest"
    with contextlib.suppress(OSError):
        if latest.is_symlink() and os.readlink(latest) == folder:
            latest.unlink()


def end_now(before: frozenset[int] = frozenset(), doing: str = "") -> None:
    """Kill the processes this one started (but those in `before`), remove their session folders, exit 130 now."""
    import psutil

    for s in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C meanwhile changes nothing: this takes ~1 s at most
        signal.signal(s, signal.SIG_IGN)
    if doing:
        print(f"interrupted {doing}: stopping its processes; nothing was computed", file=sys.stderr, flush=True)
    started = [p for p in _descendants() if p.pid not in before]
    folders = _sessions_of(started)
    for p in started:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _until_gone(started)
    for folder in folders:
        remove_session(folder)
    _exit_now()


def _until_gone(procs: list, seconds: float = 1.0) -> None:
    """Until each killed process is gone or a zombie (nothing runs in one; an orphan's may stay one for good where
    nothing reaps it, which made psutil.wait_procs take all its timeout), `seconds` at most."""
    import psutil

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + seconds
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


def _exit_now() -> None:
    """os._exit(130): Ray's atexit shutdown (seconds) skipped, what was printed still shown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(130)


_INTERRUPTED = threading.Event()  # the CLI's Ctrl-C (or SIGTERM) came: Ray is ended by `exit_interrupted`


def interrupted(came: bool = True) -> None:
    """Note the CLI's Ctrl-C: from now on an embedded Ray is not shut down gracefully (9-13 s on a busy machine)
    but ended with the process (`exit_interrupted`), its results already cached. False: a new command starts."""
    _INTERRUPTED.set() if came else _INTERRUPTED.clear()


def ending() -> bool:
    return _INTERRUPTED.is_set()


def exit_interrupted() -> None:
    """The CLI's last step after a Ctrl-C, once its cache is closed and its line said: an embedded Ray's processes
    are killed (`end_now`); joined to a cluster, the process leaves without waiting for Ray's disconnect (the
    cluster notices, and keeps its processes). Either way, and with no Ray, it exits without the interpreter's
    last garbage collection (2-3 s of lm-eval's, MLX's and Ray's objects on a busy machine). Only after a Ctrl-C."""
    if not ending():
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and _embedded():
        end_now()
    _exit_now()


def _embedded() -> bool:
    """Whether this process started the Ray it is connected to (its head node), not joined a cluster."""
    import ray._private.worker as ray_worker

    return bool(getattr(getattr(ray_worker, "_global_node", None), "head", False))


@contextlib.contextmanager
def cut_at_once():
    """Run ray.init inside: on the main thread of a process whose SIGTERM is its own (the CLI's), a Ctrl-C or
    SIGTERM ends the process at once, leaving nothing of this Ray; elsewhere (a library caller) nothing changes."""
    if threading.current_thread() is not threading.main_thread() or not callable(signal.getsignal(signal.SIGTERM)):
        yield
        return
    before = frozenset(p.pid for p in _descendants())
    stop = lambda signum, frame: end_now(before, "while Ray was starting")  # noqa: E731
    held = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def token_told(say=lambda line: print(line, file=sys.stderr, flush=True)):
    """Say once, when the embedded Ray started inside creates `~/.ray/auth_token` (Ray >= 2.5x does, for token
    authentication of its sessions): a new file in the user's home should not appear without a word."""
    token = Path.home() / ".ray" / "auth_token"
    had = token.exists()
    yield
    if not had and token.exists() and os.environ.get("ORCHARD_QUIET", "") in ("", "0"):
        say(f"driver: Ray created {str(token).replace(str(Path.home()), '~', 1)} (its token for the Ray sessions of "
            "this machine, kept for the next ones; a cluster started by `ray start` here then asks for it)")


def folder() -> str | None:
    """This process's embedded Ray session folder, while it runs."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    try:
        return node.get_session_dir_path() if node is not None else None
    except AttributeError:
        return None
