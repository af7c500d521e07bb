"""`driver run --address local --workers 2 --group-size 2` with a rank really killed mid-run (SIGKILL of one of
the four local rank processes, found under the driver's own process tree): the run ends well with the unsplit
run's numbers, the loss is one line, and no process of the run outlives it."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest

from testbed.waiting import until_empty

from test_cli import _close, _story_args, _story_samples, driver_env

pytestmark = pytest.mark.slow


def _ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    """The group rank actors among the driver's descendants (its local Ray's raylet starts them)."""
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "GroupRank" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return out


def _cached(db_path) -> int:
    """Rows in the run's result cache (written as each chunk arrives); 0 before it exists."""
    if not db_path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def _kill_a_rank_once_results_arrive(proc: subprocess.Popen, db_path, stderr, seconds: float = 300) -> tuple[int, list]:
    """SIGKILL one rank once the first chunk is cached (lm-eval's later request kinds are still to run):
    (rows cached when it was killed, every process of the run seen then). Else fail with the run's stderr."""
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        rows, ranks = _cached(db_path), _ranks(proc)
        if rows and len(ranks) == 4:
            seen = psutil.Process(proc.pid).children(recursive=True)
            max(ranks, key=lambda p: p.pid).send_signal(signal.SIGKILL)
            return rows, seen
        time.sleep(0.01)
    pytest.fail(f"no rank killed: the run ended (exit {proc.poll()}) or sent nothing within {seconds:g} s:\n{stderr.read_text()[-3000:]}")


def _watch(proc: subprocess.Popen, seconds: float) -> list[psutil.Process]:
    """Every process of the run seen until it ends (re-formed ranks too): the driver's descendants, polled."""
    seen, deadline = [], time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        time.sleep(0.2)
    assert proc.poll() is not None, f"hung: still running after {seconds:g} s"
    return seen


def _left(processes: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie has ended)."""
    left = []
    for p in set(processes):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            pass
    return left


def test_a_rank_killed_mid_run_on_the_local_cluster_loses_one_group_and_the_numbers_stay(tmp_path, story_plain):
    out = tmp_path / "killed"
    args = _story_args(tmp_path, "killed", "--workers", "2", "--group-size", "2")  # the later --workers wins
    cmd = [sys.executable, "-m", "driver", *map(str, args)]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=driver_env(tmp_path), stdout=subprocess.DEVNULL, stderr=err)
        try:
            rows, seen = _kill_a_rank_once_results_arrive(proc, out / "cache" / "results.sqlite", tmp_path / "stderr")
            seen += _watch(proc, 300)
        finally:
            proc.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads(next(out.rglob("summary_*.json")).read_text())
    assert rows < summary["requests"]  # killed while requests were still to come
    lost = [g for g in summary["groups"] if g["lost"]]
    assert len(lost) == 1 and len(lost[0]["lost"]) == 1, summary["groups"]
    reason = lost[0]["lost"][0]
    assert reason.startswith(f"group g{lost[0]['group']} lost: rank ") and "died" in reason and "\n" not in reason
    assert reason in stderr and "Traceback" not in stderr  # shown to the user, above the progress bar
    assert lost[0]["reformed"] == lost[0]["alive"]  # back from fresh processes, or lost while the other finished
    grouped = _story_samples(out)
    assert {t: sorted(s) for t, s in grouped.items()} == {t: sorted(s) for t, s in story_plain.items()}
    different = [(t, d) for t in story_plain for d in story_plain[t] if not _close(story_plain[t][d], grouped[t][d], 1e-5)]
    assert not different, [(t, d, story_plain[t][d], grouped[t][d]) for t, d in different[:3]]
    left = until_empty(lambda: _left(seen))
    assert not left, left  # the local Ray, its ranks and any re-formed ones: all ended with the run
