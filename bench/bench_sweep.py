"""Benchmark: a steering sweep (layers x alphas) as one grid against looping over its configurations.

    python bench/bench_sweep.py                  # full run (~10 min on a 2-core CPU box, reference BLAS)
    python bench/bench_sweep.py --quick          # smoke run (~2-3 min)
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_sweep.py

One random-weight llama (hidden 256, 8 layers, so that "the upper half" is layers 4..7) with the GPT-2
tokenizer, as in bench_worker.py; requests are lm-eval `mmlu` 5-shot loglikelihood requests built from the real
MMLU CSVs at ../shared/data/mmlu (synthetic questions when that folder is absent). The grid: 5 alphas x 2 layers
in the upper half (`add` of a random vector at resid_post of layers 4 and 6), 10 configurations. Parts:

  1 one worker  (in this process; the anchor is the grid)
    grid                   worker.jobs.run(Job(kind="loglikelihood", grid=configs)) on the loaded model: what
                           one actor runs; blocks 0..4 once per request, blocks 5..7 once per configuration
    independent runs       the same 10 configurations, one steered run each on the same loaded model
                           (Job(kind="loglikelihood", steering=s)): target grid >= 1.5x faster
    sweep end to end       build one lm-eval model (driver.lm.mlx.MLXLM), tokenize once, executor.run_grid
    reload loop            what lm-eval `steered` users do today: per configuration build a new lm-eval model
                           with that steering (MLXLM(..., steer=s): tokenizer, weights) and score the
                           instances: target grid >= 3x faster (also printed: against "sweep end to end")
  2 workers     RayExecutor.run_grid of the same grid on 1 and on 2 workers (embedded local Ray, one
                BLAS/OpenMP thread per worker, as bench_cluster.py): target 2 workers >= 1.7x faster. Timed: the
                run_grid call (dispatch until the last result is merged), not Ray start-up or model loading.

Variants are interleaved (A B, B A, ...) and the best of --repeat runs counts. Every variant's numbers are
compared with the grid's (max |dLL|). Not a test: it asserts nothing, it prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_worker as bw  # noqa: E402  (model, MMLU requests)

LAYERS, HIDDEN = 8, 256
GRID_LAYERS = (4, 6)  # the upper half of 8 blocks
ALPHAS = (-8.0, -4.0, 2.0, 4.0, 8.0)
TARGETS = {"independent runs": 1.5, "reload loop": 3.0, "2 workers": 1.7}


def blas_line() -> str:
    """Which BLAS MLX runs with in this process (numpy's own scipy_openblas serves numpy only: left out)."""
    import mlx.core as mx

    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    a = mx.ones((8, 8))
    mx.eval(a @ a)
    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if ".so" in line}
    names = sorted(os.path.basename(p) for p in libs if "numpy.libs" not in p and "scipy_openblas" not in p)
    if any("openblas" in n.lower() for n in names):
        return f"OpenBLAS (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')})"
    bundled = [n for n in names if "blas" in n.lower()]
    hint = f"; ~10x faster: LD_PRELOAD={bw.OPENBLAS}" if Path(bw.OPENBLAS).exists() else ""
    return f"reference BLAS bundled with mlx ({bundled[0] if bundled else 'unknown'}){hint}"


def grid_configs():
    import numpy as np

    from worker.spec import Intervention, Steering

    rng = np.random.default_rng(0)
    out = []
    for layer in GRID_LAYERS:
        v = rng.standard_normal(HIDDEN).astype(np.float32)
        v = tuple((v / np.linalg.norm(v)).tolist())
        out += [Steering(interventions=(Intervention(layer=layer, vector=v, alpha=a),)) for a in ALPHAS]
    return out


def interleave(variants: dict, repeats: int) -> tuple[dict[str, list[float]], dict]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict = {}
    names = list(variants)
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            outputs[name] = variants[name]()
            times[name].append(time.perf_counter() - t)
    return times, outputs


def max_delta(a: list[list], b: list[list]) -> str:
    """[configuration][request] results: max |dLL| and greedy flags that differ."""
    worst, flips = 0.0, 0
    for x, y in zip(a, b):
        for p, q in zip(x, y):
            worst, flips = max(worst, abs(p[0] - q[0])), flips + (bool(p[1]) != bool(q[1]))
    return f"{worst:.1e}" + (f" ({flips} greedy flips)" if flips else "")


def table(title: str, cells: int, rows: list[tuple[str, list[float], str, float | None, str]]) -> None:
    """rows: (name, times, compared with (a row's name), target, agreement); the first row is the anchor.

    'x anchor' is the row's time / the anchor's; 'speed-up' the row's time / the compared row's (the speed-up
    of the compared row over this one), checked against the target.
    """
    best = {name: min(times) for name, times, *_ in rows}
    anchor = rows[0][0]
    print(f"\n{title}")
    print(f"  {'variant':<20}{'best s':>9}{'cells/s':>9}{'x anchor':>10}   {'speed-up':<32}{'target':>8}{'met':>5}"
          f"{'max |dLL| vs grid':>20}   runs (s)")
    for name, times, against, target, agree in rows:
        t = best[name]
        if against:
            value = t / best[against]
            speed = f"{against} {value:.2f}x faster"
            tgt, met = (f">={target}", "yes" if value >= target else "no") if target else ("-", "-")
        else:
            speed, tgt, met = "-", "-", "-"
        print(f"  {name:<20}{t:>9.2f}{cells / t:>9.1f}{t / best[anchor]:>10.2f}   {speed:<32}{tgt:>8}{met:>5}{agree:>20}   "
              + " ".join(f"{x:.2f}" for x in times))


def part_one(path: Path, data: dict, configs: list, args) -> list[list]:
    import mlx.core as mx

    from driver.lm.mlx import MLXLM
    from worker.jobs import run
    from worker.spec import Job

    t = time.perf_counter()
    orchard = MLXLM(pretrained=str(path), batch_size=args.batch_size)
    load_s = time.perf_counter() - t
    ctxs = [c for s, d in data.items() for c in bw.contexts(s, d["test"], d["dev"], 5)]
    warm_ctxs = [c for s, d in data.items() for c in bw.contexts(s, d["warm"], d["dev"], 5)]
    inst, warm = bw.instances(ctxs), bw.instances(warm_ctxs)
    t = time.perf_counter()
    pairs = [tuple(map(tuple, orchard._encode_pair(*r.args))) for r in inst]
    tok_s = time.perf_counter() - t
    warm_pairs = [tuple(map(tuple, orchard._encode_pair(*r.args))) for r in warm]
    lens = sorted(len(c) + len(x) for c, x in pairs)
    lm, batching = orchard.executor.lm, orchard.batching
    n, g = len(pairs), len(configs)
    print(f"\n== {len(ctxs)} questions x 4 = {n} requests (5-shot; tokens min/median/max {lens[0]}/{lens[n // 2]}/"
          f"{lens[-1]}) x {g} configurations = {n * g} cells; model build {load_s:.2f}s, tokenization {tok_s:.2f}s ==")

    def grid():
        return [list(col) for col in zip(*run(lm, Job(kind="loglikelihood", grid=tuple(configs)), pairs, batching))]

    def independent():
        return [run(lm, Job(kind="loglikelihood", steering=s), pairs, batching) for s in configs]

    def sweep():
        ex = MLXLM(pretrained=str(path), batch_size=args.batch_size)
        p = [tuple(map(tuple, ex._encode_pair(*r.args))) for r in inst]
        return ex.executor.run_grid("loglikelihood", configs, p)

    def reload_loop():
        out = []
        for s in configs:
            model = MLXLM(pretrained=str(path), batch_size=args.batch_size, steer=s)
            out.append(model.loglikelihood(inst, disable_tqdm=True))
            del model
            mx.clear_cache()
        return out

    # Warm-up on held-out questions (compiled kernels, allocator), then the timed rounds.
    run(lm, Job(kind="loglikelihood", grid=tuple(configs)), warm_pairs, batching)
    run(lm, Job(kind="loglikelihood", steering=configs[0]), warm_pairs, batching)
    times, out = interleave({"grid": grid, "independent runs": independent}, args.repeat)
    slow, slow_out = interleave({"sweep end to end": sweep, "reload loop": reload_loop}, args.slow_repeat)
    times.update(slow)
    out.update(slow_out)
    ref = out["grid"]
    table(
        f"1 worker, in process: grid of {len(ALPHAS)} alphas x layers {list(GRID_LAYERS)} of {LAYERS} "
        f"(shared: blocks 0..{min(GRID_LAYERS)}), batch_size {batching.batch_size}",
        n * g,
        [
            ("grid", times["grid"], "", None, "0 (anchor)"),
            ("independent runs", times["independent runs"], "grid", TARGETS["independent runs"], max_delta(out["independent runs"], ref)),
            ("sweep end to end", times["sweep end to end"], "grid", None, max_delta(out["sweep end to end"], ref)),
            ("reload loop", times["reload loop"], "grid", TARGETS["reload loop"], max_delta(out["reload loop"], ref)),
        ],
    )
    e2e = min(times["reload loop"]) / min(times["sweep end to end"])
    print(f"  targets as the issue states them: the grid on a worker whose model is loaded. Including the sweep's own")
    print(f"  model build and tokenization (sweep end to end), the reload loop is {e2e:.2f}x slower.")
    mx.clear_cache()
    return pairs, warm_pairs, ref


def part_two(path: Path, pairs: list, warm_pairs: list, configs: list, ref: list[list], args) -> None:
    from driver.lm.mlx_ray import ray_executor
    from worker.spec import Batching, ModelSpec

    spec = ModelSpec(model=str(path))
    batching = Batching(batch_size=args.batch_size)
    times: dict[int, list[float]] = {1: [], 2: []}
    outs: dict[int, list] = {}
    blas, shares = "?", {}
    for r in range(args.repeat):
        for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
            ex = ray_executor(spec, batching, model_identity={"model": str(path)}, max_length=2048, workers=workers,
                              address="local", threads=1)
            try:
                blas = ex.facts[0].get("blas", "?")
                ex.run_grid("loglikelihood", configs, warm_pairs)  # warm-up
                t = time.perf_counter()
                outs[workers] = ex.run_grid("loglikelihood", configs, pairs)
                times[workers].append(time.perf_counter() - t)
                if workers == 2:
                    shares = ex.info()["requests_computed"]
            finally:
                ex.close()
    n = len(pairs) * len(configs)
    print(f"\n2 workers vs 1: RayExecutor.run_grid, embedded local Ray, threads=1 per worker; BLAS on the workers: {blas}")
    print(f"  {'workers':>8}{'best s':>9}{'cells/s':>9}{'speed-up':>10}{'target':>8}{'met':>5}{'max |dLL| vs grid':>20}   runs (s)")
    for w in (1, 2):
        speed = min(times[1]) / min(times[w])
        tgt, met = ("-", "-") if w == 1 else (f">={TARGETS['2 workers']}", "yes" if speed >= TARGETS["2 workers"] else "no")
        print(f"  {w:>8}{min(times[w]):>9.2f}{n / min(times[w]):>9.1f}{speed:>9.2f}x{tgt:>8}{met:>5}"
              f"{max_delta(outs[w], ref):>20}   " + " ".join(f"{x:.2f}" for x in times[w]))
    print(f"  cells per worker (last 2-worker run, warm-up included): {dict(shares)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subjects", type=int, default=None, help=f"how many of {', '.join(bw.SUBJECTS)} (default 6; --quick 4)")
    p.add_argument("--questions", type=int, default=None, help="test questions per subject (default 12; --quick 4)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds of the fast variants (default 3; --quick 2)")
    p.add_argument("--slow-repeat", type=int, default=1, help="timed rounds of sweep end to end / reload loop")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--no-workers", action="store_true", help="skip part 2 (Ray, 2 workers vs 1)")
    p.add_argument("--mmlu", type=Path, default=None, help="hendrycks MMLU CSV folder (default ../shared/data/mmlu)")
    p.add_argument("--quick", action="store_true", help="smoke run")
    args = p.parse_args(argv)
    bw.MMLU = args.mmlu or bw.MMLU
    args.subjects = args.subjects or (4 if args.quick else 6)
    args.questions = args.questions or (4 if args.quick else 12)
    args.repeat = args.repeat or (2 if args.quick else 3)

    t0 = time.perf_counter()
    import mlx.core as mx

    print(f"BLAS (this process): {blas_line()}")
    print(f"host: {platform.machine()} {platform.system()}, {os.cpu_count()} cpus, mlx {mx.__version__}, "
          f"device {mx.default_device()}, load average {os.getloadavg()[0]:.2f}")
    source, data = bw.load_subjects(args.subjects, args.questions, warm=2)
    configs = grid_configs()
    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        path, tokenizer = bw.write_bench_model(Path(tmp) / "model", hidden=HIDDEN, layers=LAYERS)
        cfg = json.loads((path / "config.json").read_text())
        print(f"model: random-weight llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
              f"vocab {cfg['vocab_size']}; tokenizer: {tokenizer}")
        print(f"requests: {source}; subjects: {', '.join(data)}; {args.questions} questions each, 5-shot")
        print(f"grid: add at resid_post of layers {list(GRID_LAYERS)} x alphas {list(ALPHAS)} (unit vectors)")
        pairs, warm_pairs, ref = part_one(path, data, configs, args)
        if not args.no_workers:
            part_two(path, pairs, warm_pairs, configs, ref, args)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
