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
import io
import os
import signal
import sys
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


def driver(*args, cwd: str | os.PathLike, env: dict[str, str | None] | None = None) -> Completed:
    """`driver ARGS` in `cwd`, in this process: (exit status, stdout, stderr) as the shell would see them.
    `env` sets (or, with None, removes) variables for the call only."""
    from driver.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    here = Path.cwd()
    code = 0
    _fresh_process()
    with _environment({"RAY_ADDRESS": None, **(env or {})}):
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                main.main(argv, prog_name="driver", standalone_mode=True)
        except SystemExit as e:
            code = _code(e)
        finally:
            os.chdir(here)
            signal.signal(signal.SIGTERM, handler)
            sys.stdout.flush()
    return Completed(["driver", *argv], code, out.getvalue(), err.getvalue())


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
