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
                 the corrupt run's state below its layer). Timed on --kernel-pairs pairs' whole grids.
  per-cell loop  what peers do (TransformerLens `run_with_hooks`, nnsight): for each cell one whole forward of the
                 corrupt prompt with the clean activation written in by a hook, the clean activations captured once
                 per pair; plain mlx-lm modules, no Orchard code. Timed on --loop-cells cells sampled from the grid
                 (a whole grid would take hours on this CPU): its cells/s is a rate, like the job's.
  N workers      (--workers N) the job through `mlx-ray`'s executor on N embedded-Ray workers, one BLAS thread each,
                 timed from dispatch to the last result (not Ray start-up or model loading).

Every sampled loop cell is compared with the job's value (max |d logit_diff|). Not a test: it prints tables.
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

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SITES = ("resid_pre", "attn_out", "mlp_out")


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


def ray_rate(folder: Path, requests: list, workers: int) -> tuple[float, list]:
    """Seconds of the patch job's dispatch on `workers` embedded-Ray workers (ready first), and its results."""
    from driver.lm.evaluation import open_model
    from worker.spec import Job

    lm = open_model({"pretrained": str(folder), "workers": workers, "address": "local", "threads": 1})
    try:
        lm.executor.wait_ready()
        return timed(lambda: lm.executor.run(Job(kind="patch"), requests))
    finally:
        lm.executor.close()


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
    args = ap.parse_args()
    if args.quick:
        args.layers, args.pairs, args.kernel_pairs, args.loop_cells = 8, 2, 1, 16
    from mlx_lm.utils import load as mlx_lm_load

    from testbed.models import write_model
    from worker.load import load
    from worker.spec import Batching, Job, ModelSpec
    from worker.jobs import run

    folder = Path(tempfile.mkdtemp(prefix="bench-patch-"))
    write_model(folder, arch="llama", hidden=args.hidden, layers=args.layers, heads=14, kv_heads=2, intermediate=args.intermediate, vocab_size=1024)
    lm, (plain, _) = load(ModelSpec(model=str(folder))), mlx_lm_load(str(folder))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]  # the tokenizer's: ids past it read garbage
    pairs, cells = make_pairs(args.pairs, args.length, vocab), grid_cells(args.layers, args.length, args.sites.split(","))
    job_requests = requests_of(pairs[: args.kernel_pairs], cells)
    rng = random.Random(1)
    sample = sorted(((rng.randrange(args.kernel_pairs), rng.choice(cells)) for _ in range(args.loop_cells)), key=lambda s: s[0])
    print(f"== patch: llama {args.layers} layers, hidden {args.hidden}; {args.length}-token template x {args.pairs} pairs x "
          f"{len(args.sites.split(','))} sites = {args.pairs * len(cells)} cells; BLAS: {blas_line()}; load: {os.getloadavg()[0]:.1f} ==")
    times: dict[str, list[float]] = {"patch job": [], "per-cell loop": []}
    for _ in range(args.repeat):  # interleaved: the box's load hits both alike
        seconds, results = timed(lambda: run(lm, Job(kind="patch"), job_requests, Batching()))
        times["patch job"].append(seconds)
        seconds, loop_values = timed(lambda: per_cell_loop(plain, pairs, sample))
        times["per-cell loop"].append(seconds)
    by_cell = {(i // len(cells), cells[i % len(cells)]): r[0] for i, r in enumerate(results)}
    worst = max(abs(by_cell[(p, c)] - v) for (p, c), v in zip(sample, loop_values))
    rates = {"patch job": len(job_requests) / min(times["patch job"]), "per-cell loop": len(sample) / min(times["per-cell loop"])}
    print(f"{'variant':<16}{'cells':>8}{'best s':>10}{'cells/s':>10}{'vs loop':>9}")
    for name, n in (("patch job", len(job_requests)), ("per-cell loop", len(sample))):
        print(f"{name:<16}{n:>8}{min(times[name]):>10.2f}{rates[name]:>10.1f}{rates[name] / rates['per-cell loop']:>8.2f}x")
    print(f"max |d logit_diff| loop vs job on the sampled cells: {worst:.2e}; the whole grid at the job's rate: "
          f"{args.pairs * len(cells) / rates['patch job'] / 60:.1f} min, at the loop's: {args.pairs * len(cells) / rates['per-cell loop'] / 60:.1f} min")
    if args.workers:
        for n in (1, args.workers):
            seconds, _ = ray_rate(folder, requests_of(pairs[: max(args.kernel_pairs, 2 * n)], cells), n)
            print(f"Ray, {n} worker(s): {len(cells) * max(args.kernel_pairs, 2 * n) / seconds:.1f} cells/s")


if __name__ == "__main__":
    main()
