"""A Ctrl-C while the embedded Ray starts (issue 29.7): nothing of that Ray is left once the process has exited.

ray.init cut halfway swallowed the interrupt, left `logging`'s lock held (the command then hung for good on its
next log call) or left Ray's processes behind for 1-2 minutes; cluster.connect._init now holds the signal until
ray.init returns, shuts Ray down, then lets it act. A real process (the subject is its exit): it connects as the
CLI does and sends itself SIGINT as soon as its raylet has started (ray.init under way, the agents next); its own
RAY_TMPDIR tells its Ray's processes from everyone else's. Before the fix: 2 agents left for minutes in 1 of 2 tries,
1 process at exit in the other (gone within 3 s), and one `driver run` hung for good on the lock."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testbed.waiting import until, until_empty

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from driver.lm import quiet
    quiet.install()  # the CLI's handlers: SIGTERM acts as Ctrl-C
    from cluster.connect import connect

    def interrupt_once_ray_starts():  # its raylet started: the agents it starts come next
        while not list((Path(os.environ["RAY_TMPDIR"]) / "ray").glob("session_2*/logs/raylet.out")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_ray_starts, daemon=True).start()
    try:
        connect("local", local_workers=1)
        time.sleep(30)  # (not interrupted at all: the test fails on the exit status)
    except KeyboardInterrupt:
        import ray, logging
        logging.getLogger("probe").warning("logging still works")  # a held lock would hang here
        print("interrupted; ray initialized:", ray.is_initialized(), flush=True)
        sys.exit(130)
""")


def _ray_pids(tmp: Path) -> dict[int, str]:
    """{pid: command line} of the processes whose command line names `tmp` (Ray's session folder lives there)."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode() if p.name.isdigit() else ""
        except OSError:
            continue
        if str(tmp) in cmd:
            out[int(p.name)] = cmd[:120]
    return out


def _ray_processes(tmp: Path) -> list[str]:
    return list(_ray_pids(tmp).values())


def test_a_ctrl_c_while_ray_starts_leaves_nothing_of_it(tmp_path):
    tmp = Path(f"/tmp/orchard-sigint-{os.getpid()}")  # short: Ray's socket paths must stay under 107 bytes
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))}
    env = {k: v for k, v in env.items() if not k.startswith(("RAY_ADDRESS", "PYTEST_"))}
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 130, proc.stdout + proc.stderr
        # issue 38: the process ends at once, with the processes started so far killed (cluster.embedded.session)
        assert "interrupted while Ray was starting" in proc.stderr and "ray initialized" not in proc.stdout, proc.stderr
        assert until_empty(lambda: _ray_processes(tmp)) == []  # a process Ray has just signalled may take a moment to go
    finally:  # a failed run's leftovers: this test's own processes, found by its own folder, killed by id
        for pid in _ray_pids(tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


# --- issue 38.2: one Ctrl-C is enough at every phase -----------------------------------------------------------------

# `driver` itself, with ray.shutdown leaving a mark: a graceful shutdown of the embedded Ray took 9-13 s after the
# first Ctrl-C; now its processes are killed as the process exits (cluster.embedded.session.exit_interrupted).
DRIVER = textwrap.dedent("""
    import os, sys
    sys.argv[0] = "driver"  # as the console script: its early Ctrl-C handling too
    import ray
    graceful = ray.shutdown
    def marked(*args, **kwargs):
        open(os.environ["SHUTDOWN_MARK"], "w").close()
        return graceful(*args, **kwargs)
    ray.shutdown = marked
    from driver.cli import main
    main()
""")


def _rows(cache: Path) -> int:
    import sqlite3

    if not cache.is_file():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{cache}?mode=ro", uri=True)) as db:
            return db.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.Error:  # its tables not made yet
        return 0


@pytest.mark.slow  # a whole embedded Ray and worker (~80 s at load 20), interrupted once it cached results
def test_one_ctrl_c_while_computing_ends_ray_at_once_and_keeps_the_cache(tmp_path):
    """A demo interrupted once, some results cached: exit 130 naming the cache, Ray never shut down gracefully (what
    took 9-13 s), none of its processes or session folders left, the cache readable with at least what it held."""
    from driver.lm.cache import FILE

    tmp = Path(f"/tmp/orchard-sigint1-{os.getpid()}")  # short: Ray's socket paths must stay under 107 bytes
    tmp.mkdir(exist_ok=True)
    mark, cache = tmp_path / "shutdown-called", tmp_path / "demo" / "out" / "cache" / FILE
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "SHUTDOWN_MARK": str(mark), "ORCHARD_QUIET": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith(("RAY_ADDRESS", "PYTEST_"))}
    command = [sys.executable, "-c", DRIVER, "demo", "--workers", "1", "--dir", str(tmp_path / "demo")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        held = until(lambda: _rows(cache) or proc.poll() is not None, seconds=600, every=0.2)  # computing, some cached
        assert held and proc.poll() is None, "the demo ended before it cached a result"
        held = _rows(cache)
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=120)[1]
        assert proc.returncode == 130, stderr
        assert f"interrupted: finished requests are cached in {cache.parent}" in stderr, stderr
        assert not mark.exists(), "Ray was shut down gracefully (seconds) instead of ended at once"
        assert until_empty(lambda: _ray_processes(tmp)) == [] and not list(tmp.glob("ray/session_2*"))
        assert _rows(cache) >= held  # readable, nothing lost (every result committed as it came)
    finally:  # a failed run's leftovers: this test's own processes, found by its own folder, killed by id
        if proc.poll() is None:
            proc.kill()
        for pid in _ray_pids(tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_ctrl_c_while_driver_imports_is_one_line_and_exit_130():
    """The first 1-2 s of `driver` are imports: a Ctrl-C there was a traceback and exit -2. The handler is set
    before them (driver/__init__.py), only when the process is `driver`: a host importing it keeps its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))}
    during = "import os, signal, sys; sys.argv[0] = 'driver'; import driver; os.kill(os.getpid(), signal.SIGINT); import driver.cli; print('went on')"
    proc = subprocess.run([sys.executable, "-c", during], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (130, "driver: interrupted", ""), proc.stderr
    host = "import signal, driver; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    proc = subprocess.run([sys.executable, "-c", host], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr
