"""Time to the error for every pre-flight and settings mistake of tests/test_errors.py, as real `python -m driver`
subprocesses (sequential, so each number is one process on an otherwise idle box), plus what it is made of:
the interpreter and `import driver`, lm-eval's task index (what every mistake used to wait for) and Orchard's
scan of the same names.

    python bench/bench_errors.py            # the table
    python bench/bench_errors.py --parity   # also: Orchard's task-name scan == lm-eval's TaskManager index
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=env, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parity", action="store_true", help="compare the task-name scan with lm-eval's TaskManager")
    opts = parser.parse_args()

    from testbed.models import write_model
    from testbed.tasks import write_tasks

    import test_errors as t

    with tempfile.TemporaryDirectory(prefix="orchard-bench-errors-") as tmp:
        tmp = Path(tmp)
        env = {**t.base_env(tmp / "home"), "ORCHARD_HOME": str(tmp / "orchard-home"), "HF_DATASETS_CACHE": str(tmp / "ds")}
        world = t.World(write_model(tmp / "model", arch="llama"), write_tasks(tmp / "tasks"), tmp / "cases", env)
        py = [sys.executable]
        print(f"{'python -c pass':<44} {timed([*py, '-c', 'pass'], env):6.2f} s")
        print(f"{'python -c import driver':<44} {timed([*py, '-c', 'import driver'], env):6.2f} s")
        print(f"{'python -m driver --help':<44} {timed([*py, '-m', 'driver', '--help'], env):6.2f} s")
        code = "import time; from lm_eval.tasks import TaskManager; t = time.perf_counter(); TaskManager(); print(time.perf_counter() - t)"
        print(f"{'lm-eval TaskManager() (old time to error)':<44} {timed([*py, '-c', code], env):6.2f} s")
        code = "from driver.checks.tasks import scan_task_names, _lm_eval_tasks; scan_task_names(_lm_eval_tasks()[0])"
        print(f"{'Orchard task-name scan (cold)':<44} {timed([*py, '-c', code], env):6.2f} s")
        print()
        print(f"{'case':<34} {'exit':>4} {'seconds':>8}  error")
        times = []
        for case in t.SETTINGS + t.PREFLIGHT:
            folder = world.tmp / case.name.replace(" ", "_").replace(",", "")
            folder.mkdir(parents=True, exist_ok=True)
            argv = [*py, "-m", "driver", *t._argv(case, world, folder)]
            start = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env={**env, **case.env}, cwd=folder, timeout=300)
            seconds = time.perf_counter() - start
            times.append(seconds)
            first = (proc.stderr.strip().splitlines() or [""])[0]
            print(f"{case.name:<34} {proc.returncode:>4} {seconds:8.2f}  {first[:110]}")
        times.sort()
        print(f"\n{len(times)} cases: median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s, under 5 s: {sum(s < 5 for s in times)}")
        if opts.parity:
            from lm_eval.tasks import TaskManager

            from driver.checks.tasks import _lm_eval_tasks, scan_task_names

            ours, theirs = scan_task_names(_lm_eval_tasks()[0]), set(TaskManager().all_tasks)
            print(f"task names: scan {len(ours)}, TaskManager {len(theirs)}, only in scan {len(ours - theirs)}, only in TaskManager {len(theirs - ours)}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
