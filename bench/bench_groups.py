"""Worker groups on the embedded Ray (issue 17): peak memory per rank, 2 groups vs 1, a pipeline group vs one worker.

    python bench/bench_groups.py [--hidden 256] [--layers 4] [--requests 96] [--tokens 48] [--repeat 2]

The model is a random-weight llama written locally (8 heads, 4 kv heads: tensor splits up to 4). Every rank and
worker is one process limited to one BLAS/OpenMP thread (`threads=1`), ring over 127.0.0.1. Timed: the scoring
phase of one loglikelihood job (executor.run: chunks dispatched until the last result is merged), not Ray start-up,
ring forming or loading; the runs alternate (anchor, 1 group of 2, 2 groups of 2) and each keeps its best of
--repeat, as other work on a shared machine can slow any one run. Every run must agree with the anchor (one unsplit
worker) within 1e-5. Peak memory per rank is MLX's peak (worker.split.peak_memory_gb) after a job, K = 1 measured
in this process on the same job; the fixed overhead is the K = 1 peak minus the weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def requests(n: int, tokens: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [((1, *rng.integers(3, 1000, tokens - 4).tolist()), tuple(rng.integers(3, 1000, 3).tolist())) for _ in range(n)]


def run(model: Path, reqs: list, *, workers: int = 1, size: int = 1, split: str = "pipeline") -> dict:
    """One executor on the embedded Ray: its scoring seconds, results and per-rank peak memory."""
    from driver.lm.mlx_ray import ray_executor
    from worker.spec import Batching, Grouping, Job, ModelSpec

    spec, batching = ModelSpec(model=str(model), max_length=256), Batching(batch_size=8, max_batch_tokens=512)
    ex = ray_executor(spec, batching, model_identity={"model": str(model)}, max_length=256, workers=workers,
                      address="local", threads=1, grouping=Grouping(size=size, split=split))  # fmt: skip
    try:
        ex.wait_ready()
        results = ex.run(Job(kind="loglikelihood"), reqs)
        info = ex.info()
    finally:
        ex.close()
    peaks = [r["peak_memory_gb"] for g in info.get("groups", []) for r in g["ranks"]]
    return {"seconds": info["seconds"], "results": results, "peaks": peaks, "blas": info["facts"][0]["blas"]}


def in_process_peak(model: Path, reqs: list) -> float:
    """K = 1: MLX's peak in this process after loading the model and scoring the same requests."""
    import mlx.core as mx

    from worker.jobs import run as run_job
    from worker.load import load
    from worker.spec import Batching, Job, ModelSpec

    mx.reset_peak_memory()
    lm = load(ModelSpec(model=str(model), max_length=256))
    run_job(lm, Job(kind="loglikelihood"), reqs, Batching(batch_size=8, max_batch_tokens=512))
    return mx.get_peak_memory() / 1e9


def delta(a: list, b: list) -> float:
    return max(abs(x[0] - y[0]) for x, y in zip(a, b))


def speed(args, model: Path, reqs: list) -> tuple[dict, str]:
    """Best seconds per configuration, interleaved; the largest |dLL| against the anchor."""
    configs = {"1 worker (anchor)": {}, "1 group of 2 (pipeline)": {"size": 2}, "2 groups of 2 (pipeline)": {"size": 2, "workers": 2}}
    best: dict = {name: [] for name in configs}
    anchor, worst, blas = None, 0.0, "?"
    for _ in range(args.repeat):
        for name, options in configs.items():
            out = run(model, reqs, **options)
            best[name].append(out["seconds"])
            anchor = anchor or out["results"]
            worst, blas = max(worst, delta(out["results"], anchor)), out["blas"]
    return best, f"max |dLL| vs the anchor {worst:.1e} (target <= 1e-5); BLAS on the workers: {blas}"


def memory(model: Path, reqs: list) -> list[tuple]:
    rows = [("-", 1, [in_process_peak(model, reqs)])]
    for split in ("pipeline", "tensor"):
        for size in (2, 4):
            rows.append((split, size, run(model, reqs, size=size, split=split)["peaks"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from testbed.models import write_model
    from worker.load import weights_bytes

    work = Path(tempfile.mkdtemp(prefix="orchard-bench-groups-"))
    model = write_model(work / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, intermediate=3 * args.hidden)
    reqs = requests(args.requests, args.tokens)
    start = time.monotonic()
    best, agreement = speed(args, model, reqs)
    rows = memory(model, reqs[:16])
    weights = weights_bytes(model) / 1e9
    load = os.getloadavg()
    print(f"\nrandom llama hidden={args.hidden} layers={args.layers} ({weights * 1e3:.1f} MB of weights); "
          f"{args.requests} loglikelihood requests of {args.tokens} tokens; threads=1 per process; "
          f"load average {load[0]:.1f} on {os.cpu_count()} CPUs; {time.monotonic() - start:.0f} s in all")  # fmt: skip
    print(agreement)
    anchor, one_group = min(best["1 worker (anchor)"]), min(best["1 group of 2 (pipeline)"])
    print(f"{'run':<26} {'best s':>7} {'all runs (s)':>16} {'tokens/s':>9} {'vs anchor':>10}")
    for name, runs in best.items():
        tps = args.requests * args.tokens / min(runs)
        print(f"{name:<26} {min(runs):>7.2f} {' '.join(f'{r:.2f}' for r in runs):>16} {tps:>9.0f} {anchor / min(runs):>9.2f}x")
    print(f"2 groups of 2 vs 1 group of 2: {one_group / min(best['2 groups of 2 (pipeline)']):.2f}x (target >= 1.8)")
    print(f"pipeline group of 2 vs one unsplit worker: {anchor / one_group:.2f}x (the loopback communication floor)")
    overhead = rows[0][2][0] - weights
    print(f"\npeak memory per rank (GB); fixed overhead = K=1 peak - weights = {overhead:.3f} GB")
    print(f"{'split':<9} {'K':>2} {'per rank':>32} {'bound 1.15*W/K+overhead':>24}")
    for split, size, peaks in rows:
        bound = 1.15 * weights / size + overhead
        ok = all(p <= bound for p in peaks) if peaks else False
        print(f"{split:<9} {size:>2} {' '.join(f'{p:.4f}' for p in peaks):>32} {bound:>17.4f} {'ok' if ok else 'OVER'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
