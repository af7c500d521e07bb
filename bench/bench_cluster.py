"""Real scoring on the embedded Ray: 2 workers vs 1 on the same MMLU requests (target >= 1.7x on 2 cores).

    python bench/bench_cluster.py [--limit 1] [--hidden 128] [--layers 2] [--repeat 2]

Each worker is limited to one BLAS/OpenMP thread (`threads=1`), so on a 2-core machine two workers can use
both cores. The model is a random-weight llama written locally; the requests are lm-eval's stock MMLU
(all 57 subjects, 5-shot), read offline from ../shared/data/hf-datasets. Timed: the scoring phase (chunks dispatched until the
last result is merged), not Ray start-up or model loading; the best of --repeat runs each, alternating, as
other work on a shared machine can slow any one run. All runs must agree (max |ΔLL| ≤ 1e-5, the same greedy flags): only chunking and batching differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

SHARED_MMLU = Path(__file__).resolve().parents[2] / "shared" / "data" / "hf-datasets" / "cais___mmlu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=1, help="questions per subject")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if not SHARED_MMLU.is_dir():
        raise SystemExit(f"no offline MMLU at {SHARED_MMLU}")
    work = Path(tempfile.mkdtemp(prefix="orchard-bench-"))
    shutil.copytree(SHARED_MMLU, work / "hf" / SHARED_MMLU.name)
    os.environ.update(
        HF_DATASETS_CACHE=str(work / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import lm_eval
    from lm_eval.tasks import TaskManager

    from driver.lm.mlx_ray import MLXRayLM
    from testbed.models import write_model

    model = write_model(work / "model", hidden=args.hidden, layers=args.layers, intermediate=3 * args.hidden, max_positions=2048)
    manager = TaskManager()
    seconds: dict[int, list[float]] = {1: [], 2: []}
    answers = []
    for _ in range(args.repeat):
        for workers in (1, 2):
            lm = MLXRayLM.create_from_arg_obj({"pretrained": str(model), "workers": workers, "threads": 1, "address": "local"})
            try:
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=["mmlu"], num_fewshot=5, limit=args.limit, task_manager=manager, log_samples=True, verbosity="ERROR"
                )
                info = lm.executor.info()
            finally:
                lm.executor.close()
            seconds[workers].append(info["seconds"])
            answers.append([r for t in sorted(results["samples"]) for s in results["samples"][t] for (r,) in s["resps"]])
    n = sum(info["requests_computed"].values())
    print(f"\n{n} MMLU loglikelihood requests ({len(results['samples'])} subjects x {args.limit} questions x 4 choices, 5-shot)")
    print(f"model: random llama hidden={args.hidden} layers={args.layers}; MLX {info['facts'][0]['mlx']} on CPU")
    print(f"BLAS on the workers: {info['facts'][0]['blas']}")
    print(f"{'workers':>8} {'best s':>8} {'all runs (s)':>24} {'requests/s':>11}")
    for workers, runs in seconds.items():
        print(f"{workers:>8} {min(runs):>8.2f} {' '.join(f'{r:.1f}' for r in runs):>24} {n / min(runs):>11.1f}")
    # Runs differ only in how requests are chunked and batched: float32 sums in other orders (target <= 1e-5)
    delta = max(abs(x[0] - y[0]) for a in answers for x, y in zip(a, answers[0]))
    flags = sum(x[1] != y[1] for a in answers for x, y in zip(a, answers[0]))
    print(f"speed-up 2 vs 1: {min(seconds[1]) / min(seconds[2]):.2f}x (target >= 1.7); max |dLL| between runs {delta:.1e} (target <= 1e-5), greedy flags that differ: {flags}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
