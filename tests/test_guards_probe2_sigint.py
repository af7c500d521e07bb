"""A Ctrl-C while the embedded Ray starts (issue 29.7): nothing of that Ray is left once the process has exited.

ray.init cut halfway swallowed the interrupt, left `logging`'s lock held (the command then hung for good on its
next log call) or left Ray's processes behind for 1-2 minutes; cluster.connect._init now holds the signal until
ray.init returns, shuts Ray down, then lets it act. A real process (the subject is its exit): it connects as the
CLI does and sends itself SIGINT as soon as its raylet has started (ray.init under way, the agents next); its own
RAY_TMPDIR tells its Ray's processes from everyone else's. Before the fix: 2 agents left for minutes in 1 of 2 tries,
1 process at exit in the other (gone within 3 s), and one `driver run` hung for good on the lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from testbed.waiting import until_empty

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
        assert "interrupted; ray initialized: False" in proc.stdout and "logging still works" in proc.stderr
        assert until_empty(lambda: _ray_processes(tmp)) == []  # a process Ray has just signalled may take a moment to go
    finally:  # a failed run's leftovers: this test's own processes, found by its own folder, killed by id
        for pid in _ray_pids(tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
