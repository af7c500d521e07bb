"""Worker jobs on a model split over a real `mx.distributed` ring of K local processes (127.0.0.1), no Ray.

`run_split(models, grouping, work)` starts one process per rank (`python -m testbed.ring TASK RANK`); each joins
the ring, loads its share of every model in `models` ({name: folder}; worker.load.load with the group) and runs
every (name, Job, requests[, Batching]) of `work` through worker.jobs.run, in the same order, as a group's ranks
do. Returns each rank's report: its layers and peak memory per model, results (a job that raised gives
"error: <message>"), `clock`, its pipelined busy and waiting time (worker.split.stages.CLOCK), `overlap` (whether its sends ran on a stream of their own), per job the
collectives it called (`collectives`: all_sum, all_gather, ... counted), its pipelined busy seconds (`busy`) and
its prefix store's (hits, extended, misses) (`lookups`) and entries after it (`entries`: (tokens, the id of the
stored KV) each), and per model its prefix store's counters after the work (worker.prefix_cache).
A grouping of size 1 loads the whole models unsplit.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STALL = 120.0  # seconds with no rank finishing a step (a model's load, a job): a hung ring, stopped

ROOT = Path(__file__).resolve().parents[1]


def run_split(models: dict, grouping: Any, work: list, *, dtype: str | None = None, timeout: float = 300,
              stall: float = STALL) -> list[dict]:  # fmt: skip
    """Each rank's report {rank, layers and load_peak_gb and weights_bytes: {name: ...}, peak_gb, results}, in rank
    order; RuntimeError on a rank that fails, on `timeout` seconds in all, or on `stall` seconds in which no rank
    finished a step (every rank is stopped: a hang fails in minutes, not at the whole run's deadline)."""
    from worker.split import free_address

    hostfile = [free_address("127.0.0.1") for _ in range(grouping.size)]
    with tempfile.TemporaryDirectory(prefix="orchard-ring-") as folder:
        task = Path(folder) / "task.pkl"
        task.write_bytes(pickle.dumps({"models": {k: str(v) for k, v in models.items()}, "dtype": dtype, "grouping": grouping, "work": work, "hostfile": hostfile}))
        logs = [Path(folder) / f"rank{rank}.log" for rank in range(grouping.size)]
        procs = [_start([sys.executable, "-m", "testbed.ring", str(task), str(rank)], log) for rank, log in enumerate(logs)]
        _wait(procs, logs, timeout, stall)
        return [pickle.loads((Path(folder) / f"rank{rank}.pkl").read_bytes()) for rank in range(grouping.size)]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # a file, not a pipe: nothing blocks a rank while the parent only watches
        return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _wait(procs: list, logs: list[Path], timeout: float, stall: float) -> None:
    """Until every rank exits 0; RuntimeError at once when one fails, or on a stall or the timeout (every rank is
    stopped either way). A rank's steps are counted in its log's `step` lines (`_stepped`)."""
    start = last = time.monotonic()
    seen, failed = None, []
    try:
        while None in [p.poll() for p in procs]:  # every rank polled: a failed one is seen while its peers wait
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:  # its peers would wait on it until the stall watch fired
                break
            now, steps = time.monotonic(), [_steps(log) for log in logs]
            if steps != seen:
                seen, last = steps, now
            if now - last > stall or now - start > timeout:
                why = f"no rank finished a step in {stall:.0f} s" if now - last > stall else f"still running after {timeout:.0f} s"
                raise RuntimeError(f"ring stopped: {why} (steps done per rank: {steps}): {_tails(logs)}")
            time.sleep(0.2)
    finally:
        for proc in procs:  # never leave a rank behind (a hung ring, a failed peer)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for rank in failed or [r for r, p in enumerate(procs) if p.returncode != 0]:
        raise RuntimeError(f"rank {rank} exited {procs[rank].returncode}: {logs[rank].read_text(errors='replace')[-2000:]}")


def _steps(log: Path) -> int:
    return log.read_text(errors="replace").count("\nstep\n") if log.exists() else 0


def _tails(logs: list[Path]) -> str:
    return " | ".join(f"rank {r}: {log.read_text(errors='replace')[-600:]!r}" for r, log in enumerate(logs))


def _stepped() -> None:
    """One more step done (a model loaded, a job run): the parent's stall watch reads these lines."""
    print("\nstep", flush=True)


def pipeline_models(stories: Path, folder: Path, configs: dict) -> dict:
    """{"stories": the shipped model, "qwen2": a random 4-layer qwen2 (GQA) written under `folder`}, the two models the
    pipeline ring tests split; each one's config.json goes into `configs` (the split's layer plan is made from it)."""
    import json

    from testbed.models import write_model

    folders = {"stories": stories, "qwen2": write_model(folder / "qwen2", arch="qwen2", layers=4, heads=4, kv_heads=2)}
    configs.update({name: json.loads((Path(f) / "config.json").read_text()) for name, f in folders.items()})
    return folders


def by_model(reports: list[dict], labels: list[tuple[str, str]], keys: tuple[str, ...] = ("results",)) -> list[dict]:
    """Each rank's report with each of `keys` (one value per job, in `labels`' (model, label) order) made
    {model: {label: value}}."""
    for report in reports:
        for key in keys:
            grouped: dict = {}
            for (name, label), value in zip(labels, report[key]):
                grouped.setdefault(name, {})[label] = value
            report[key] = grouped
    return reports


def weights_held(lm: Any) -> int:
    """Bytes of the weights a loaded model (or one rank's share) holds."""
    from mlx.utils import tree_flatten

    return sum(w.nbytes for _, w in tree_flatten(lm.model.parameters()))


def _job(lm: Any, job: Any, requests: list, batching: Any = None) -> Any:
    from worker.jobs import run
    from worker.spec import Batching

    try:
        return list(run(lm, job, requests, batching or Batching()))
    except Exception as e:  # reported per job, as the worker reports it
        return f"error: {e}"


COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min")


def _count_collectives(distributed: Any) -> list[int]:
    """Wrap the ring's collectives so each call adds one to the returned counter ([calls])."""
    calls = [0]

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return fn(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        if hasattr(distributed, name):
            setattr(distributed, name, counted(getattr(distributed, name)))
    return calls


def _lookups(store: Any) -> tuple[int, int, int]:
    """A prefix store's (hits, extended, misses) so far."""
    return store.hits, store.extended, store.misses


def main(task_path: str, rank: int) -> None:
    import mlx.core as mx

    from worker.load import load
    from worker.prefix_cache import store
    from worker.spec import ModelSpec
    from worker.split import join, peak_memory_gb
    from worker.split.stages import CLOCK, OVERLAP

    task = pickle.loads(Path(task_path).read_bytes())
    grouping = task["grouping"]
    group = join(task["hostfile"], rank) if grouping.size > 1 else None
    models, layers, load_peak = {}, {}, {}
    for name, folder in task["models"].items():  # each model measured alone: its load's own peak
        mx.reset_peak_memory()
        models[name] = load(ModelSpec(model=folder, dtype=task["dtype"]), group=group, grouping=grouping)
        layers[name], load_peak[name] = models[name].layers, peak_memory_gb()
        _stepped()
    held = {name: weights_held(lm) for name, lm in models.items()}
    calls = _count_collectives(mx.distributed)
    results, collectives, busy, lookups, entries = [], [], [], [], []
    for name, job, requests, *rest in task["work"]:
        before = calls[0], CLOCK.busy, _lookups(store(models[name]))
        results.append(_job(models[name], job, requests, *rest))
        collectives.append(calls[0] - before[0])
        busy.append(CLOCK.busy - before[1])
        lookups.append(tuple(a - b for a, b in zip(_lookups(store(models[name])), before[2])))
        entries.append([(tokens, id(kv)) for (_, tokens), (kv, _) in store(models[name]).entries.items()])
        _stepped()
    cascade = {name: getattr(lm.model, "_orchard_cascade", None) for name, lm in models.items()}  # its verdict, if asked
    stores = {name: store(lm).stats() for name, lm in models.items()}
    report = {"rank": rank, "layers": layers, "load_peak_gb": load_peak, "peak_gb": peak_memory_gb(),
              "weights_bytes": held, "results": results, "cascade": cascade, "clock": CLOCK, "overlap": OVERLAP, "prefix_store": stores,
              "collectives": collectives, "busy": busy, "lookups": lookups, "entries": entries}  # fmt: skip
    (Path(task_path).parent / f"rank{rank}.pkl").write_bytes(pickle.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
