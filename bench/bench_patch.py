"""Benchmark: activation patching's cells/s, the patch job on one worker against a one-forward-per-cell MLX loop.

    python bench/bench_patch.py                 # the issue's shape: 24 layers, hidden 896, 20 tokens, 16 pairs, 3 sites
    python bench/bench_patch.py --quick         # smoke run (8 layers, 2 pairs)
    python bench/bench_patch.py --workers 2     # also the patch job through Ray on 2 local workers

A random-weight llama from testbed/models.py (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 2432), a 20-token
template of random token ids (BOS first) x 16 pairs whose corrupt prompt changes two tokens, 3 sites (resid_pre,
attn_out, mlp_out) x every layer x every position: 16 x 1440 = 23,040 cells. Variants, interleaved, best of
--repeat:

  patch job      worker.jobs.run(Job(kind="patch"), requests) on the loaded model: what one worker runs for a
                 chunk (the pairs' clean and corrupt runs once, each exact cell a row of a batch that starts from
                 the corrupt run's state below its layer and its position; a cell before the pair's first
                 differing token is the corrupt run itself, no forward). Timed on --kernel-pairs pairs' whole grids.
  per-cell loop  what peers do (TransformerLens `run_with_hooks`, nnsight): for each cell one whole forward of the
                 corrupt prompt with the clean activation written in by a hook, the clean activations captured once
                 per pair; plain mlx-lm modules, no Orchard code. Timed on --loop-cells cells sampled from the grid
                 (a whole grid would take hours on this CPU): its cells/s is a rate, like the job's.
  TransformerLens  the reference the issue asks for (bench/patch_reference.py): the same sampled cells through
                 TransformerLens's `patching.get_act_patch_<site>` on torch (CPU), the model converted with its own
                 `convert_llama_weights`, unprocessed. Left out with --no-reference or when it does not import.
  N workers      (--workers N) the job through `mlx-ray`'s executor on N embedded-Ray workers, one BLAS thread each,
                 timed from dispatch to the last result (not Ray start-up or model loading).

Every sampled loop cell (MLX and TransformerLens) is compared with the job's value (max |d logit_diff|). Not a
test: it prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import patch_reference
from bench_steer import interleave  # rotating order, every variant in every place of a round

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SITES = ("resid_pre", "attn_out", "mlp_out")
TL = "TransformerLens loop (torch)"


def blas_line() -> str:
    from cluster.facts import blas

    return blas()


def make_pairs(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Random-token prompts (BOS 1 first) whose corrupt side changes positions 5 and 6; random answer ids."""
    rng = random.Random(seed)
    template = [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]
    pairs = []
    for _ in range(n):
        clean, corrupt = list(template), list(template)
        clean[5:7] = [rng.randrange(3, vocab) for _ in range(2)]
        corrupt[5:7] = [rng.randrange(3, vocab) for _ in range(2)]
        correct, wrong = rng.sample(range(3, vocab), 2)
        pairs.append({"clean": tuple(clean), "corrupt": tuple(corrupt), "correct": correct, "wrong": wrong})
    return pairs


def grid_cells(n_layers: int, length: int, sites=SITES):
    from worker.patch.spec import PatchCell

    return [PatchCell(site=s, layer=layer, position=p) for s in sites for layer in range(n_layers) for p in range(length)]


def requests_of(pairs: list[dict], cells) -> list:
    from worker.patch.spec import PatchRequest

    return [PatchRequest(**pair, cell=c) for pair in pairs for c in cells]


# --- the per-cell loop: plain mlx-lm modules, one forward per cell ---------------------------------------------------


def forward(model, tokens, patch=None, keep=None):
    """logits[-1] of a llama forward; `patch` (site, layer, position, vector) writes the vector in; `keep` collects
    every site's [seq, hidden] activation per layer (the clean run)."""
    import mlx.core as mx

    def put(site, layer, x):
        if keep is not None:
            keep[(site, layer)] = x
        if patch is not None and patch[:2] == (site, layer):
            x = mx.concatenate([x[:, : patch[2]], patch[3][None, None], x[:, patch[2] + 1 :]], axis=1)
        return x

    inner = model.model
    h = inner.embed_tokens(mx.array([tokens]))
    for i, block in enumerate(inner.layers):
        h = put("resid_pre", i, h)
        a = put("attn_out", i, block.self_attn(block.input_layernorm(h), "causal"))
        h = h + a
        h = h + put("mlp_out", i, block.mlp(block.post_attention_layernorm(h)))
    out = inner.norm(h)
    logits = model.lm_head(out) if hasattr(model, "lm_head") else inner.embed_tokens.as_linear(out)
    return logits[0, -1]


def per_cell_loop(model, pairs: list[dict], sample: list[tuple[int, object]]) -> list[float]:
    """The patched logit difference of each sampled (pair index, cell), one forward each."""
    import mlx.core as mx

    clean_acts, out = {}, []
    for p, cell in sample:
        pair = pairs[p]
        if p not in clean_acts:
            keep: dict = {}
            mx.eval(forward(model, pair["clean"], keep=keep))
            clean_acts[p] = keep
        vector = clean_acts[p][(cell.site, cell.layer)][0, cell.position]
        logits = forward(model, pair["corrupt"], patch=(cell.site, cell.layer, cell.position, vector))
        out.append(float(logits[pair["correct"]] - logits[pair["wrong"]]))
    return out


# --- the run ------------------------------------------------------------------------------------------------------


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def ray_rate(folder: Path, requests: list, workers: int) -> tuple[float, float]:
    """Seconds of the patch job's dispatch on `workers` embedded-Ray workers (ready first), and the CPU seconds
    everything but the workers spent meanwhile (the head, Ray's daemons: on this box they share the workers' cores)."""
    from driver.lm.evaluation import open_model
    from worker.spec import Job

    lm = open_model({"pretrained": str(folder), "workers": workers, "address": "local", "threads": 1})
    try:
        lm.executor.wait_ready()
        before = others_cpu()
        seconds, _ = timed(lambda: lm.executor.run(Job(kind="patch"), requests))
        return seconds, others_cpu() - before
    finally:
        lm.executor.close()


def others_cpu() -> float:
    """CPU seconds so far of every process on this box but the Ray actors (process titles `ray::<Class>`)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        line, times = proc.info["cmdline"] or [""], proc.info["cpu_times"]
        if times is not None and not (line[0].startswith("ray::") and "IDLE" not in line[0]):
            total += times.user + times.system
    return total


def _pinned(core: int, folder: str, requests: list, start, out) -> None:
    """One plain process on one core (one BLAS thread: the parent set the variables before spawning it): load, wait
    for the others, run the patch kernel on `requests`, put its seconds on `out`."""
    os.sched_setaffinity(0, {core})
    from worker.jobs import run
    from worker.load import load
    from worker.spec import Batching, Job, ModelSpec

    lm = load(ModelSpec(model=folder))
    start.wait()
    seconds, _ = timed(lambda: run(lm, Job(kind="patch"), requests, Batching()))
    out.put(seconds)


def box_ceiling(folder: Path, requests: list, n: int) -> list[float]:
    """What this box gives N processes at once: N plain processes (no Ray, no head), process r pinned to core r with
    one BLAS thread, each running the kernel on the same `requests`; seconds of each, started together."""
    import multiprocessing as mp

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # read when a process starts: set before spawning
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_pinned, args=(r % os.cpu_count(), str(folder), requests, start, out)) for r in range(n)]
    for proc in procs:
        proc.start()
    seconds = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    return seconds


def report(times: dict, counts: dict, values: dict, sample: list, cells: list, grid: int) -> None:
    """The table: cells/s of each variant against the per-cell loop; each loop's values against the job's."""
    rates = {name: counts[name] / min(t) for name, t in times.items()}
    print(f"{'variant':<28}{'cells':>8}{'best s':>10}{'cells/s':>10}{'vs loop':>9}")
    for name in times:
        print(f"{name:<28}{counts[name]:>8}{min(times[name]):>10.2f}{rates[name]:>10.1f}{rates[name] / rates['per-cell loop']:>8.2f}x")
    by_cell = {(i // len(cells), cells[i % len(cells)]): r[0] for i, r in enumerate(values["patch job"])}
    for name in [n for n in values if n != "patch job"]:
        worst = max(abs(by_cell[(p, c)] - v) for (p, c), v in zip(sample, values[name]))
        print(f"max |d logit_diff| {name} vs the job on the sampled cells: {worst:.2e}")
    print(f"the whole grid ({grid} cells) at the job's rate: {grid / rates['patch job'] / 60:.1f} min, "
          f"at the MLX loop's: {grid / rates['per-cell loop'] / 60:.1f} min")


def in_process(args, folder: Path, pairs: list[dict], cells: list) -> None:
    """The job on --kernel-pairs pairs' whole grids against the MLX per-cell loop (and TransformerLens's) on
    --loop-cells sampled cells, in this process, interleaved; the table."""
    from mlx_lm.utils import load as mlx_lm_load

    from worker.jobs import run
    from worker.load import load
    from worker.spec import Batching, Job, ModelSpec

    lm, (plain, _) = load(ModelSpec(model=str(folder))), mlx_lm_load(str(folder))
    job_requests = requests_of(pairs[: args.kernel_pairs], cells)
    rng = random.Random(1)
    sample = sorted(((rng.randrange(args.kernel_pairs), rng.choice(cells)) for _ in range(args.loop_cells)), key=lambda s: s[0])
    variants = {"patch job": lambda: run(lm, Job(kind="patch"), job_requests, Batching()),
                "per-cell loop": lambda: per_cell_loop(plain, pairs, sample)}  # fmt: skip
    counts = {"patch job": len(job_requests), "per-cell loop": len(sample)}
    reference = None if args.no_reference else patch_reference.available()
    if not args.no_reference and reference is None:
        hooked = patch_reference.hooked_model(folder)
        variants[TL] = lambda: patch_reference.patched_logit_diffs(hooked, pairs, sample)
        counts[TL] = len(sample)
    times, values = interleave(variants, args.repeat)
    report(times, counts, values, sample, cells, args.pairs * len(cells))
    if reference:
        print(f"TransformerLens row left out: {reference}")
    free = sum(before_first_difference(r) for r in job_requests)
    print(f"the job's cells before their pair's first differing token (the corrupt run's value, no forward; the loops "
          f"run one): {free} of {len(job_requests)} ({100 * free / len(job_requests):.0f} %)")


def before_first_difference(request) -> bool:
    from worker.patch.pairs import first_difference

    return request.cell.position is not None and request.cell.position < first_difference(request.clean, request.corrupt)


def scaling(args, folder: Path, pairs: list[dict], cells: list) -> None:
    """1 and N workers through Ray (one pair per worker, each its own chunk), then this box's own ceiling for N
    processes (plain pinned processes on one site of one pair), each interleaved --repeat times; best of each."""
    ray: dict[int, list[tuple[float, float]]] = {1: [], args.workers: []}
    plain: dict[int, list[float]] = {1: [], args.workers: []}
    few = requests_of(pairs[:1], cells[: len(cells) // len(args.sites.split(","))])
    for _ in range(args.repeat):
        for n in ray if not args.ceiling_only else ():
            ray[n].append(ray_rate(folder, requests_of(pairs[:n], cells), n))
        for n in plain:
            plain[n].append(max(box_ceiling(folder, few, n)))
    for n, runs in ray.items():
        if runs:
            seconds, others = min(runs)
            print(f"Ray, {n} worker(s), one BLAS thread each: {len(cells) * n} cells, best {seconds:.1f} s of "
                  f"{' '.join(f'{t:.1f}' for t, _ in runs)}: {len(cells) * n / seconds:.1f} cells/s; everything else on the box "
                  f"meanwhile (the head, Ray's daemons, any other job): {others:.1f} CPU s ({100 * others / seconds / os.cpu_count():.0f} % of its cores)")
    if ray[1]:
        print(f"Ray: {args.workers} workers {args.workers * min(ray[1])[0] / min(ray[args.workers])[0]:.2f}x one = "
              f"{min(ray[1])[0] / min(ray[args.workers])[0]:.2f}·N")
    alone, together = min(plain[1]), min(plain[args.workers])
    print(f"this box, plain pinned processes (no Ray, {len(few)} cells each): 1 alone {' '.join(f'{t:.1f}' for t in plain[1])} s; "
          f"{args.workers} at once (the slower) {' '.join(f'{t:.1f}' for t in plain[args.workers])} s: at most "
          f"{alone / together:.2f}·N for N processes here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--kernel-pairs", type=int, default=2, help="pairs whose whole grid the job is timed on")
    ap.add_argument("--loop-cells", type=int, default=48, help="cells the per-cell loop is timed on")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sites", default=",".join(SITES), help="comma-separated sites of the grid")
    ap.add_argument("--intermediate", type=int, default=2432)
    ap.add_argument("--workers", type=int, default=0, help="also the job through Ray on this many local workers")
    ap.add_argument("--ray-only", action="store_true", help="with --workers: the Ray rows alone (no in-process table)")
    ap.add_argument("--ceiling-only", action="store_true", help="with --workers: only the plain-process ceiling")
    ap.add_argument("--no-reference", action="store_true", help="leave out the TransformerLens row (torch, test extras)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.pairs, args.kernel_pairs, args.loop_cells = 8, 2, 1, 16
    from testbed.models import write_model

    folder = Path(tempfile.mkdtemp(prefix="bench-patch-"))
    write_model(folder, arch="llama", hidden=args.hidden, layers=args.layers, heads=14, kv_heads=2, intermediate=args.intermediate, vocab_size=1024)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]  # the tokenizer's: ids past it read garbage
    pairs, cells = make_pairs(args.pairs, args.length, vocab), grid_cells(args.layers, args.length, args.sites.split(","))
    print(f"== patch: llama {args.layers} layers, hidden {args.hidden}; {args.length}-token template x {args.pairs} pairs x "
          f"{len(args.sites.split(','))} sites = {args.pairs * len(cells)} cells; BLAS: {blas_line()}; load: {os.getloadavg()[0]:.1f} ==")
    if not (args.ray_only and args.workers):
        in_process(args, folder, pairs, cells)
    if args.workers:
        scaling(args, folder, pairs, cells)

if __name__ == "__main__":
    main()
