"""Issue 29.3: with one group and max_restarts=0, a killed rank ends the run in one true line: not "the run goes on
with the other groups" (there are none) before "every worker group is lost", and no traceback of the surviving
rank's broken ring (`[ring] connection to a peer was lost`, printed by Ray as an "Unhandled error" of a ref the
executor dropped on purpose). Real Ray (the session's loopback cluster), a real ring of 2."""

from __future__ import annotations

import os
import signal
import sys

import pytest

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402

from cluster import ClusterError  # noqa: E402
from testbed.waiting import until_empty  # noqa: E402
from test_groups import MC, Slow, _kill_when_running, _victim, alive_ranks, evaluate, free_units, grouped, open_lm, tasks, within  # noqa: E402,F401

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module


class Slower(Slow):
    delay = 0.3  # the run outlasts the kill


def lost_run(lm, tasks, rank: int, seconds: float) -> ClusterError:
    """Group 0's `rank` killed (SIGKILL) once the run is under way: the error the run ends with within `seconds`
    (the executor closed)."""
    pid = _victim(lm, group=0, rank=rank)
    thread = _kill_when_running(lm, lambda: os.kill(pid, signal.SIGKILL))
    try:
        with within(seconds), pytest.raises(ClusterError) as e:
            evaluate(lm, None, tasks, MC)
    finally:
        lm.executor.close()
        thread.join(timeout=30)
    return e.value


def test_one_group_lost_with_no_restart_says_one_true_line(ray_cluster, llama_path, tasks, capfd):
    lm = open_lm(llama_path, grouped(Slower), group_size=2, split="pipeline", workers=1, max_restarts=0)
    error = lost_run(lm, tasks, rank=1, seconds=120)
    import gc

    gc.collect()  # the dropped refs are released: Ray would print their errors now
    message = str(error)
    assert "\n" not in message and message.startswith("every worker group is lost (group g0 lost: rank 1 on "), message
    assert "not re-formed: no restart left (max_restarts=0)" in message
    out, err = capfd.readouterr()
    assert "(raylet)" not in out and "worker died" not in out, out  # issue 29.1: stdout holds results only
    assert "goes on with the other groups" not in err, err
    assert "[ring]" not in err and "Unhandled error" not in err and "Traceback" not in err, err
    assert not until_empty(alive_ranks) and free_units() == 4
