"""Benchmark: what a sweep's evidence (issue 36: per-sample records, lm-eval's logged samples, steerability,
held-out selection, paired intervals, the steerability plots) adds to `driver sweep`'s wall time, without a judge.

    python bench/bench_evidence.py               # 5 sweeps: ~3 min on an idle 2-core CPU box
    python bench/bench_evidence.py --repeat 3

The sweep: the shipped TinyStories-260K (examples/stories260K), a random unit vector added at resid_post of its 5
layers × alphas -4 4 (10 configurations + the baseline), the happy study's 12 prompts (targets " happy" / " sad",
greedy 16-token generations) and the offline multiple-choice task orchard_mc (testbed.tasks, 12 documents, 3-shot),
`select: {fraction: 0.5, seed: 0}`; 1 worker on embedded local Ray, threads=1, a fresh result cache each run.

Variants, interleaved (A B, B A, ...), best of --repeat counts; timed: load_sweep + run + write_outputs, what
`driver sweep` does after its checks:
  with evidence      the sweep as shipped
  without evidence   lm-eval's log_samples off, no per-sample records, no analysis (driver.evidence) and no
                     steerability plots: the sweep before issue 36
`evidence s`: the seconds spent in the evidence's own functions (records, analysis, steerability plots) during the
sweep with evidence, timed as they run: its direct cost, which the box's noise does not blur as it blurs the
difference of two sweeps (the difference also holds lm-eval's log_samples).
Not a test: it asserts nothing, it prints a table (target: with / without <= 1.05).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_sweep(folder: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({f"resid_post.{i}": np.random.default_rng(i).standard_normal(64).astype(np.float32) for i in range(5)}, str(folder / "v.safetensors"))
    tasks = ""
    try:
        from testbed.tasks import write_tasks

        tasks = f"tasks: {{names: [orchard_mc], limit: 12, include_path: {write_tasks(folder / 'tasks')}}}\n"
    except ImportError:  # the demo tasks moved: prompts only
        pass
    (folder / "sweep.yaml").write_text(
        f"""model: {{pretrained: {ROOT / 'examples' / 'stories260K'}, max_length: 256, batch_size: 16}}
vectors: {{v: {{file: v.safetensors, normalize: true}}}}
grid: {{layers: all, alphas: [-4, 4]}}
prompts:
  - {{file: {ROOT / 'examples' / 'happy' / 'prompts.jsonl'}, max_gen_toks: 16, until: ["\\n"], target_score: sum}}
{tasks}select: {{fraction: 0.5, seed: 0}}
"""
    )
    return folder / "sweep.yaml"


@contextlib.contextmanager
def evidence_replaced(replace):
    """The evidence's own functions (records, analysis, steerability plots) each replaced by replace(name, function)
    while inside, put back after."""
    from driver.sweep import report, running

    places = [(running, "task_records"), (running, "prompt_records"), (report, "analyse"), (report.draw, "steerability_plots")]
    saved = [getattr(module, name) for module, name in places]
    for (module, name), fn in zip(places, saved):
        setattr(module, name, replace(name, fn))
    try:
        yield
    finally:
        for (module, name), fn in zip(places, saved):
            setattr(module, name, fn)


def without_evidence():
    """The sweep as before issue 36: no logged samples (one_sweep), no records, no analysis, no steerability plots."""
    from driver.evidence.analysis import Evidence

    nothing = {"task_records": lambda *a, **k: [], "prompt_records": lambda *a, **k: [],
               "analyse": lambda outcome, select=None: Evidence([], [], [], False), "steerability_plots": lambda rows: {}}  # fmt: skip
    return evidence_replaced(lambda name, fn: nothing[name])


def clocked(spent: list[float]):
    """The evidence's own functions timed as they run, their seconds summed into spent[0]: what the evidence costs
    directly, apart from lm-eval's log_samples, which only the difference of the two sweeps shows."""

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    return evidence_replaced(timed)


def one_sweep(path: Path, evidence: bool) -> tuple[float, float, int, float]:
    """(seconds, seconds in write_outputs, per-sample records, seconds in the evidence's own functions) of one sweep
    into a fresh folder and cache."""
    from driver.sweep import load_sweep, report, run

    spent = [0.0]
    with tempfile.TemporaryDirectory() as out, (clocked(spent) if evidence else without_evidence()):
        start = time.perf_counter()
        sweep = load_sweep(path)
        if not evidence and sweep.plan is not None:
            sweep.plan.log_samples = False
        outcome = run(sweep, workers="1", address="local", output=Path(out), threads=1, echo=lambda *a: None)
        mid = time.perf_counter()
        report.write_outputs(outcome, out)
        end = time.perf_counter()
        return end - start, end - mid, len(outcome.samples), spent[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="timed rounds of each variant (default 2)")
    args = p.parse_args(argv)
    times: dict[str, list[tuple[float, float, int, float]]] = {"with evidence": [], "without evidence": []}
    with tempfile.TemporaryDirectory() as folder:
        path = write_sweep(Path(folder))
        one_sweep(path, True)  # warm-up: imports, lm-eval's task index, the OS's file cache
        for r in range(args.repeat):
            for name in (("with evidence", "without evidence") if r % 2 == 0 else ("without evidence", "with evidence")):
                times[name].append(one_sweep(path, name == "with evidence"))
                print(f"  run {r + 1}: {name}: {times[name][-1][0]:.2f} s", flush=True)
    load = os.getloadavg()
    print(f"sweep wall time with and without the evidence (best of {args.repeat}, interleaved); {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '(none)')}")
    print(f"  {'variant':<18}{'best s':>8}{'report s':>10}{'records':>9}{'evidence s':>12}   runs (s)")
    for name, runs in times.items():
        best = min(runs)
        print(f"  {name:<18}{best[0]:>8.2f}{best[1]:>10.2f}{best[2]:>9}{best[3]:>12.2f}   " + " ".join(f"{r[0]:.2f}" for r in runs))
    ratio = min(times["with evidence"])[0] / min(times["without evidence"])[0]
    own = max(r[3] / r[0] for r in times["with evidence"])
    print(f"  with / without: {ratio:.3f} (target <= 1.05: {'met' if ratio <= 1.05 else 'not met'}); the evidence's own "
          f"functions: at most {100 * own:.1f} % of a sweep with evidence")
    print(json.dumps({"ratio": round(ratio, 4), "own_share": round(own, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
