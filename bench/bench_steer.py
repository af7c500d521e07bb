"""Benchmark: what steering costs: idle hooks, one intervention, vector extraction on 1 vs 2 Ray workers.

    python bench/bench_steer.py                  # full run (estimated ~10 min on a 2-core box with reference BLAS)
    python bench/bench_steer.py --quick          # smoke run (~1.5-2.5 min, ~20-45 s of it Ray start-up)
    python bench/bench_steer.py --parts 1,2      # only some parts
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_steer.py

One random-weight llama (hidden 256, 4 layers) with the GPT-2 tokenizer, as in bench_worker.py; requests are
lm-eval `mmlu` 5-shot loglikelihood requests built from the real MMLU CSVs at ../shared/data/mmlu (synthetic
questions when that folder is absent). Three parts, each a table against an anchor measured in this process:

  1 hooks idle   the same forward calls (bench_worker's "bare forward": shared-prefix passes + padded batches
                 of the kernel's plan, body only) on the plain `mlx_lm.load` model (anchor) and on the
                 instrumented one (worker.load.load: decoder blocks wrapped, nothing installed).
                 Target: <= 2 % slower. A second copy of the anchor is timed too: its ratio is the noise floor.
  2 one op       worker.score.loglikelihood on the same requests inside `steered(lm, Steering(...))`:
                 unsteered (anchor), one `add` on all positions at the middle layer (target: <= 5 % slower),
                 and as extra rows ablate, clamp and add at positions=last; and one `add` at each branch site
                 (resid_mid, attn_out, mlp_out) and at one head (attn_head, head 0; target: <= 5 % slower), plus a
                 clamp at that head as an extra row. Part 1 also micro-times the idle wrapper on the attention's
                 output projection (the attn_head hook point), which every block call now goes through.
  3 extraction   driver.steering.vectors.extract through driver.lm.mlx_ray.MLXRayLM (embedded local Ray, threads=1 per
                 worker) on a few hundred contrastive MMLU pairs at all 4 layers: pairs/s on 1 vs 2 workers
                 (target >= 1.7x), and whether both give the same vectors (<= 1e-6).

Variants are interleaved (A B C, then B C A, C A B, ...) and the best of N runs counts, so background load on a
shared machine hits them alike. Not a test: it asserts nothing, it prints tables.
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
from types import SimpleNamespace

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_worker as bw  # noqa: E402  (model, MMLU requests, the bare-forward plan)

HOOKS_TARGET = 1.02  # instrumented, idle / plain: time ratio
ADD_TARGET = 1.05  # one add on all positions / unsteered: time ratio
WORKERS_TARGET = 1.7  # 2 workers / 1 worker: pairs/s ratio
SAME_VECTORS = 1e-6


# --- BLAS --------------------------------------------------------------------------------------------


def blas_line() -> str:
    """Which BLAS MLX runs with. numpy's wheel maps its own (ILP64, suffixed) scipy_openblas, which MLX never
    calls, so it is left out here (cluster.facts.blas counts it, and then says "OpenBLAS" wrongly)."""
    import mlx.core as mx

    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    a = mx.ones((8, 8))
    mx.eval(a @ a)  # loads the BLAS
    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if ".so" in line}
    names = sorted(os.path.basename(p) for p in libs if "numpy.libs" not in p and "scipy_openblas" not in p)
    if any("openblas" in n.lower() for n in names):
        return f"OpenBLAS (preloaded: LD_PRELOAD={os.environ.get('LD_PRELOAD', '')})"
    bundled = [n for n in names if "blas" in n.lower()]
    name = f"reference BLAS bundled with mlx ({bundled[0] if bundled else 'unknown'})"
    if Path(bw.OPENBLAS).exists():
        return f"{name}; ~10x faster: LD_PRELOAD={bw.OPENBLAS}"
    return f"{name}; {bw.OPENBLAS} is NOT installed here (apt-get install libopenblas0-pthread for ~10x)"


# --- timing and tables -------------------------------------------------------------------------------


def interleave(variants: dict, repeats: int) -> tuple[dict[str, list[float]], dict]:
    """Run every variant `repeats` times, rotating the order (ABC BCA CAB ...) so that each takes every place in
    a round; returns (all times per variant, the last output of each)."""
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


def table(title: str, unit: str, rows: list[dict], speedup: bool = False) -> None:
    """rows: {name, times, n, target (None: no target), extra, extra_head}; the first row is the anchor.

    The ratio is time / anchor time (lower is better), or with `speedup` rate / anchor rate (higher is better).
    """
    anchor = min(rows[0]["times"])
    runs = [" ".join(f"{t:.3f}" for t in row["times"]) for row in rows]
    width = max(len("runs (s)"), *map(len, runs)) + 3
    named, rate = max(34, 2 + max(len(row["name"]) for row in rows)), max(10, len(unit) + 4)  # columns fit their heads
    print(f"\n{title}")
    print(f"  {'variant':<{named}}{'best s':>8}{unit + '/s':>{rate}}{'speed-up' if speedup else 'time/anchor':>12}{'target':>9}"
          f"{'met':>5}   {'runs (s)':<{width}}{rows[0].get('extra_head', '')}")
    for row, run in zip(rows, runs):
        best = min(row["times"])
        ratio = anchor / best if speedup else best / anchor
        target = row.get("target")
        if target is None:
            tgt, met = ("anchor" if row is rows[0] else "-"), "-"
        else:
            tgt = f"{'>=' if speedup else '<='}{target:.2f}"
            met = "yes" if (ratio >= target if speedup else ratio <= target) else "no"
        print(f"  {row['name']:<{named}}{best:>8.3f}{row['n'] / best:>{rate}.1f}{ratio:>12.3f}{tgt:>9}{met:>5}   "
              f"{run:<{width}}{row.get('extra', '')}")


# --- MMLU requests -----------------------------------------------------------------------------------


def mmlu_requests(orchard, data: dict, shots: int) -> tuple[list, list, list[int]]:
    """(timed token pairs, warm-up pairs from held-out val questions, sorted request lengths)."""
    ctxs, warm = [], []
    for subject, d in data.items():
        ctxs += bw.contexts(subject, d["test"], d["dev"], shots)
        warm += bw.contexts(subject, d["warm"], d["dev"], shots)

    def encode(insts):
        return [tuple(map(tuple, orchard._encode_pair(*r.args))) for r in insts]

    pairs, warm_pairs = encode(bw.instances(ctxs)), encode(bw.instances(warm))
    return pairs, warm_pairs, sorted(len(c) + len(t) for c, t in pairs)


# --- part 1: hooks installed and idle vs the plain model ---------------------------------------------


def plain_view(model, split: bool):
    """The plain mlx_lm model as bench_worker.bare_forward sees a LoadedModel: same body call, no hooks."""

    def body(x, cache=None):
        return (model.model if split else model)(x, cache=cache)

    hooks = SimpleNamespace(forward=lambda rows: contextlib.nullcontext())
    return SimpleNamespace(model=model, hooks=hooks, head=SimpleNamespace(body=body))


def wrapper_cost(block, hidden: int, calls: int = 3000) -> float:
    """Seconds the idle hook wrapper adds to one block call: a hooked block vs its own class's __call__ on a
    one-token input, graph building only (MLX is lazy, nothing is evaluated), interleaved, best of 9."""
    import mlx.core as mx

    x = mx.zeros((1, 1, hidden))
    base = type(block).__bases__[0]  # worker.hooks swapped the block's class for a subclass of its own

    def loop(fn) -> float:
        t = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return (time.perf_counter() - t) / calls

    hooked, plain = [], []
    for _ in range(9):
        hooked.append(loop(block))
        plain.append(loop(lambda a: base.__call__(block, a)))
    return min(hooked) - min(plain)


def part_hooks(orchard, plain_model, pairs, warm_pairs, repeats: int) -> None:
    import mlx.core as mx

    from worker.hooks import decoder_layers
    from worker.steer import hidden_size

    lm = orchard.executor.lm
    plain = plain_view(plain_model, lm.head.split)
    plan = bw.bare_plan(lm, pairs, orchard.batching)
    warm = bw.bare_plan(lm, warm_pairs, orchard.batching)
    # Warm-up: both models on held-out questions, then one untimed pass of the timed plan (MLX's buffer cache).
    bw.bare_forward(lm, warm), bw.bare_forward(plain, warm), bw.bare_forward(plain, plan)
    x = next(arrays[0][0] for _, batches in plan for arrays in batches.values() if arrays)
    same = mx.array_equal(lm.head.body(x), plain.head.body(x)).item()
    anchor = "plain mlx_lm.load (anchor)"
    variants = {  # name: (run, target)
        anchor: (lambda: bw.bare_forward(plain, plan), None),
        "instrumented, no hooks installed": (lambda: bw.bare_forward(lm, plan), HOOKS_TARGET),
        "plain again (noise check)": (lambda: bw.bare_forward(plain, plan), None),
    }
    times, out = interleave({name: run for name, (run, _) in variants.items()}, repeats)
    calls, tokens, real = out[anchor]
    n = len(pairs)
    rows = [{"name": name, "times": times[name], "n": n, "target": target} for name, (_, target) in variants.items()]
    table(f"1. hooks installed and idle vs the bare model ({n} requests -> {calls} body forwards, {tokens} tokens; "
          f"best of {repeats})", "req", rows)
    print(f"  same forward calls on both (bench_worker's bare forward, body only, no LM head); hooks installed: "
          f"{lm.hooks.active}; outputs bitwise equal: {same}")
    per_call = wrapper_cost(decoder_layers(lm.model)[0], hidden_size(lm))
    blocks = calls * lm.n_layers
    projection = decoder_layers(lm.model)[0].self_attn.o_proj
    per_projection = wrapper_cost(projection, projection.weight.shape[1])
    print(f"  the idle attn_head wrapper on o_proj: {max(per_projection, 0.0) * 1e6:.2f} us per call (micro-timed; "
          f"{max(per_projection, 0.0) * blocks / min(times[anchor]):.4%} of the anchor's best over {blocks} calls)")
    if per_call <= 0:
        print("  the idle wrapper itself, micro-timed per block call: below the timer's noise (hooked <= plain)")
    else:
        print(f"  the idle wrapper itself: {per_call * 1e6:.2f} us per block call (micro-timed) x {blocks} block calls = "
              f"{per_call * blocks * 1e3:.3f} ms, {per_call * blocks / min(times[anchor]):.4%} of the anchor's best: "
              f"the estimate of the overhead that background load cannot blur")


# --- part 2: one intervention vs unsteered -----------------------------------------------------------


def steering_variants(lm, layer: int, seed: int = 0) -> dict:
    """{name: (Steering, target or None)}: the unsteered anchor, the targeted add, the extra rows."""
    import numpy as np

    from worker.spec import Intervention, Steering, head_shape
    from worker.steer import hidden_size

    def unit(n: int) -> tuple[float, ...]:
        v = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        return tuple(float(a) for a in v / np.linalg.norm(v))

    vec, head_vec = unit(hidden_size(lm)), unit(head_shape(lm.config)[1])

    def one(op: str, alpha: float, positions: str = "all", site: str = "resid_post", head: int | None = None) -> Steering:
        v = head_vec if head is not None else vec
        return Steering(interventions=(Intervention(layer=layer, site=site, op=op, vector=v, alpha=alpha, positions=positions, head=head),))

    return {
        "unsteered (anchor)": (Steering(), None),
        f"add, all positions, layer {layer}": (one("add", 4.0), ADD_TARGET),
        f"ablate, all positions, layer {layer}": (one("ablate", 1.0), None),
        f"clamp, all positions, layer {layer}": (one("clamp", 2.0), None),
        f"add, positions=last, layer {layer}": (one("add", 4.0, "last"), None),
        **{f"add at {site}, layer {layer}": (one("add", 4.0, site=site), ADD_TARGET) for site in ("resid_mid", "attn_out", "mlp_out")},
        f"add at attn_head, head 0, layer {layer}": (one("add", 4.0, site="attn_head", head=0), ADD_TARGET),
        f"clamp at attn_head, head 0, layer {layer}": (one("clamp", 2.0, site="attn_head", head=0), None),
    }


def part_steer(orchard, pairs, warm_pairs, repeats: int) -> None:
    from worker.score import loglikelihood
    from worker.spec import Steering
    from worker.steer import steered

    lm, batching = orchard.executor.lm, orchard.batching
    layer = lm.n_layers // 2
    specs = steering_variants(lm, layer)

    def runner(steering, reqs):
        def run():
            with steered(lm, steering):  # what worker.jobs.run does around the kernel
                return loglikelihood(lm, reqs, batching)

        return run

    for steering, _ in specs.values():  # warm-up: every variant on held-out questions, the anchor on the timed ones
        runner(steering, warm_pairs)()
    runner(Steering(), pairs)()
    times, out = interleave({name: runner(s, pairs) for name, (s, _) in specs.items()}, repeats)
    base = out["unsteered (anchor)"]
    rows = []
    for name, (_, target) in specs.items():
        delta = max(abs(a[0] - b[0]) for a, b in zip(out[name], base))
        rows.append({"name": name, "times": times[name], "n": len(pairs), "target": target, "extra": f"{delta:.3g}",
                     "extra_head": "max|dLL| vs unsteered"})
    table(f"2. one intervention vs unsteered: worker.score.loglikelihood inside steered(lm, ...) "
          f"({len(pairs)} requests; best of {repeats})", "req", rows)
    print("  extra rows (target '-') are the per-op cost of ablate, clamp and positions=last; "
          "max|dLL| > 0 shows the op was active")


# --- part 3: vector extraction on 1 vs 2 Ray workers -------------------------------------------------


def write_pairs(out: Path, n: int, max_chars: int = 200) -> tuple[Path, str]:
    """n contrastive pairs: an MMLU question, then its right answer (positive) or another choice (negative)."""
    source, data = bw.load_subjects(len(bw.SUBJECTS), 10_000, warm=0)

    def usable(d: dict) -> bool:
        return len(d["question"]) <= max_chars and len(set(d["choices"])) == 4

    pools = [[d for d in sub["test"] if usable(d)] for sub in data.values()]
    docs = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)][:n]  # round-robin
    with out.open("w", encoding="utf-8") as f:
        for d in docs:
            wrong = (d["answer"] + 1) % 4
            row = {"prompt": f"Question: {d['question'].strip()}\nAnswer:",
                   "positive": " " + d["choices"][d["answer"]].strip(), "negative": " " + d["choices"][wrong].strip()}
            f.write(json.dumps(row) + "\n")
    return out, f"{len(docs)} pairs from {source}, questions <= {max_chars} chars"


def extraction(lm, pairs, layers: list[int], pool, capture_s: list[float]):
    """A zero-argument run of driver.steering.vectors.extract on `pool` (the CLI's capture function), as `driver vectors` does
    it; appends the capture phase's seconds (dispatch until the last result is merged) to `capture_s`."""
    from driver.steering import vectors as vec

    ex = lm.executor

    def run():
        full, seconds = ex.pool, ex.seconds
        ex.workers.pool = pool
        try:
            capture = lambda requests, points: ex.run(lm.job("capture", points=tuple(points)), requests)  # noqa: E731
            return vec.extract(capture, lm.tok_encode, pairs, layers, "resid_post", "mean-diff", -1)
        finally:
            ex.workers.pool = full
            capture_s.append(ex.seconds - seconds)

    return run


def part_extract(model: Path, work: Path, n_pairs: int, repeats: int) -> None:
    from cluster import Pool
    from driver.steering import vectors as vec
    from driver.lm.mlx_ray import MLXRayLM

    path, about = write_pairs(work / "pairs.jsonl", n_pairs)
    pairs, layers = vec.read_pairs(path), list(range(_n_layers(model)))
    t0 = time.perf_counter()
    lm = MLXRayLM.create_from_arg_obj({"pretrained": str(model), "workers": 2, "threads": 1, "address": "local"})
    names, capture = ("1 worker (anchor)", "2 workers"), {"1 worker (anchor)": [], "2 workers": []}
    try:
        startup, ex = time.perf_counter() - t0, lm.executor
        # 1 worker: the same Ray session and driver, dispatching to the first actor only (the second sits idle).
        pools = dict(zip(names, (Pool(ex.actors[:1]), ex.pool)))
        for name in names:  # warm-up, every actor
            extraction(lm, pairs[:8], layers, pools[name], [])()
        variants = {name: extraction(lm, pairs, layers, pools[name], capture[name]) for name in names}
        times, out = interleave(variants, repeats)
        worker_blas = sorted({f["blas"] for f in ex.facts})
    finally:
        lm.executor.close()
    diff = max(float(abs(out[names[0]][k] - out[names[1]][k]).max()) for k in out[names[1]])
    tokens = sorted(len(lm.tok_encode(t)) for p in pairs for t in p.texts)
    rows = [{"name": name, "times": times[name], "n": len(pairs), "target": None if name == names[0] else WORKERS_TARGET,
             "extra": f"{min(capture[name]):.2f}", "extra_head": "capture phase, best s"} for name in names]
    table(f"3. vector extraction, driver.steering.vectors.extract via MLXRayLM (embedded local Ray, threads=1 per worker; "
          f"best of {repeats})", "pair", rows, speedup=True)
    print(f"  {about}; {2 * len(pairs)} texts, tokens min/median/max {tokens[0]}/{tokens[len(tokens) // 2]}/{tokens[-1]}; "
          f"layers {layers}, resid_post, mean-diff, position last")
    print(f"  capture phase alone (RayExecutor.run, no tokenization or combining): speed-up "
          f"{min(capture[names[0]]) / min(capture[names[1]]):.3f}")
    print(f"  vectors from 1 and 2 workers: max |diff| {diff:.3g} -> {'identical' if diff <= SAME_VECTORS else 'DIFFERENT'} "
          f"(<= {SAME_VECTORS:g})")
    print(f"  BLAS on the workers (cluster.facts): {', '.join(worker_blas)}; "
          f"Ray start + 2 model loads {startup:.1f}s (not timed)")


def _n_layers(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["num_hidden_layers"])


# --- main --------------------------------------------------------------------------------------------


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (~1-2 min)")
    p.add_argument("--parts", default="1,2,3", help="comma-separated parts to run (default 1,2,3)")
    p.add_argument("--subjects", type=int, default=None, help="MMLU subjects for parts 1-2 (default 4; --quick 1)")
    p.add_argument("--questions", type=int, default=None, help="test questions per subject (default 10; --quick 4)")
    p.add_argument("--shots", type=int, default=5, help="few-shot examples per prompt (default 5)")
    p.add_argument("--repeat", type=int, default=None, help="runs per variant, interleaved (default 5; --quick 3)")
    p.add_argument("--pairs", type=int, default=None, help="contrastive pairs for part 3 (default 384; --quick 64)")
    p.add_argument("--pair-repeat", type=int, default=None, help="interleaved runs per worker count (default 6; --quick 2)")
    args = p.parse_args(argv)
    q = args.quick
    args.subjects = args.subjects or (1 if q else 4)
    args.questions = args.questions or (4 if q else 10)
    args.repeat = args.repeat or (3 if q else 5)
    args.pairs = args.pairs or (64 if q else 384)
    args.pair_repeat = args.pair_repeat or (2 if q else 6)
    args.parts = {int(x) for x in args.parts.split(",")}
    return args


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    import mlx.core as mx

    print(f"BLAS: {blas_line()}")
    print(f"host: {platform.machine()} {platform.system()}, {os.cpu_count()} cpus, mlx {mx.__version__}, "
          f"device {mx.default_device()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="orchard-bench-steer-") as tmp:
        path, tokenizer = bw.write_bench_model(Path(tmp) / "model")
        cfg = json.loads((path / "config.json").read_text())
        print(f"model: random-weight llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
              f"vocab {cfg['vocab_size']}; tokenizer: {tokenizer}")
        if args.parts & {1, 2}:
            run_local(path, args)
        if 3 in args.parts:
            part_extract(path, Path(tmp), args.pairs, args.pair_repeat)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    return 0


def run_local(path: Path, args) -> None:
    from mlx_lm import load as mlx_load

    from driver.lm.mlx import MLXLM

    source, data = bw.load_subjects(args.subjects, args.questions, warm=1)
    orchard = MLXLM(pretrained=str(path))  # its executor holds worker.load.load(...): the instrumented model
    pairs, warm_pairs, lens = mmlu_requests(orchard, data, args.shots)
    print(f"requests: {source}; {', '.join(data)}; {args.questions} questions each, {args.shots}-shot: {len(pairs)} "
          f"loglikelihood requests, tokens min/median/max {lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}")
    if 1 in args.parts:
        plain_model, _ = mlx_load(str(path))
        part_hooks(orchard, plain_model, pairs, warm_pairs, args.repeat)
    if 2 in args.parts:
        part_steer(orchard, pairs, warm_pairs, args.repeat)


if __name__ == "__main__":
    raise SystemExit(main())
