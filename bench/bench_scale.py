"""Can the head feed 16 Macs? The real head path against simulated workers of a given speed.

    python bench/bench_scale.py [--limit 30] [--speed 100] [--full]

Everything the head does is real: lm-eval builds stock `mmlu` 5-shot requests (offline copy of ../shared's
cais/mmlu), `MLXRayLM.loglikelihood` tokenizes them in pieces on its feed thread (examples/stories260K's Llama
tokenizer), cuts chunks, dispatches them over Ray actors with `dispatch`, caches and merges every result. Only
the workers are simulated: `SleepingWorker` holds no model and sleeps `requests / speed` seconds per chunk (a
Mac scoring a small model at `speed` requests/s), then answers zeros. The time counted is that of the
`loglikelihood` call, after every actor is up: what a user waits for once lm-eval hands the requests over.

Table 1: speed-up over one worker for N = 1, 2, 4, 8, 16 workers at --speed (target >= 0.9 N). Table 2: the head
alone, workers that answer at once (speed infinite): the rate at which the head can feed workers, so the
number of `speed` workers it saturates at. --full adds the whole MMLU test split (~56k requests) with 16
workers: time from the hand-over to the first chunk running on a worker (target <= 1 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_MMLU = ROOT.parent / "shared" / "data" / "hf-datasets" / "cais___mmlu"
MODEL = ROOT / "examples" / "stories260K"
sys.path.insert(0, str(ROOT))

from cluster.actor import WorkerActor  # noqa: E402
from cluster.facts import collect  # noqa: E402
from worker.load import fingerprint  # noqa: E402


class SleepingWorker(WorkerActor):
    """A worker of a given speed that holds no model: the chunk's compute time as a sleep."""

    speed = 100.0  # requests/s; the bench sets it on a subclass per run

    def __init__(self, spec, batching, rank: int = 0):
        self.rank, self.first = rank, None

    def facts(self) -> dict:  # the files of the model the head tokenizes with, as a real worker would report
        return {**collect(), "rank": self.rank, "model_files": fingerprint(MODEL), "model_path": str(MODEL),
                "max_length": 2048, "n_layers": 5, "restarted": False}  # fmt: skip

    def run(self, job, indices, requests):
        self.first = self.first or time.time()
        if self.speed != float("inf"):
            time.sleep(len(requests) / self.speed)
        return indices, [(0.0, False)] * len(requests)

    def first_chunk(self) -> float | None:
        return self.first


def mmlu_instances(limit: int | None) -> tuple[list, float]:
    """lm-eval's stock mmlu 5-shot loglikelihood Instances (limit questions per subject), and seconds to build."""
    from lm_eval.tasks import TaskManager, get_task_dict

    start = time.monotonic()
    leaves, todo = [], [get_task_dict(["mmlu"], TaskManager())]
    while todo:
        for value in todo.pop().values():
            (todo.append if isinstance(value, dict) else leaves.append)(value)
    instances = []
    for task in sorted(leaves, key=lambda t: t.config.task):
        task.set_config(key="num_fewshot", value=5)
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        instances += task.instances
    return instances, time.monotonic() - start


def timed_run(instances: list, workers: int, speed: float, cache: Path) -> tuple[float, float]:
    """(seconds of the loglikelihood call, seconds from the hand-over to the first chunk on a worker)."""
    import ray

    from driver.lm.mlx_ray import MLXRayLM

    if SleepingWorker.__module__ != "__main__":  # imported (not run): workers cannot import this file
        ray.cloudpickle.register_pickle_by_value(sys.modules[SleepingWorker.__module__])
    worker = type("Worker", (SleepingWorker,), {"speed": speed})
    model = type("SimulatedLM", (MLXRayLM,), {"actor_cls": worker})
    lm = model(pretrained=str(MODEL), workers=workers, cache=str(cache))  # on this process's Ray session
    try:
        lm.executor.wait_ready()
        start_wall, start = time.time(), time.monotonic()
        lm.loglikelihood(instances, disable_tqdm=True)
        seconds = time.monotonic() - start
        firsts = [t for t in ray.get([a.first_chunk.remote() for a in lm.executor.actors]) if t]
    finally:
        lm.executor.close()
    return seconds, min(firsts) - start_wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=30, help="questions per subject for tables 1-2 (57 subjects x 4 choices)")
    p.add_argument("--speed", type=float, default=100.0, help="requests/s of one simulated worker")
    p.add_argument("--workers", default="1,2,4,8,16")
    p.add_argument("--full", action="store_true", help="also the whole test split (~56k requests) on 16 workers")
    p.add_argument("--rerun", type=int, default=0, metavar="LIMIT",
                   help="also: `driver run` fully cached vs lm-eval's dummy model, mmlu 5-shot, LIMIT per subject")  # fmt: skip
    args = p.parse_args(argv)
    if not SHARED_MMLU.is_dir():
        print(f"no offline MMLU at {SHARED_MMLU}: nothing to measure")
        return 0
    work = Path(tempfile.mkdtemp(prefix="orchard-bench-scale-"))
    shutil.copytree(SHARED_MMLU, work / "hf" / SHARED_MMLU.name)
    os.environ.update(HF_DATASETS_CACHE=str(work / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    counts = [int(n) for n in args.workers.split(",")]
    if args.rerun:  # whole processes, each with its own embedded Ray: before this one starts its own
        cached_rerun(args.rerun, work)
    from cluster import connect

    connection = connect("local", local_workers=max(counts))  # one embedded session with an `mlx` unit per worker
    try:
        instances, built = mmlu_instances(args.limit)
        print(f"{len(instances)} mmlu 5-shot loglikelihood requests ({args.limit} per subject), built by lm-eval in {built:.1f} s; "
              f"head tokenizer: {MODEL.name}; {os.cpu_count()} CPUs; TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}")  # fmt: skip
        scaling(instances, counts, args.speed, work)
        head_alone(instances, max(counts), work)
        if args.full:
            everything, built = mmlu_instances(None)
            seconds, first = timed_run(everything, max(counts), args.speed, work / "cache-full")
            print(f"\nwhole test split: {len(everything)} requests built in {built:.1f} s; {max(counts)} workers at {args.speed:g} req/s: "
                  f"first chunk on a worker {first:.2f} s after the hand-over (target <= 1 s); {seconds:.1f} s in all "
                  f"(ideal {len(everything) / (max(counts) * args.speed):.1f} s)")  # fmt: skip
    finally:
        connection.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def scaling(instances: list, counts: list[int], speed: float, work: Path) -> None:
    print(f"\n1. speed-up over one worker, each simulated at {speed:g} requests/s (target >= 0.9 N)")
    print(f"{'workers':>8} {'seconds':>8} {'ideal s':>8} {'req/s':>8} {'speed-up':>9} {'/ N':>6} {'first chunk s':>14}")
    base = None
    for n in counts:
        seconds, first = timed_run(instances, n, speed, work / f"cache-{n}")
        base = base or seconds
        ideal = len(instances) / (n * speed)
        print(f"{n:>8} {seconds:>8.2f} {ideal:>8.2f} {len(instances) / seconds:>8.0f} {base / seconds:>8.2f}x "
              f"{base / seconds / n:>6.2f} {first:>14.2f}")  # fmt: skip


def head_alone(instances: list, n: int, work: Path) -> None:
    seconds, first = timed_run(instances, n, float("inf"), work / "cache-head")
    rate = len(instances) / seconds
    print(f"\n2. the head alone ({n} workers that answer at once): {rate:.0f} requests/s "
          f"(tokenize, cut, dispatch, cache, merge); first chunk after {first:.2f} s")  # fmt: skip
    print(f"   the head saturates at ~{rate / 100:.0f} workers of 100 req/s (Amdahl: beyond that, workers wait for it)")


def cached_rerun(limit: int, work: Path) -> None:
    """`driver run` (1 real worker) on stories260K, then the same command again (every request cached), against
    lm-eval's own `dummy` model building the same requests: wall seconds of whole processes (target <= 1.3x)."""
    import subprocess

    task = ["--tasks", "mmlu", "--limit", str(limit)]
    driver = [sys.executable, "-m", "driver", "run", "--model", str(MODEL), "--num-fewshot", "5", *task, "--workers", "1",
              "--output-path", str(work / "out"), "--cache", str(work / "rerun-cache")]  # fmt: skip
    dummy = [sys.executable, "-m", "lm_eval", "--model", "dummy", "--num_fewshot", "5", *task]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TQDM_DISABLE": "1"}

    said: list[str] = []

    def wall(cmd: list[str]) -> float:
        start = time.monotonic()
        out = subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, text=True).stdout
        said[:] = [line for line in out.splitlines() if "from cache" in line or "no workers" in line]
        return time.monotonic() - start

    first = wall(driver)
    times = {"lm-eval dummy": [], "driver run, all cached": []}
    for _ in range(2):  # alternated, best of two: other load on a shared machine hits both alike
        times["lm-eval dummy"].append(wall(dummy))
        times["driver run, all cached"].append(wall(driver))
    anchor = min(times["lm-eval dummy"])
    print(f"\n3. a fully cached rerun, mmlu 5-shot limit {limit} (first run, computing: {first:.1f} s)")
    for name, runs in times.items():
        print(f"   {name:<24} {min(runs):>7.1f} s  {min(runs) / anchor:>5.2f}x   (runs: {', '.join(f'{r:.1f}' for r in runs)})")
    print(f"   the rerun said: {said[0].strip() if said else '?'}")
    print("   target: the cached rerun <= 1.3x lm-eval's dummy run")


if __name__ == "__main__":
    raise SystemExit(main())
