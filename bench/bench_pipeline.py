"""Pipelined worker groups (issue 26): one pipeline group of 2, lockstep vs pipelined, against one unsplit worker.

    python bench/bench_pipeline.py [--hidden 512] [--layers 8] [--docs 256] [--tokens 48] [--batch 8] [--repeat 2]
                                   [--gen-rows 64] [--new-tokens 32] [--gen-batch 16] [--shot-tokens 256]

The model is a random-weight llama written locally. Every rank (and the unsplit anchor) is one process pinned to
a core of its own (os.sched_setaffinity: rank r on core r) with one BLAS/OpenMP thread and Debian's OpenBLAS
preloaded when present, ring over 127.0.0.1, no Ray: it measures what K Macs would do, on K cores. The job: MMLU-
like documents, each a context and four one-token choices (lm-eval's 4 requests, one row). Timed: the kernel
only (worker.score), after loading and a warm-up job, from a barrier to the last rank's results. The group runs
both kernels on one ring, alternating; the anchor and the group alternate too, and each keeps its best of
--repeat. "overlap": each send on a stream of its own while the next micro-batch computes
(worker.split.stages.OVERLAP). Every run must agree with the anchor within 1e-5 (the tensor split within 1e-4), else the bench exits 1. Busy: the share of the job each rank spent computing
(worker.split.stages.CLOCK), the rest waiting in transfers. Generation: --gen-rows distinct prompts, and as many
few-shot prompts (one --shot-tokens prefix shared by all, each its own --tokens question: its KV computed once
per job, the store holding no earlier copy), greedy, --new-tokens each, texts compared with the anchor's. Capture
and grid rows (issue 26.3): each document's context captured at its last token at --points (one on each rank),
unsplit vs pipelined; a loglikelihood grid of --grid-docs documents x (unsteered + one configuration per layer),
the unsplit grid (blocks below each split run once) and each configuration alone on one worker vs the pipelined
group (worker.grid.pipelined); a generation grid of --grid-docs / 2 few-shot prompts (another --shot-tokens prefix)
x the same configurations, the unsplit grid (prompt KV shared where configurations allow) vs the pipelined group
(the prefix's KV once per distinct steering of prompt positions), texts compared.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def documents(n: int, tokens: int, vocab: int, seed: int = 0) -> list:
    """n contexts of `tokens` tokens, each with four one-token choices (one shared context object, as lm-eval's);
    ids inside the model's vocabulary (write_model's tokenizer may hold fewer than asked: an id past it reads
    outside the embedding)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ctx = (1, *rng.integers(3, vocab, tokens - 1).tolist())
        out += [(ctx, (c,)) for c in (30, 31, 32, 33)]
    return out


def _env() -> dict:
    from cluster.facts import fast_blas

    env = {**os.environ, **dict.fromkeys(THREAD_VARS, "1"), "PYTHONPATH": str(ROOT)}
    preload = fast_blas()
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = preload
    return env


def launch(task: dict, size: int, folder: Path, split: str = "pipeline", parallel: int = 0) -> list[dict]:
    """One process per rank (`--rank R`), pinned to its core; their reports in rank order. `parallel` > 0:
    that many unsplit workers instead (data parallel), worker w on core w with every parallel-th document."""
    from worker.split import free_address

    name = f"{split}{size}p{parallel}"
    if parallel:
        paths = [folder / f"{name}w{w}.pkl" for w in range(parallel)]
        for w, path in enumerate(paths):
            path.write_bytes(pickle.dumps({**task, "size": 1, "split": split, "reqs": _share(task["reqs"], w, parallel),
                                           "gen": task["gen"][w::parallel], "fewshot": [], "more": False}))  # fmt: skip
    else:
        task = {**task, "size": size, "split": split, "hostfile": [free_address("127.0.0.1") for _ in range(size)]}
        paths = [folder / f"{name}.pkl"] * size
        paths[0].write_bytes(pickle.dumps(task))
    procs = [subprocess.Popen([sys.executable, __file__, "--task", str(path), "--rank", str(r)], env=_env()) for r, path in enumerate(paths)]
    try:
        codes = [p.wait(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"a rank exited {codes}")
    return [pickle.loads(path.with_suffix(f".rank{r}.pkl").read_bytes()) for r, path in enumerate(paths)]


def _share(reqs: list, w: int, n: int) -> list:
    """Worker w's documents (4 requests each) of n data-parallel workers."""
    docs = [reqs[i : i + 4] for i in range(0, len(reqs), 4)]
    return [r for d in docs[w::n] for r in d]


def _barrier(group) -> None:
    import mlx.core as mx

    if group is not None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


def _timed(lm, kernel, reqs, batching, group) -> dict:
    from worker.split.stages import CLOCK

    _barrier(group)
    CLOCK.busy = CLOCK.wait = 0.0
    start = time.perf_counter()
    results = kernel(lm, reqs, batching)
    return {"seconds": time.perf_counter() - start, "results": results, "busy": CLOCK.busy, "wait": CLOCK.wait}


def _overlapped(lm, reqs, batching):
    """The pipelined kernel with each send on a stream of its own (worker.split.stages.OVERLAP)."""
    from worker.score import pipelined_loglikelihood
    from worker.split import stages

    stages.OVERLAP = True
    try:
        return pipelined_loglikelihood(lm, reqs, batching)
    finally:
        stages.OVERLAP = False


def _unsplit_generate(lm, reqs, batching):
    from worker.generate import generate

    return generate(lm, reqs, batch_size=batching.batch_size, prefix_reuse=batching.prefix_reuse)


def _kernels(size: int, split: str) -> tuple[dict, dict]:
    """The scoring kernels a process of this kind runs, and its generation kernels with the prompts each takes."""
    from worker.score import loglikelihood, pipelined_loglikelihood
    from worker.split.decode import generate as pipelined_generate

    if size == 1:
        return {"unsplit": loglikelihood}, {"gen_unsplit": (_unsplit_generate, "gen"), "fewshot_unsplit": (_unsplit_generate, "fewshot")}
    if split == "tensor":
        return {"tensor": loglikelihood}, {}
    return ({"lockstep": loglikelihood, "pipelined": pipelined_loglikelihood, "overlapped": _overlapped},
            {"gen_pipelined": (pipelined_generate, "gen"), "fewshot_pipelined": (pipelined_generate, "fewshot")})  # fmt: skip


def _steerings(layers: int, hidden: int) -> list:
    """The grid: unsteered, and one configuration steering each layer (a random direction, alpha 2)."""
    import numpy as np

    from worker.spec import Intervention, Steering

    rng = np.random.default_rng(3)
    return [Steering()] + [Steering(interventions=(Intervention(layer=layer, vector=tuple(rng.standard_normal(hidden).tolist()),
                                                                alpha=2.0),)) for layer in range(layers)]  # fmt: skip


def _each_alone(lm, steerings, reqs, batching) -> list:
    """The grid one configuration at a time ([request][configuration], as run_grid gives it): no sharing."""
    from worker.jobs import run
    from worker.spec import Job

    cols = [run(lm, Job(kind="loglikelihood", steering=s), reqs, batching) for s in steerings]
    return [list(row) for row in zip(*cols)]


def _more_kernels(size: int, split: str, task: dict) -> dict:
    """Capture and grid kernels, {name: (kernel(lm, requests, batching), the task's requests key)} (issue 26.3)."""
    from worker.capture import capture, pipelined_capture
    from worker.grid import run_grid

    points, steerings = task["points"], task["steerings"]
    cap = lambda kernel: (lambda lm, reqs, b: kernel(lm, reqs, points, b), "cap")  # noqa: E731
    grid = (lambda lm, reqs, b: run_grid(lm, "loglikelihood", steerings, reqs, b), "grid")
    fewgrid = (lambda lm, reqs, b: run_grid(lm, "generate", steerings, reqs, b), "fewgrid")
    if size == 1:
        return {"cap_unsplit": cap(capture), "grid_unsplit": grid, "grid_alone": (lambda lm, reqs, b: _each_alone(lm, steerings, reqs, b), "grid"),
                "fewgrid_unsplit": fewgrid}  # fmt: skip
    return {"cap_pipelined": cap(pipelined_capture), "grid_pipelined": grid, "fewgrid_pipelined": fewgrid} if split == "pipeline" else {}


def rank_main(task_path: str, rank: int) -> None:
    """A rank (or the anchor, size 1): load, warm up, then run each kernel named in the task, timed."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    from cluster.facts import blas
    from worker.load import load
    from worker.spec import Batching, Grouping, ModelSpec
    from worker.split import join

    task = pickle.loads(Path(task_path).read_bytes())
    size = task["size"]
    group = join(task["hostfile"], rank) if size > 1 else None
    lm = load(ModelSpec(model=task["model"], max_length=512), group=group, grouping=Grouping(size=size, split=task["split"]))
    kernels, gens = _kernels(size, task["split"])
    batching = Batching(batch_size=task["batch"])
    gen_batching = {"gen": Batching(batch_size=task["gen_batch"], prefix_reuse=False), "fewshot": Batching(batch_size=task["gen_batch"])}
    for kernel in kernels.values():  # warm-up: first-call costs out of the timing
        kernel(lm, task["reqs"][:32], batching)
    for kernel, prompts in gens.values():  # few-shot: another prefix (the timed job's is in no store)
        kernel(lm, task[prompts + "_warm"], gen_batching[prompts])
    report = {"blas": blas(), "cpus": sorted(os.sched_getaffinity(0))}
    for name, kernel in kernels.items():
        report[name] = _timed(lm, kernel, task["reqs"], batching, group)
    for name, (kernel, prompts) in gens.items():
        report[name] = _timed(lm, kernel, task[prompts], gen_batching[prompts], group)
    for name, (kernel, key) in (_more_kernels(size, task["split"], task) if task.get("more", True) else {}).items():
        kernel(lm, task.get(key + "_warm", task[key][:8]), batching)  # warm-up (few-shot: another prefix)
        report[name] = _timed(lm, kernel, task[key], batching, group)
    Path(task_path).with_suffix(f".rank{rank}.pkl").write_bytes(pickle.dumps(report))


def _job_row(reports: list[dict], name: str, data_parallel: bool = False) -> dict:
    """The job's seconds (its slowest rank), the last rank's results (every worker's, in document order, for
    data-parallel workers), each rank's busy share of the job."""
    seconds = max(r[name]["seconds"] for r in reports)
    results = reports[-1][name]["results"]
    if data_parallel:  # documents were dealt round-robin: 4 requests (or 1 generation row) each
        per = 4 if name == "unsplit" else 1
        parts = [[r[name]["results"][i : i + per] for i in range(0, len(r[name]["results"]), per)] for r in reports]
        results = [x for k in range(max(map(len, parts))) for p in parts if k < len(p) for x in p[k]]
    return {"seconds": seconds, "results": results, "busy": [r[name]["busy"] / seconds for r in reports]}


ROWS = {  # table row: (launch kind, kernel name)
    "1 unsplit worker (anchor)": ("anchor", "unsplit"),
    "2 unsplit workers, data parallel": ("dp", "unsplit"),
    "1 group of 2, tensor split": ("tensor", "tensor"),
    "1 group of 2, lockstep (before)": ("group", "lockstep"),
    "1 group of 2, pipelined": ("group", "pipelined"),
    "1 group of 2, pipelined + overlap": ("group", "overlapped"),
    "generate: 1 unsplit worker (anchor)": ("anchor", "gen_unsplit"),
    "generate: 1 group of 2, pipelined": ("group", "gen_pipelined"),
    "generate few-shot: 1 unsplit worker (anchor)": ("anchor", "fewshot_unsplit"),
    "generate few-shot: 1 group of 2, pipelined": ("group", "fewshot_pipelined"),
    "capture: 1 unsplit worker (anchor)": ("anchor", "cap_unsplit"),
    "capture: 1 group of 2, pipelined": ("group", "cap_pipelined"),
    "grid: 1 unsplit worker, shared blocks (anchor)": ("anchor", "grid_unsplit"),
    "grid: 1 unsplit worker, each alone": ("anchor", "grid_alone"),
    "grid: 1 group of 2, pipelined": ("group", "grid_pipelined"),
    "few-shot grid: 1 unsplit worker (anchor)": ("anchor", "fewgrid_unsplit"),
    "few-shot grid: 1 group of 2, pipelined": ("group", "fewgrid_pipelined"),
}
ANCHORS = {"generate": "generate: 1 unsplit worker (anchor)", "generate few-shot": "generate few-shot: 1 unsplit worker (anchor)",
           "capture": "capture: 1 unsplit worker (anchor)",
           "grid": "grid: 1 unsplit worker, shared blocks (anchor)",
           "few-shot grid": "few-shot grid: 1 unsplit worker (anchor)"}  # fmt: skip


def _anchor(name: str) -> str:
    return ANCHORS.get(name.partition(":")[0], "1 unsplit worker (anchor)")


def _worst(best: dict, anchor: str, values, only=lambda name: True) -> float:
    """Max |difference| between the numbers (`values(row)`: an array) of each row measured against `anchor` and its."""
    import numpy as np

    rows = [row for name, row in best.items() if _anchor(name) == anchor and only(name)]
    return max(float(np.abs(values(row) - values(best[anchor])).max()) for row in rows)


def _launch_all(task: dict, folder: Path) -> dict:
    return {"anchor": launch(task, 1, folder), "group": launch(task, 2, folder), "dp": launch(task, 1, folder, parallel=2),
            "tensor": launch(task, 2, folder, split="tensor")}  # fmt: skip


def measure(args, model: Path, reqs: list, gen: dict, folder: Path) -> tuple[dict, dict]:
    """Interleaved runs: {config: [seconds...]}, and the best run's row per config. `gen`: the generation prompts
    by kind (gen, fewshot, and each one's _warm)."""
    task = {"model": str(model), "reqs": reqs, "batch": args.batch, **gen, "gen_batch": args.gen_batch,
            "cap": [(ctx, -1) for ctx, _ in reqs[::4]], "points": args.points, "grid": reqs[: 4 * args.grid_docs],
            "steerings": _steerings(args.layers, args.hidden)}  # fmt: skip
    runs: dict = {name: [] for name in ROWS}
    best: dict = {}
    for _ in range(args.repeat):
        launched = _launch_all(task, folder)
        for name, (kind, kernel) in ROWS.items():
            row = _job_row(launched[kind], kernel, data_parallel=kind == "dp")
            runs[name].append(row["seconds"])
            if name not in best or row["seconds"] < best[name]["seconds"]:
                best[name] = {**row, "blas": launched["anchor"][0]["blas"]}
    return runs, best


def report(args, runs: dict, best: dict, weights_mb: float, elapsed: float) -> None:
    import numpy as np

    anchor = best["1 unsplit worker (anchor)"]
    lls = lambda row: np.array([lp for lp, _ in row["results"]])  # noqa: E731
    worst = _worst(best, "1 unsplit worker (anchor)", lls, only=lambda name: "tensor" not in name)
    worst_tensor = _worst(best, "1 unsplit worker (anchor)", lls, only=lambda name: "tensor" in name)
    worst_cap = _worst(best, ANCHORS["capture"], lambda row: np.array(row["results"]))
    worst_grid = _worst(best, ANCHORS["grid"], lambda row: np.array([[lp for lp, _ in r] for r in row["results"]]))
    same = [sum(a == b for a, b in zip(best[f"{kind}: 1 group of 2, pipelined"]["results"], best[ANCHORS[kind]]["results"]))
            for kind in ("generate", "generate few-shot", "few-shot grid")]  # fmt: skip
    load = os.getloadavg()
    print(f"\nrandom llama hidden={args.hidden} layers={args.layers} ({weights_mb:.0f} MB); {args.docs} documents x 4 choices "
          f"of {args.tokens} tokens; batch {args.batch} ({-(-args.docs // args.batch)} micro-batches); generate {args.gen_rows} rows x "
          f"{args.new_tokens} tokens, batch {args.gen_batch} (few-shot: a {args.shot_tokens}-token prefix shared); one core and one BLAS thread per process ({anchor['blas']}); "
          f"load average {load[0]:.1f} {load[1]:.1f} on {os.cpu_count()} CPUs; {elapsed:.0f} s")  # fmt: skip
    print(f"max |dLL| vs the anchor {worst:.1e} (pipeline and data parallel: target <= 1e-5), tensor split {worst_tensor:.1e} (<= 1e-4); generated texts identical {same[0]}/{args.gen_rows}, "
          f"few-shot {same[1]}/{args.gen_rows}, few-shot grid {same[2]}/{args.grid_docs // 2} rows; captured rows max |d| "
          f"{worst_cap:.1e}; grid max |dLL| {worst_grid:.1e}")  # fmt: skip
    print(f"capture: {len(best['capture: 1 unsplit worker (anchor)']['results'])} rows at {', '.join(args.points)}; grid: "
          f"{args.grid_docs} documents x {args.layers + 1} configurations (unsteered, one per layer); few-shot generation "
          f"grid: {args.grid_docs // 2} few-shot prompts (another prefix) x the same configurations")  # fmt: skip
    print(f"| {'run':<46} | best s | all runs (s) | vs anchor | busy per rank |")
    print(f"|{'-' * 48}|-------:|-------------:|----------:|---------------|")
    for name, row in best.items():
        base = best[_anchor(name)]
        busy = " ".join(f"{b:.2f}" for b in row["busy"]) if "pipelined" in name else "-"
        all_runs = " ".join(f"{s:.2f}" for s in runs[name])
        print(f"| {name:<46} | {row['seconds']:6.2f} | {all_runs:>12} | {base['seconds'] / row['seconds']:8.2f}x | {busy:<13} |")
    dp = best["2 unsplit workers, data parallel"]["seconds"]
    print(f"pipelined group of 2 vs 2 data-parallel workers: {dp / best['1 group of 2, pipelined']['seconds']:.2f}x (target >= 0.85)")
    wrong = [what for what, bad in (("log-likelihoods (> 1e-5)", worst > 1e-5), ("the tensor split's (> 1e-4)", worst_tensor > 1e-4),
                                    ("generated texts", any(n < total for n, total in zip(same, (args.gen_rows, args.gen_rows, args.grid_docs // 2)))),
                                    ("captured rows or grid numbers (> 1e-5)", max(worst_cap, worst_grid) > 1e-5)) if bad]  # fmt: skip
    if wrong:
        sys.exit(f"runs disagree with their anchors: {', '.join(wrong)}")


def generations(n: int, tokens: int, vocab: int, new: int, seed: int = 1, shots: int = 0) -> list:
    """n prompts, greedy, `new` tokens each: distinct, or (`shots` > 0) one `shots`-token few-shot prefix shared by
    all, each its own `tokens` after it."""
    import numpy as np

    from worker.generate import GenRequest

    rng = np.random.default_rng(seed)
    prefix = (1, *rng.integers(3, vocab, shots - 1).tolist()) if shots else (1,)
    return [GenRequest(context=(*prefix, *rng.integers(3, vocab, tokens - 1).tolist()), max_gen_toks=new) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--gen-rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--gen-batch", type=int, default=16)
    parser.add_argument("--shot-tokens", type=int, default=256)
    parser.add_argument("--grid-docs", type=int, default=32)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        return rank_main(args.task, args.rank)
    args.points = (f"resid_post.{args.layers // 2 - 1}", f"resid_post.{args.layers - 1}")  # one on each rank
    from testbed.models import write_model
    from worker.load import weights_bytes

    folder = Path(tempfile.mkdtemp(prefix="orchard-bench-pipeline-"))
    try:
        model = write_model(folder / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, intermediate=3 * args.hidden)
        start = time.monotonic()
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        gen = {"gen": generations(args.gen_rows, args.tokens, vocab, args.new_tokens),
               "fewshot": generations(args.gen_rows, args.tokens, vocab, args.new_tokens, shots=args.shot_tokens),
               "gen_warm": generations(4, args.tokens, vocab, args.new_tokens, seed=2),
               "fewshot_warm": generations(4, args.tokens, vocab, args.new_tokens, seed=3, shots=args.shot_tokens),
               "fewgrid": generations(args.grid_docs // 2, args.tokens, vocab, args.new_tokens, seed=4, shots=args.shot_tokens),
               "fewgrid_warm": generations(4, args.tokens, vocab, args.new_tokens, seed=5, shots=args.shot_tokens)}
        runs, best = measure(args, model, documents(args.docs, args.tokens, vocab), gen, folder)
        report(args, runs, best, weights_bytes(model) / 1e6, time.monotonic() - start)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
