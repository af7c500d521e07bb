"""Issue 29.1: stdout holds results only. Ray prints what reaches the driver from the cluster, the raylet's
"(raylet) A worker died or was killed ..." and worker output, on stdout (it landed in the middle of lm-eval's table
in 3 of 6 runs where a rank was killed): once Orchard connects, all of it goes to stderr. Real Ray (the session's
loopback cluster, whose driver forwards worker output)."""

from __future__ import annotations


import pytest

from testbed.waiting import until

ray = pytest.importorskip("ray")


@pytest.fixture
def connected(ray_cluster):
    from cluster.connect import connect

    connect()  # what every executor does first: the session's connection is reused
    return ray_cluster


def test_the_raylets_worker_died_line_goes_to_stderr(connected, capsys):
    from ray._private import worker as ray_worker

    line = "A worker died or was killed while executing a task by an unexpected system error."
    ray_worker.print_to_stdstream({"lines": [line], "pid": "raylet", "is_err": False}, ignore_prefix=False)  # as Ray's error listener calls it
    out, err = capsys.readouterr()
    assert line not in out and line in err and "(raylet)" in err, (out, err)


@ray.remote(num_cpus=0)
def _chatty(text: str) -> int:
    print(text)  # a worker's stdout, forwarded to the driver by Ray's log monitor
    return 1


def test_worker_output_reaches_the_driver_on_stderr_only(connected, capfd):
    text = "orchard-probe-worker-output-29-1"
    assert ray.get(_chatty.remote(text)) == 1
    seen = []  # the log monitor forwards within ~1 s
    until(lambda: seen.append(capfd.readouterr()) or any(text in o + e for o, e in seen), 20, 0.2)
    out, err = "".join(o for o, _ in seen), "".join(e for _, e in seen)
    assert text in err and text not in out, (out, err)
