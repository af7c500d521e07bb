"""Pipelined groups through the CLI (issue 26): `driver run --group-size 2` vs `--group-size 1`, by `scoring_s`.

    python bench/bench_pipeline_cli.py [--hidden 512] [--layers 8] [--docs 256] [--repeat 2] [--tasks orchard_mc]

What a user would type on one machine: `driver run --address local --threads 1 --workers 1` on a random llama
written here and testbed's offline tasks (`orchard_mc`: four-choice questions with 3 few-shot examples, so
prefix families; `--tasks orchard_mc,orchard_gen` adds greedy generation), once unsplit and once as one
pipeline group of 2 (two rank processes, a ring over 127.0.0.1). Each run has its own result cache (nothing is
read from a cache). The two alternate (1, 2, then 2, 1, ...) and each keeps its best of --repeat; compared by the
run summary's `scoring_s` (the executor's scoring phase: Ray start-up, ring forming and loading excluded) and
by wall time. Every run's lm-eval results (results_*.json) must equal the first one's, else the bench exits 1.
No core pinning: with --threads 1 the unsplit worker uses one core and the group's ranks one each, as K Macs would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(args, model: Path, tasks: Path, size: int, out: Path) -> dict:
    """One `driver run` in a process of its own; its summary (scoring_s, wall_s, groups) and its results."""
    cmd = ["driver", "run", "--model", str(model), "--include-path", str(tasks), "--tasks", args.tasks,
           "--address", "local", "--threads", "1", "--workers", "1", "--group-size", str(size),
           "--batch-size", str(args.batch), "--output-path", str(out), "--cache", str(out / "cache"), "--quiet"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    if proc.returncode:
        sys.exit(f"driver run --group-size {size} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(next(out.rglob("summary_*.json")).read_text())
    results = json.loads(next(p for p in out.rglob("results_*.json")).read_text())["results"]
    return {"scoring_s": summary["scoring_s"], "wall_s": time.perf_counter() - start, "results": results,
            "groups": summary.get("groups")}  # fmt: skip


def busy(run: dict) -> str:
    ranks = [r for g in run.get("groups") or [] for r in g.get("ranks", [])]
    fractions = [r.get("busy_fraction") for r in ranks]
    return " ".join(f"{f:.2f}" for f in fractions if f is not None) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tasks", default="orchard_mc")
    args = p.parse_args()
    from testbed.models import write_model
    from testbed.tasks import write_tasks

    folder = Path(tempfile.mkdtemp(prefix="bench-pipeline-cli-"))
    model = write_model(folder / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                        intermediate=args.hidden * 3, vocab_size=1024, max_positions=1024)  # fmt: skip
    tasks = write_tasks(folder / "tasks", n_docs=args.docs)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; random llama hidden {args.hidden} x "
          f"{args.layers} layers; {args.docs} documents of {args.tasks}; batch {args.batch}", flush=True)  # fmt: skip
    runs: dict[int, list[dict]] = {1: [], 2: []}
    try:
        for rep in range(args.repeat):
            for size in (1, 2) if rep % 2 == 0 else (2, 1):
                run = one_run(args, model, tasks, size, folder / f"out-{size}-{rep}")
                runs[size].append(run)
                print(f"  group size {size}: scoring {run['scoring_s']:.2f} s, wall {run['wall_s']:.1f} s, busy {busy(run)} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    same = all(r["results"] == runs[1][0]["results"] for rs in runs.values() for r in rs)
    best = {size: min(rs, key=lambda r: r["scoring_s"]) for size, rs in runs.items()}
    print("\n| run | best scoring_s | all (s) | vs unsplit | busy per rank |\n|---|---:|---:|---:|---|")
    for size, label in ((1, "driver run --group-size 1 (anchor)"), (2, "driver run --group-size 2 (pipelined)")):
        b = best[size]
        print(f"| {label} | {b['scoring_s']:.2f} | {' '.join('%.2f' % r['scoring_s'] for r in runs[size])} | "
              f"{best[1]['scoring_s'] / b['scoring_s']:.2f}x | {busy(b)} |")  # fmt: skip
    print(f"\nlm-eval results identical across runs: {same}; load average at the end {os.getloadavg()[0]:.1f}")
    if not same:
        sys.exit("the runs' lm-eval results differ: a group of 2 must give the unsplit numbers")


if __name__ == "__main__":
    main()
