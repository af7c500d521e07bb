"""Real Ray on loopback: a 4-node cluster on this machine, each node offering {"mlx": 1} like a Mac.

One cluster (conftest's `ray_cluster`) serves the session. Each test builds its own workers and closes them,
so the four `mlx` units are free again for the next test.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

import lm_eval  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from ray import cloudpickle  # noqa: E402

import cluster as orchard_cluster  # noqa: E402
from driver.cli import main  # noqa: E402
from cluster import Pool, WorkerActor  # noqa: E402
from driver.lm.mlx_ray import MLXRayLM  # noqa: E402
from cluster.schedule import WorkersLost, dispatch  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

TASKS = ["orchard_mc", "orchard_ppl", "orchard_gen"]
MC = ["orchard_mc"]  # 48 loglikelihood requests: enough chunks for the fault tests
MODEL_ARGS = {"max_length": 64, "batch_size": 4, "max_batch_tokens": 128}  # small chunks: many per run
from conftest import NODE  # noqa: E402
from testbed.waiting import until  # noqa: E402


@pytest.fixture(scope="module")
def tasks(tasks_dir):
    return TaskManager(include_path=str(tasks_dir))  # indexing lm-eval's tasks takes seconds: once per module


@pytest.fixture(scope="module")
def reference(llama_path, tasks):
    """The in-process `mlx` model on the same requests."""
    return evaluate("mlx", {"pretrained": str(llama_path), **MODEL_ARGS}, tasks)


def evaluate(model, model_args, manager, names=TASKS):
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=names, task_manager=manager, log_samples=True, verbosity="ERROR"
    )


class Flaky(WorkerActor):
    """A real worker that is slow, or crashes its process once, according to its rank (see `flaky`)."""

    delays: dict = {}
    crash_after: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks = 0

    def run(self, job, indices, requests):
        self.chunks += 1
        limit = self.crash_after.get(self.rank)
        if limit is not None and not self.restarted and self.chunks > limit:
            os._exit(1)  # a crash, as when a Mac's process is killed: Ray restarts the actor
        time.sleep(self.delays.get(self.rank, 0.0))
        return super().run(job, indices, requests)


def flaky(delays=None, crash_after=None):
    """An `mlx-ray` model class whose workers sleep `delays[rank]` s per chunk / crash after `crash_after[rank]` chunks."""
    actor = type("Flaky", (Flaky,), {"delays": dict(delays or {}), "crash_after": dict(crash_after or {})})
    return type("FlakyRayLM", (MLXRayLM,), {"actor_cls": actor})


def run_ray(llama_path, manager, names=TASKS, model=MLXRayLM, **args):
    """simple_evaluate with a fresh `mlx-ray` model; returns (results, executor info). Always frees the workers."""
    lm = model.create_from_arg_obj({"pretrained": str(llama_path), **MODEL_ARGS, **args})
    try:
        return evaluate(lm, None, manager, names), lm.executor.info()
    finally:
        lm.executor.close()


def assert_same(ours, ref, names=TASKS, tolerance=1e-5):
    """Sample by sample, within `tolerance` (a tensor-split group sums partial products: 1e-4); texts identical."""
    for task in names:
        mine, theirs = ours["samples"][task], ref["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
        for a, b in zip(mine, theirs):
            for (x,), (y,) in zip(a["resps"], b["resps"]):
                if task == "orchard_mc":
                    assert abs(x[0] - y[0]) <= tolerance and x[1] == y[1], (task, x, y)
                elif task == "orchard_ppl":
                    assert abs(x - y) <= tolerance * max(1.0, abs(y)), (task, x, y)
                else:
                    assert x == y, (task, x, y)
        for metric, value in ref["results"][task].items():
            expected = pytest.approx(value, rel=max(1e-6, tolerance / 10)) if isinstance(value, float) else value
            assert ours["results"][task][metric] == expected, (task, metric)


# --- placement, node facts, worker counts ------------------------------------------------------


class Probe:
    """A worker stand-in without a model: answers where it runs, and echoes chunks (optionally slowly, or crashing)."""

    def __init__(self, delay: float = 0.0, exit_after: int | None = None):
        self.delay, self.exit_after, self.chunks = delay, exit_after, 0

    def facts(self) -> dict:
        return orchard_cluster.collect()

    def run(self, indices):
        self.chunks += 1
        if self.exit_after is not None and self.chunks > self.exit_after:
            os._exit(1)
        time.sleep(self.delay)
        return indices, [10 * i for i in indices]


def test_one_worker_per_mlx_node_and_counts(ray_cluster):
    assert orchard_cluster.worker_count("all") == 4
    with pytest.raises(orchard_cluster.ClusterError, match=r"--workers 5 needs 5 `mlx` nodes but the cluster has 4"):
        orchard_cluster.worker_count(5)
    actors = orchard_cluster.place(Probe, 4)
    try:
        facts = ray.get([a.facts.remote() for a in actors])
        assert len({f["node_id"] for f in facts}) == 4
        with pytest.raises(orchard_cluster.ClusterError, match="only 0 of the cluster's 4 `mlx` units are free"):
            orchard_cluster.worker_count(1, wait=0.5)
    finally:
        for a in actors:
            ray.kill(a)
    from cluster.facts import fast_blas

    if fast_blas():  # Linux with OpenBLAS installed: workers preload it (~10x the reference BLAS)
        assert {f["blas"] for f in facts} == {"OpenBLAS (preloaded)"}
    facts = orchard_cluster.node_facts()
    assert len(facts) == 4 and all(f["mlx"] and f["ray"] == ray.__version__ for f in facts)
    assert {f["blas"] for f in facts} == {"OpenBLAS (preloaded)" if fast_blas() else facts[0]["blas"]}
    assert orchard_cluster.mismatch(facts) is None


def test_mixed_versions_or_model_files_are_refused_in_one_line():
    base = {"hostname": "mac1", "python": "3.11.7", "mlx": "0.32.4", "mlx-lm": "0.32.2", "ray": "2.60.0", "model_files": "ab"}
    assert orchard_cluster.mismatch([base, {**base, "hostname": "mac2", "python": "3.11.9"}]) is None  # patch level
    message = orchard_cluster.mismatch([base, {**base, "hostname": "mac2", "mlx": "0.31.0"}])
    assert message == "workers disagree on mlx (0.31.0 on mac2; 0.32.4 on mac1): install the same mlx on every Mac"
    message = orchard_cluster.mismatch([base, {**base, "hostname": "mac2", "model_files": "cd"}])
    assert "workers disagree on model_files" in message and "same model files" in message
    message = orchard_cluster.mismatch([{**base, "adapter_files": "x"}, {**base, "hostname": "mac2", "adapter_files": "y"}])
    assert "workers disagree on adapter_files (x on mac1; y on mac2): give every Mac the same adapter files" == message


def _dispatch(pool, chunks, **kw):
    got = []
    submit = lambda a, c: a.run.remote(chunks[c])  # noqa: E731
    dispatch([len(c) for c in chunks], pool, submit, lambda w, c, value: got.append((c, value, w)), **kw)
    return got


def test_backups_finish_the_tail_without_waiting_for_a_stalled_worker(ray_cluster):
    stall = 300.0  # worker 1's every chunk: the run ends long before it, on worker 0's copies
    actors = orchard_cluster.place(Probe, 2, per_worker=[{"delay": 0.01}, {"delay": stall}])
    chunks = [[2 * i, 2 * i + 1] for i in range(12)]
    try:
        start = time.monotonic()
        pool = Pool(actors, revive=lambda a: a.facts.remote())
        got = _dispatch(pool, chunks)
        assert time.monotonic() - start < stall  # it did not wait for a stalled chunk (killed below, never finished)
        assert sorted(c for c, _, _ in got) == list(range(12))  # each chunk delivered exactly once
        assert {w for _, _, w in got} == {0}  # worker 1's chunks were re-run on worker 0
        assert all(value == (chunks[c], [10 * i for i in chunks[c]]) for c, value, _ in got)
        assert pool.alive == {0, 1}
    finally:
        for a in actors:
            ray.kill(a)


def test_when_every_worker_is_lost_dispatch_stops_and_keeps_what_finished(ray_cluster):
    actors = orchard_cluster.place(Probe, 2, max_restarts=0, per_worker=[{"exit_after": 2}, {"exit_after": 3}])
    chunks = [[i] for i in range(20)]
    got = []
    submit = lambda a, c: a.run.remote(chunks[c])  # noqa: E731
    with pytest.raises(WorkersLost, match="every worker is lost"):
        dispatch([1] * 20, Pool(actors, lambda a: a.facts.remote()), submit, lambda w, c, v: got.append(c))
    # 2 + 3 chunks ran; a reply still in flight when its process died may be lost (it would be re-run)
    assert sorted(got) == sorted(set(got)) and 3 <= len(got) <= 5


# --- the mlx-ray lm-eval model against the in-process mlx model ---------------------------------


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_results_match_in_process_model(ray_cluster, llama_path, tasks, reference, workers):
    # 0.1 s per chunk on every worker: with OpenBLAS one worker computes each task here in well under 1 s, and could
    # finish them all (its backups too) while another still warms up; "every worker took part" needs each chunk to last
    ours, info = run_ray(llama_path, tasks, workers=workers, model=flaky(delays=dict.fromkeys(range(workers), 0.1)))
    assert_same(ours, reference)
    assert info["workers"] == info["nodes"] == workers  # one worker per node
    assert len(info["requests_computed"]) == workers  # every worker took part
    assert ours["config"]["orchard"]["executor"] == "ray"


def test_a_worker_crash_mid_run_loses_nothing(ray_cluster, llama_path, tasks, reference):
    lm = flaky(crash_after={2: 1}).create_from_arg_obj({"pretrained": str(llama_path), **MODEL_ARGS, "workers": 4})
    try:
        assert_same(evaluate(lm, None, tasks, MC), reference, MC)
        restarted = ray.get(lm.executor.actors[2].facts.options(max_task_retries=-1).remote())  # back, model reloaded
        assert restarted["restarted"] and restarted["model_files"] == lm.executor.facts[2]["model_files"]
    finally:
        lm.executor.close()


def _rows(cache_dir) -> int:
    try:
        with sqlite3.connect(cache_dir / "results.sqlite") as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0


def _when_cache_has_rows(cache_dir, action):
    """Run `action` from a thread once the first results are on disk (the run is under way)."""

    def watch():
        while _rows(cache_dir) == 0:
            time.sleep(0.05)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


class Gated(Flaky):
    """A Flaky worker that holds each chunk, before starting it, for as long as the file `gate` exists."""

    gate: str = ""

    def run(self, job, indices, requests):
        while os.path.exists(self.gate):
            time.sleep(0.02)
        return super().run(job, indices, requests)


def test_a_node_removed_mid_run_loses_nothing(ray_cluster, llama_path, tasks, reference, tmp_path):
    """Deterministic: once the first results are cached, every worker is held before its next chunk, the victim's
    node is cut and the gate opens only when the driver has seen that worker fail, so the run cannot finish on
    backups first: exactly one worker is lost, nothing is lost with it."""
    driver_socket = ray._private.worker.global_worker.node._raylet_socket_name
    victim = next(n for n in ray_cluster.worker_nodes if n._raylet_socket_name != driver_socket)
    gate, cache = tmp_path / "hold", tmp_path / "cache"
    actor = type("Gated", (Gated,), {"delays": dict.fromkeys(range(4), 0.3), "crash_after": {}, "gate": str(gate)})
    model = type("GatedRayLM", (MLXRayLM,), {"actor_cls": actor})
    lm = model.create_from_arg_obj({"pretrained": str(llama_path), **MODEL_ARGS, "workers": 4, "cache": str(cache)})
    lost = next((w for w, f in enumerate(lm.executor.facts) if f["node_id"] == victim.node_id), None)
    seen: dict = {}

    def power_cut():
        gate.touch()
        seen["finished_at_cut"] = _rows(cache)
        ray_cluster.remove_node(victim, allow_graceful=False)
        seen["lost_before_the_end"] = until(lambda: lost not in lm.executor.pool.alive, 60, 0.02)
        seen["finished_when_lost"] = _rows(cache)
        gate.unlink()

    if lost is None:  # one worker per node: this cannot happen
        lm.executor.close()
        pytest.fail(f"no worker on the victim node {victim.node_id}: {[f['node_id'] for f in lm.executor.facts]}")
    thread = _when_cache_has_rows(cache, power_cut)
    try:
        ours = evaluate(lm, None, tasks, MC)
        info = lm.executor.info()
    finally:
        lm.executor.close()
        thread.join(timeout=60)
        gate.unlink(missing_ok=True)
        ray_cluster.add_node(**NODE)
        ray_cluster.wait_for_nodes()
    assert 0 < seen["finished_at_cut"] < 48  # the node went down mid-run
    assert seen["lost_before_the_end"] and seen["finished_when_lost"] < 48  # its loss was seen mid-run
    assert info["workers_alive"] == 3 and lm.executor.pool.alive == set(range(4)) - {lost}
    assert_same(ours, reference, MC)  # and Merge asserted every index arrived exactly once
    assert sum(info["requests_computed"].values()) == 48


# --- parity where the 64-token fixtures never go: prefix families, stop strings, EOS, truncation ----


@pytest.fixture(scope="module")
def long_tasks(tasks_dir, tmp_path_factory):
    from parity_tasks import write_long_tasks

    return TaskManager(include_path=str(write_long_tasks(tmp_path_factory.mktemp("long-tasks"), tasks_dir)))


@pytest.fixture(scope="module")
def eos_model(llama_path, tasks_dir, tmp_path_factory):
    """The tiny llama with one more EOS id: a token its greedy answers to some (not all) generation prompts hold."""
    import json
    import shutil

    from parity_tasks import GEN_MAX
    from transformers import AutoTokenizer

    from worker.generate import GenRequest, generate_tokens
    from worker.load import load

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    docs = [json.loads(line) for line in (tasks_dir / "gen.jsonl").read_text().splitlines()]
    reqs = [GenRequest(tuple(tok.encode(f"Q: {d['question']}\nA:")), max_gen_toks=GEN_MAX) for d in docs]
    outs = generate_tokens(load(str(llama_path)), reqs)
    eos = next(t for o in outs for t in o[1:] if 0 < sum(t in p for p in outs) < len(outs) // 2)
    path = tmp_path_factory.mktemp("models") / "tiny-llama-eos"
    shutil.copytree(llama_path, path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], eos]}))
    return path


def test_families_stops_eos_and_truncation_match_in_process_model(ray_cluster, eos_model, long_tasks, monkeypatch):
    """mlx-ray vs mlx at the model's own 512-token window: few-shot families (kept whole by the scheduler, reused
    on the workers), generations that stop at a stop string, at EOS and at max_gen_toks."""
    import cluster.plan
    from parity_tasks import LONG_TASKS, coverage
    from worker.load import load

    cuts: list = []
    real_cut = cluster.plan.cut
    monkeypatch.setattr(cluster.plan, "cut", lambda costs, groups, **kw: cuts.append((costs, groups, real_cut(costs, groups, **kw))) or cuts[-1][2])
    args = {"pretrained": str(eos_model), "batch_size": 4, "max_batch_tokens": 512}
    reference = evaluate("mlx", args, long_tasks, LONG_TASKS)
    lm = MLXRayLM.create_from_arg_obj({**args, "workers": 2})
    try:
        ours = evaluate(lm, None, long_tasks, LONG_TASKS)
        info = lm.executor.info()
    finally:
        lm.executor.close()
    for task in LONG_TASKS:
        mine, theirs = ours["samples"][task], reference["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
        for a, b in zip(mine, theirs):
            for (x,), (y,) in zip(a["resps"], b["resps"]):
                if task == "orchard_mc_shared":
                    assert abs(x[0] - y[0]) <= 1e-5 and x[1] == y[1], (x, y)
                else:
                    assert x == y, (x, y)
    # Two workers held the model and the chunks went to them (each gets chunks from the start); which copy of a
    # chunk counts is the scheduler's: under load an idle worker's backup copy of a straggler's chunk may land
    # first, so one worker can be credited with every request (cluster.schedule.backup_for).
    assert info["workers"] == 2 and info["workers_alive"] == 2 and sum(info["requests_computed"].values()) > 0, info
    # The loglikelihood job: few-shot families (a group wider than one question's 4 answers), each in one chunk.
    costs, groups, chunks = next(c for c in cuts if len(c[0]) == 48)
    where = {i: n for n, chunk in enumerate(chunks) for i in chunk}
    assert len(chunks) > 1 and max(map(len, groups)) >= 8 and max(costs) > 100, (groups, chunks)
    assert all(len({where[i] for i in g}) == 1 for g in groups)
    prompts = [s["arguments"][0][0] for s in ours["samples"]["orchard_gen_stops"]]
    reached = coverage(load(str(eos_model)), prompts, lm.tok_encode)
    assert reached["stop"] and reached["eos"] and reached["max"], reached


def test_fast_workers_take_more_chunks(ray_cluster, llama_path, tasks):
    _, info = run_ray(llama_path, tasks, MC, flaky(delays={1: 0.5}), workers=2)
    fast, slow = (info["requests_computed"].get(f"w{i}@{info['facts'][i]['hostname']}", 0) for i in range(2))
    assert fast > 2 * slow, (fast, slow)


def test_interrupted_run_resumes_from_the_cache(ray_cluster, llama_path, tasks, reference, tmp_path):
    main_thread = threading.main_thread().ident
    thread = _when_cache_has_rows(tmp_path, lambda: signal.pthread_kill(main_thread, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C mid-run
        run_ray(llama_path, tasks, MC, flaky(delays={0: 0.3, 1: 0.3}), workers=2, cache=str(tmp_path))
    thread.join()
    finished = _rows(tmp_path)
    assert 0 < finished < 48
    ours, info = run_ray(llama_path, tasks, MC, workers=2, cache=str(tmp_path))
    assert info["requests_cached"] == finished  # nothing that finished is computed again
    assert sum(info["requests_computed"].values()) == 48 - finished
    assert_same(ours, reference, MC)


def test_losing_every_worker_is_a_clear_error_and_keeps_finished_work(ray_cluster, llama_path, tasks, tmp_path):
    with pytest.raises(orchard_cluster.ClusterError, match=r"every worker is lost: \d+ of 48 loglikelihood requests finished; they are cached"):
        run_ray(llama_path, tasks, MC, flaky(crash_after={0: 2, 1: 3}), workers=2, cache=str(tmp_path), max_restarts=0)
    assert _rows(tmp_path) > 0


def test_cli_refuses_more_workers_than_mlx_nodes(ray_cluster, llama_path, tasks_dir, tmp_path):
    result = CliRunner().invoke(
        main,
        ["run", "--model", str(llama_path), "--tasks", "orchard_mc", "--include-path", str(tasks_dir), "--workers", "5",
         "--address", ray_cluster.address, "--output-path", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Error: --workers 5 needs 5 `mlx` nodes but the cluster has 4 (4 nodes)" in result.output
    assert "Traceback" not in result.output


class SmallNode(WorkerActor):
    """A node with 1 KB for models: even the tiny test model does not fit."""

    def memory_for_models(self) -> tuple[float, str]:
        return 1 / 2**20, "system memory"


def test_a_model_too_large_for_a_node_is_refused_in_one_line_before_loading(ray_cluster, llama_path):
    model = type("SmallRayLM", (MLXRayLM,), {"actor_cls": SmallNode})
    lm = model(pretrained=str(llama_path), workers=2)
    try:
        with pytest.raises(ValueError) as e:
            lm.executor.wait_ready()  # the workers start with the model; their refusal surfaces at the first job
    finally:
        lm.executor.close()
    message = str(e.value)
    assert "\n" not in message
    assert "do not fit in the 0.0 GB this node has for models (system memory): use a smaller or quantized model" in message
    assert message.startswith("worker w0 on ") and "(127.0.0.1, node " in message and "cannot load the model: " in message


def test_a_workers_refusal_inside_an_lm_eval_run_is_one_click_error(ray_cluster, llama_path, tasks, tmp_path):
    """What `driver run` and `driver sweep` get when a worker refuses the model at the first job: one line, and
    no empty results.sqlite left in the cache folder (the cache file is made at its first write)."""
    import click

    from driver.lm.evaluation import Plan, evaluate, parse_seeds

    model = type("SmallRayLM", (MLXRayLM,), {"actor_cls": SmallNode})
    lm = model(pretrained=str(llama_path), workers=2, cache=str(tmp_path / "cache"))
    try:
        with pytest.raises(click.ClickException) as e:
            evaluate(lm, {}, Plan(seeds=parse_seeds("0"), names=MC, manager=tasks), str(tmp_path / "out"))
    finally:
        lm.executor.close()
    assert "\n" not in e.value.message and "cannot load the model: the model's weights" in e.value.message
    assert not (tmp_path / "cache").exists()  # nothing half-written


def test_a_signal_during_shutdown_waits_for_the_block_then_interrupts():
    # Ctrl-C cutting ray.shutdown in half left Ray's C++ core to end the process with status 1, not 130
    from cluster.connect import signals_held

    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # Python runs handlers between bytecodes: an unheld SIGINT would have raised by now
            reached_end = True
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
