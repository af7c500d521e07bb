"""Worker groups on real Ray (the 4-node loopback `ray_cluster`) with a real `mx.distributed` ring over 127.0.0.1.

A group of K ranks holds one model split across them and is one worker to the scheduler: its numbers must equal
the unsplit in-process `mlx` model's, 2 groups must equal 1, and a rank killed or hung mid-run must lose only its
group, which is re-formed from fresh processes and takes chunks again, or (no restart left, no nodes for it) stays
lost while the run finishes on the other, with nothing left running.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from unittest import mock

import pytest

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402

from cluster import ClusterError  # noqa: E402
from cluster.groups import GroupRank  # noqa: E402
from driver.lm.mlx_ray import MLXRayLM  # noqa: E402
from testbed.waiting import until, until_empty  # noqa: E402

from test_cluster import MC, MODEL_ARGS, TASKS, assert_same, evaluate, reference, run_ray, tasks  # noqa: E402,F401  the same runs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

TOLERANCE = {"pipeline": 1e-5, "tensor": 1e-4}  # pipeline runs the same ops; tensor sums partial products


class Slow(GroupRank):
    """A real rank that sleeps `delay` s per chunk and, before it, waits while the file `gate` exists (every rank
    alike: the ring stays in step); it tells its pid."""

    delay: float = 0.0
    gate: str = ""

    def run(self, job, indices, requests):
        while self.gate and os.path.exists(self.gate):
            time.sleep(0.02)
        time.sleep(self.delay)
        return super().run(job, indices, requests)

    def facts(self) -> dict:
        return {**super().facts(), "pid": os.getpid()}


def grouped(actor: type | None = None) -> type:
    return MLXRayLM if actor is None else type("GroupedRayLM", (MLXRayLM,), {"actor_cls": actor})


def open_lm(llama_path, model=MLXRayLM, **args):
    return model.create_from_arg_obj({"pretrained": str(llama_path), **MODEL_ARGS, **args})


def free_units(want: int = 4, wait: float = 60.0) -> float:
    """The cluster's free `mlx` units, waiting up to `wait` s for them to come back to `want` (at once when idle;
    a loaded machine takes its time to end the processes that held them)."""
    until(lambda: ray.available_resources().get("mlx", 0) >= want, wait, 0.2)
    return ray.available_resources().get("mlx", 0)


def alive_ranks() -> list:
    """Rank actors Ray still counts alive (the actor table, as cluster.failures reads it)."""
    table = ray._private.state.actors().values()
    return [a for a in table if a["State"] != "DEAD" and a["ActorClassName"] in ("Slow", "Stuck", "GroupRank", "TakenPort", "SlowStart")]


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_one_group_of_two_equals_the_unsplit_model(ray_cluster, llama_path, tasks, reference, split):
    ours, info = run_ray(llama_path, tasks, group_size=2, split=split, workers=1)
    assert_same(ours, reference, tolerance=TOLERANCE[split])
    assert info["workers"] == 1 and info["nodes"] == 2  # one worker to the scheduler, on two nodes
    (group,) = info["groups"]
    assert group["split"] == split and [r["rank_in_group"] for r in group["ranks"]] == [0, 1]
    assert len({r["node_id"] for r in group["ranks"]}) == 2  # STRICT_SPREAD: one rank per node
    if split == "pipeline":
        assert [r["layers"] for r in group["ranks"]] == [[0, 1], [1, 2]]  # each rank holds its own layers
    assert all(r["peak_memory_gb"] and r["peak_memory_gb"] > 0 for r in group["ranks"])
    assert free_units() == 4  # the groups' placement groups were released


def test_two_groups_equal_one_and_both_take_chunks(ray_cluster, llama_path, tasks, reference):
    ours, info = run_ray(llama_path, tasks, group_size=2, split="pipeline", workers=2)
    assert_same(ours, reference)
    assert info["workers"] == 2 and info["nodes"] == 4
    assert len(info["requests_computed"]) == 2 and all(n > 0 for n in info["requests_computed"].values())
    assert sorted(g["group"] for g in info["groups"]) == [0, 1]
    assert len(info["prefix_store"]) == 2 and all(s["budget"] > 0 for s in info["prefix_store"])  # one per group
    assert free_units() == 4


class within:
    """Fail (not hang) when the block runs past `seconds`: Ctrl-C to the main thread, reported as a hang."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.fired = seconds, False
        self.timer = threading.Timer(seconds, self._fire)

    def _fire(self) -> None:
        self.fired = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, kind, value, tb):
        self.timer.cancel()
        if self.fired:
            pytest.fail(f"hung: still running after {self.seconds:g} s")
        return False


def _kill_when_running(lm, action):
    """Run `action` on a thread once the first chunk's results are in (the run is under way)."""

    def watch():
        while not sum(lm.executor.done.values()):
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _victim(lm, group: int = 1, rank: int = 1) -> int:
    facts = lm.executor.wait_ready()
    return next(r["pid"] for r in ray.get([a.facts.remote() for a in lm.executor.workers._formed.ranks[group]]) if r["rank_in_group"] == rank)


def _hold_until(lm, gate, pid: int | None, over, cut=None, wait: float = 60.0):
    """An action for `_kill_when_running`: hold every rank before its next chunk (the file `gate`), kill the
    process `pid` (or `cut()` a Ray node), and let the ranks go once `over(pool)` (or after `wait` s)."""

    def action():
        gate.touch()
        if cut is not None:
            cut()
        else:
            os.kill(pid, signal.SIGKILL)
        until(lambda: over(lm.executor.pool), wait, 0.05)
        gate.unlink()

    return action


def _run_held(lm, action, manager, seconds: float = 120.0):
    """The MC task with `action` run once the first results are in; (results, info); the executor closed."""
    thread = _kill_when_running(lm, action)
    try:
        with within(seconds):
            ours = evaluate(lm, None, manager, MC)
        info = lm.executor.info()
    finally:
        lm.executor.close()
        thread.join(timeout=90)
    return ours, info


def test_a_killed_rank_s_group_is_re_formed_and_takes_chunks_again(ray_cluster, llama_path, tasks, reference, tmp_path):
    """A real SIGKILL of group 1's rank 1 mid-run, every rank held until the pool has re-formed group 1 from fresh
    processes (or given up): the numbers are identical, group 1 is alive again and ran chunks after re-forming."""
    gate = tmp_path / "hold"
    actor = type("Slow", (Slow,), {"delay": 0.1, "gate": str(gate)})
    lm = open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=2)
    pid = _victim(lm)
    settled = lambda pool: pool.reformed[1] or any("not re-formed" in r for r in pool.reasons)  # noqa: E731
    ours, info = _run_held(lm, _hold_until(lm, gate, pid, settled), tasks)
    assert_same(ours, reference, MC)  # and Merge asserted every request arrived exactly once
    assert info["workers_alive"] == 2 and lm.executor.pool.alive == {0, 1}
    g1 = info["groups"][1]
    (reason,) = g1["lost"]
    assert reason.startswith("group g1 lost: rank 1 on ") and "died" in reason and "\n" not in reason
    assert g1["reformed"] == 1 and g1["alive"] and g1["chunks"] > 0  # back, and ran chunks after re-forming
    assert [r["formation"] for r in g1["ranks"]] == [1, 1] and info["groups"][0]["reformed"] == 0
    assert sum(info["requests_computed"].values()) == 48
    assert not until_empty(alive_ranks) and free_units() == 4  # the re-formed group's ranks and units released too
    assert not until_empty(lambda: _running(pid))


def test_a_hung_rank_with_no_restart_left_loses_only_its_group(ray_cluster, llama_path, tasks, reference):
    """A SIGSTOP of group 1's rank 1 (a hung rank, caught by the group deadline) with max_restarts=0: group 1 is
    lost whole and not re-formed, in one line; its chunks rerun on group 0, the numbers are identical."""
    actor = type("Slow", (Slow,), {"delay": 0.5})  # ~16 chunks: the run outlasts the deadline, not all backed up
    lm = open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=2, max_restarts=0)
    pid = _victim(lm)
    lm.executor.pool.deadline = 4.0  # a hung group is given up after 4 s without an answer (a chunk takes ~0.5 s)
    ours, info = _run_held(lm, lambda: os.kill(pid, signal.SIGSTOP), tasks)
    assert_same(ours, reference, MC)
    assert info["workers_alive"] == 1 and lm.executor.pool.alive == {0}
    (reason,) = lm.executor.pool.reasons
    assert reason.startswith("group g1 lost: no rank answered within its 4 s deadline (a hung rank)") and "\n" not in reason
    assert reason.endswith("; not re-formed: no restart left (max_restarts=0)") and info["groups"][1]["lost"] == [reason]
    assert sum(info["requests_computed"].values()) == 48
    assert not until_empty(alive_ranks) and free_units() == 4  # no stray rank, every unit free
    assert not until_empty(lambda: _running(pid))


def test_a_group_whose_node_is_gone_waits_for_a_node_and_re_forms_when_one_comes_back(ray_cluster, llama_path, tasks, reference, tmp_path):
    """A Ray node (a Mac) cut mid-run: its group is lost, and the 3 nodes left hold no second group of 2. While
    group 0 works, the re-forming waits for nodes past its placement timeout (it does not give up); once a node
    comes back, the slot is re-formed from fresh processes and takes chunks again, with the same numbers."""
    from conftest import NODE

    gate = tmp_path / "hold"
    actor = type("Slow", (Slow,), {"delay": 0.1, "gate": str(gate)})
    lm = open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=2)
    driver_socket = ray._private.worker.global_worker.node._raylet_socket_name
    victim = next(n for n in ray_cluster.worker_nodes if n._raylet_socket_name != driver_socket)
    lost = next(f["group"] for f in lm.executor.wait_ready() if victim.node_id in {r["node_id"] for r in f["ranks"]})
    pool = lm.executor.pool
    pool.recipe.timeouts["place"] = 1.0  # with no other group working, the re-forming would give up after 1 s
    waited = []

    def cut_then_come_back():
        ray_cluster.remove_node(victim, allow_graceful=False)
        until(lambda: lost in pool.reforms, 30, 0.05)
        time.sleep(4.0)  # four placement timeouts: group 0 is alive, so the slot keeps waiting for its nodes
        waited.append(lost in pool.reforms and pool.reforms[lost].step == "place" and not any("not re-formed" in r for r in pool.reasons))
        # The Mac is back, started from this thread (the main one is in the run): Ray's node sets a SIGTERM handler,
        # which only the main thread may, and ties its processes to the thread that starts them (PDEATHSIG), which
        # ends before the run does; the fixture's shutdown stops this node with the others.
        with mock.patch("ray._private.utils.set_sigterm_handler"), mock.patch("ray._private.utils.set_kill_on_parent_death_linux"):
            ray_cluster.add_node(**NODE)

    settled = lambda pool: pool.reformed[lost] or any("not re-formed" in r for r in pool.reasons)  # noqa: E731
    try:
        ours, info = _run_held(lm, _hold_until(lm, gate, None, settled, cut=cut_then_come_back), tasks)
    finally:
        while len(ray_cluster.worker_nodes) < 3:
            ray_cluster.add_node(**NODE)
        ray_cluster.wait_for_nodes()
    assert waited == [True]
    assert_same(ours, reference, MC)
    g = info["groups"][lost]
    (reason,) = g["lost"]
    assert reason.startswith(f"group g{lost} lost: ") and "\n" not in reason and "not re-formed" not in reason
    assert g["reformed"] == 1 and g["alive"] and g["chunks"] > 0 and g["re_forming"] is None
    assert sum(info["requests_computed"].values()) == 48
    assert not until_empty(alive_ranks) and free_units() == 4


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Stuck(Slow):
    """A rank of a re-formed group (formation > 0) that never gives its ring address (its process up, then hung)."""

    def address(self) -> str:
        if self.formation:
            time.sleep(300)
        return super().address()


def test_losing_every_group_is_one_line(ray_cluster, llama_path, tasks):
    """The only group lost and its re-forming stuck past its timeout: the run ends in one line naming both."""
    actor = type("Stuck", (Stuck,), {"delay": 0.2})
    lm = open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=1, max_restarts=1)
    pid = _victim(lm, group=0, rank=1)
    lm.executor.pool.recipe.timeouts["address"] = 2.0
    thread = _kill_when_running(lm, lambda: os.kill(pid, signal.SIGKILL))
    try:
        with within(120), pytest.raises(ClusterError) as e:
            evaluate(lm, None, tasks, MC)
    finally:
        lm.executor.close()
        thread.join(timeout=30)
    message = str(e.value)
    assert "\n" not in message and message.startswith("every worker group is lost (group g0 lost: rank 1 on "), message
    assert "; not re-formed: rank 0 on " in message and "did not give its ring address within 2 s)" in message
    assert "loglikelihood requests finished" in message
    assert not until_empty(alive_ranks) and free_units() == 4


class SlowStart(GroupRank):
    """A rank whose process takes `delay` s to start (its constructor: a fresh Python's imports on a busy machine)."""

    delay: float = 0.0

    def __init__(self, *args, **kwargs):
        time.sleep(self.delay)
        super().__init__(*args, **kwargs)


def test_a_rank_s_start_is_not_counted_against_its_address_deadline(ray_cluster, llama_path, monkeypatch):
    """Ray starting a rank's process (minutes on a busy machine: CI's rank 0 once missed a 60 s address deadline) is
    the start step's wait: ranks taking 8 s to start still form under a 3 s address deadline, and a 1 s start
    deadline refuses them in one line, leaving nothing behind."""
    form = sys.modules["cluster.groups.form"]  # (cluster.groups.form is also the name of its `form` function)

    actor = type("SlowStart", (SlowStart,), {"delay": 8.0})
    monkeypatch.setattr(form, "ADDRESS_TIMEOUT", 3.0)
    lm = open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=1)
    try:
        (facts,) = lm.executor.wait_ready()
    finally:
        lm.executor.close()
    assert [r["rank_in_group"] for r in facts["ranks"]] == [0, 1]
    monkeypatch.setattr(form, "START_TIMEOUT", 1.0)
    with pytest.raises(ClusterError) as e:
        open_lm(llama_path, grouped(actor), group_size=2, split="pipeline", workers=1)
    assert str(e.value).startswith("group g0 rank ") and str(e.value).endswith(" did not start within 1 s"), str(e.value)
    assert not until_empty(alive_ranks) and free_units() == 4


class TakenPort(GroupRank):
    """Rank 1 gives an address whose port it already holds: the ring cannot form there."""

    def address(self) -> str:
        import socket

        if self.rank_in_group != 1:
            return super().address()
        self.held = socket.socket()
        self.held.bind(("127.0.0.1", 0))
        self.held.listen()
        return f"127.0.0.1:{self.held.getsockname()[1]}"


def test_a_group_that_cannot_form_is_one_line_and_leaves_nothing(ray_cluster, llama_path):
    lm = open_lm(llama_path, grouped(TakenPort), group_size=2, split="pipeline", workers=2)
    try:
        with pytest.raises(ClusterError) as e:
            lm.executor.wait_ready()
    finally:
        lm.executor.close()
    message = str(e.value)
    assert "\n" not in message and "rank 1 on " in message and "(127.0.0.1, node " in message, message
    assert message.startswith("group g") and "join its ring" in message
    assert not until_empty(alive_ranks) and free_units() == 4


def test_a_steering_grid_on_a_group_equals_the_in_process_grid(ray_cluster, llama_path):
    """Sweeps (run_grid) go the same way: steered at a layer on each side of the pipeline split, and unsteered."""
    import numpy as np

    from driver.lm.mlx_ray import ray_executor
    from worker.generate import GenRequest
    from worker.grid import grid_generate, grid_loglikelihood
    from worker.load import load
    from worker.spec import Batching, Grouping, Intervention, ModelSpec, Steering

    vector = lambda seed: tuple(np.random.default_rng(seed).standard_normal(64).tolist())  # noqa: E731
    grid = [Steering()] + [Steering(interventions=(Intervention(layer=layer, vector=vector(layer), alpha=4.0),)) for layer in (0, 1)]
    rng = np.random.default_rng(0)
    reqs = [((1, *rng.integers(3, 300, 12).tolist()), tuple(rng.integers(3, 300, 3).tolist())) for _ in range(10)]
    gens = [GenRequest(context=(5, 17, 33, 90), max_gen_toks=5), GenRequest(context=(7, 8, 9), max_gen_toks=3)]
    spec, batching = ModelSpec(model=str(llama_path), max_length=64), Batching(batch_size=4, max_batch_tokens=128)
    lm = load(spec)
    want = [list(c) for c in zip(*grid_loglikelihood(lm, grid, reqs, batching))]
    want_gen = [list(c) for c in zip(*grid_generate(lm, grid, gens, batching))]
    ex = ray_executor(spec, batching, model_identity={"model": str(llama_path)}, max_length=64, workers=1,
                      grouping=Grouping(size=2, split="pipeline"))  # fmt: skip
    try:
        got, got_gen = ex.run_grid("loglikelihood", grid, reqs), ex.run_grid("generate", grid, gens)
        info = ex.info()
    finally:
        ex.close()
    for mine, theirs in zip(got, want):
        assert all(abs(x[0] - y[0]) <= 1e-5 * max(1.0, abs(y[0])) and bool(x[1]) == bool(y[1]) for x, y in zip(mine, theirs))
    assert got_gen == want_gen and want[1] != want[0] and want[2] != want[0]  # the steering changed the numbers
    assert info["workers"] == 1 and info["nodes"] == 2


def test_more_groups_than_the_nodes_hold_is_one_line_before_anything_starts(ray_cluster, llama_path):
    from driver.lm.mlx_ray import ray_executor
    from worker.spec import Batching, Grouping, ModelSpec

    with pytest.raises(ClusterError) as e:
        ray_executor(ModelSpec(model=str(llama_path)), Batching(), model_identity={}, max_length=64, workers=3,
                     grouping=Grouping(size=2))  # fmt: skip
    assert str(e.value) == (
        "--workers 3 --group-size 2 needs 6 `mlx` nodes but the cluster has 4 (4 nodes): pass --workers 2 or a smaller --group-size"
    )
    assert not until_empty(alive_ranks) and free_units() == 4


def test_a_rank_past_0_tells_the_notes_of_the_layers_it_owns(ray_cluster, llama_path):
    """Under pipeline the rank that owns a steered layer notes that ‖α·v‖ swamps the residual there: layer 1 lives
    on rank 1, whose notes reach the head as rank 0's (layer 0) do."""
    import numpy as np

    from cluster.executor import RayExecutor, Workers
    from driver.lm.progress import Progress
    from worker.spec import Batching, Grouping, Intervention, Job, ModelSpec, Steering

    spec, batching = ModelSpec(model=str(llama_path), max_length=64), Batching(batch_size=4, max_batch_tokens=128)
    heard: list[str] = []
    workers = Workers(spec, batching, workers=1, grouping=Grouping(size=2, split="pipeline"))
    ex = RayExecutor(workers, cache=None, progress=Progress(), notes=lambda results: heard.extend(getattr(results, "notes", ())),
                     model_identity={"model": str(llama_path)}, max_length=64)  # fmt: skip
    rng = np.random.default_rng(1)
    reqs = [((1, *rng.integers(3, 300, 12).tolist()), tuple(rng.integers(3, 300, 3).tolist())) for _ in range(24)]
    swamp = lambda layer: Steering(interventions=(Intervention(layer=layer, vector=(1.0,) * 64, alpha=1e4),))  # noqa: E731
    try:
        assert [r["layers"] for r in ex.facts[0]["ranks"]] == [[0, 1], [1, 2]]
        for layer in (1, 0):  # layer 1 first: its rank-1 answers still out when its run ends are settled by the next
            ex.run(Job(kind="loglikelihood", steering=swamp(layer)), reqs)
    finally:
        ex.close()
    for layer in (0, 1):
        assert any(f"layer {layer})" in n and "the model no longer reads its input" in n for n in heard), (layer, set(heard))


def test_a_slot_waiting_for_nodes_waits_while_a_group_works_and_times_out_once_none_does():
    """Pure scheduling logic (no Ray: fake groups and a fake re-forming): a slot re-forming at its "place" step has
    no deadline while another group works (a Mac that comes back is used); when the last working group is lost,
    its placement timeout counts from then, not from when it began waiting (which would end the run at once)."""
    from cluster.groups.pool import GroupHandle, GroupPool

    class Group(GroupHandle):
        def kill(self) -> None:
            self.killed = True

    class Waiting:  # a re-forming at its "place" step whose 5 s timeout began long ago
        step, deadline = "place", time.monotonic() - 100.0

        def restart_clock(self) -> None:
            self.deadline = time.monotonic() + 5.0

        def overdue(self) -> str | None:
            return "no nodes for it" if time.monotonic() >= self.deadline else None

    pool = GroupPool([Group([], 0), Group([], 1)])
    pool.reforms[0] = waiting = Waiting()
    pool.lose(0, "rank 1 died")
    assert pool.patient(waiting) and pool.due() is None  # group 1 works: no deadline for the slot
    pool.expire()
    assert 0 in pool.reforms and waiting.deadline > time.monotonic()  # waiting on, its clock kept fresh
    waiting.deadline = time.monotonic() - 100.0
    pool.lose(1, "rank 0 died")  # the last working group
    assert not pool.patient(waiting) and 4.0 < pool.due() <= 5.0  # the whole timeout, from now
    pool.expire()
    assert 0 in pool.reforms  # not given up at once
    assert [line for _, line in pool.losses] == ["group g0 lost: rank 1 died", "group g1 lost: rank 0 died"]
