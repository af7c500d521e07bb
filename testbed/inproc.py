"""`driver ARGS` run in this process, as `python -m driver ARGS` runs it, for tests whose subject is not the process.

The real entry point is `driver.cli.main` in click's standalone mode (one `Error:` line, exit 2 or 1, no
traceback): this calls exactly that and catches its `SystemExit`, with stdout and stderr captured, the working
folder and environment variables set for the call and put back after, and the SIGTERM handler the CLI installs
(`driver.lm.quiet`) restored. Connected to a Ray cluster (the session's `ray_cluster`), the command joins it and
leaves it running: pass that cluster's address as `--address` where a subprocess would pass `local`, so no
embedded Ray is started and stopped per call, and lm-eval, MLX and Ray are imported once per session.

What stays a subprocess: tests of the process itself (its exit status as the shell sees it, signals, the
process tree, the embedded Ray's start and stop, a fresh environment, hidden PyTorch)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Completed:
    """What `subprocess.run(..., capture_output=True, text=True)` returns, for the fields tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _environment(env: dict[str, str | None]):
    before = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1


def session_address() -> str:
    """The address of the Ray cluster this process is connected to (the session's `ray_cluster`): `--address` for
    a command run here, which then joins it instead of starting an embedded Ray."""
    import ray

    return ray.get_runtime_context().gcs_address


def _fresh_process() -> None:
    """What a new process starts without: the warnings `driver` prints once per process (driver.steering.spec)."""
    from driver.steering import spec

    spec._WARNED.clear()


@contextlib.contextmanager
def _captured():
    """Everything the command writes to stdout and stderr, as a subprocess's pipes would get it: file descriptors 1
    and 2 point at files for the block (Ray's C++ core and other native code write there), `sys.stdout` and
    `sys.stderr` write to them, and so do the logging handlers that were made with the previous streams."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    files = [tempfile.TemporaryFile() for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    streams = [open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False) for fd in (1, 2)]  # noqa: SIM115
    old = {id(sys.stdout): streams[0], id(sys.__stdout__): streams[0], id(sys.stderr): streams[1], id(sys.__stderr__): streams[1]}
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()] for h in getattr(lg, "handlers", [])]
    # (logging's last-resort handler reads sys.stderr when it writes: redirected with it)
    streaming = [h for h in dict.fromkeys(handlers) if isinstance(h, logging.StreamHandler) and not isinstance(h, logging._StderrHandler)]
    moved = [(h, h.stream) for h in streaming if id(h.stream) in old]
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    for h, stream in moved:
        h.setStream(old[id(stream)])
    texts: list[str] = []
    try:
        with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
            yield texts
    finally:
        for h, stream in moved:
            h.setStream(stream)
        for fd, stream, keep in zip((1, 2), streams, saved):
            stream.flush()
            os.dup2(keep, fd)
            os.close(keep)
        for f in files:
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
            f.close()


def driver(*args, cwd: str | os.PathLike, env: dict[str, str | None] | None = None) -> Completed:
    """`driver ARGS` in `cwd`, in this process: (exit status, stdout, stderr) as the shell would see them.
    `env` sets (or, with None, removes) variables for the call only."""
    from driver.cli import main

    argv = [str(a) for a in args]
    handler = signal.getsignal(signal.SIGTERM)
    here = Path.cwd()
    code = 0
    _fresh_process()
    with _environment({"RAY_ADDRESS": None, **(env or {})}):
        os.chdir(cwd)
        try:
            with _captured() as texts:
                main.main(argv, prog_name="driver", standalone_mode=True)
        except SystemExit as e:
            code = _code(e)
        finally:
            os.chdir(here)
            signal.signal(signal.SIGTERM, handler)
    return Completed(["driver", *argv], code, *texts)


@contextlib.contextmanager
def disconnected():
    """This process not connected to Ray in the block, reconnected after it to the cluster it was connected to."""
    import logging

    import ray

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
