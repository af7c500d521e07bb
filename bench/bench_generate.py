"""Benchmark: generation on few-shot prompts, Orchard with and without prefix sharing, and mlx_lm.batch_generate.

    python bench/bench_generate.py            # 2 subjects x 16 documents, 32 new tokens, best of 2
    python bench/bench_generate.py --quick    # 2 x 4 documents, 8 new tokens, best of 1: a smoke run
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_generate.py

Prompts are lm-eval's own `mmlu_flan_cot_fewshot_anatomy` and `_astronomy` contexts (offline cais/mmlu cache from
../shared/data/hf-datasets; without it, the same format built from the MMLU CSVs in ../shared/data/mmlu): the
same chain-of-thought exemplars in front of every question of a subject. One random-weight llama (hidden 256,
4 layers, 2,048-token window, GPT-2 tokenizer; bench_worker's model) runs every row, all in this process, on the
same token ids, greedy, a fixed number of new tokens:

  mlx_lm.batch_generate    mlx-lm's BatchGenerator (prefills every prompt whole), the anchor
  orchard, no sharing      worker.generate.generate_tokens(prefix_reuse=False): today's left-padded prefill
  orchard, sharing         worker.generate.generate_tokens(): each subject's common prefix prefilled once
                           (the per-model prefix store emptied first: a task's first chunk)
  ..., prefixes stored     the same with the store holding the exemplars' KV (a later chunk of the task)

An attn_head row (head 0 of layer 1 steered at every position): a first chunk vs a later one finding the
exemplars' KV stored under that steering (worker.prefix_cache keys a head's op by its head).

A sweep row: --sweep-configs configurations (add at each layer in turn, random vectors and alphas) x
--sweep-prompts documents (half from each subject), one grid job (worker.jobs.run, Job(kind="generate",
grid=...)), steering at `positions: all` (each configuration runs its own blocks from its layer up on the prompts,
the blocks below shared by the configurations of that layer) vs `continuation` (the prompts' KV computed once,
shared by every configuration: worker.prefix_cache.prompt_sharers, and all ten decoding side by side in one batch:
worker.grid.generation); and every configuration at `positions: all`
at resid_pre of the last layer (the prompts' blocks below it computed once: worker.grid.generation) vs of layer 0
(nothing shared: each configuration prefills its prompts whole).

Orchard runs lm-eval's stop strings too (mlx-lm has none: a handicap for Orchard). Rows are interleaved (ABC,
BCA, ...), best of N. Not a test: it asserts nothing; it prints the tables, the token agreement between rows,
peak MLX memory per row, the prefix KV sizes and the load average (timings are wall-clock: prefer an idle machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_steer as bs  # noqa: E402  (BLAS line, interleaving, tables; puts the project on sys.path)
import bench_worker as bw  # noqa: E402  (the model, the MMLU folders)

SUBJECTS = ("anatomy", "astronomy")
TASKS = tuple(f"mmlu_flan_cot_fewshot_{s}" for s in SUBJECTS)
HF_CACHE = bw.SHARED / "data" / "hf-datasets" / "cais___mmlu"
VS_MLX_LM = 5.0  # sharing rate / mlx_lm.batch_generate rate
VS_NO_SHARING = 2.0  # sharing rate / no-sharing rate
VS_SWEEP_ALL = 3.0  # continuation sweep rate / all-positions sweep rate


# --- contexts ----------------------------------------------------------------------------------------


def lm_eval_contexts(per_subject: int) -> tuple[str, list[str], tuple[str, ...]]:
    """lm-eval's own contexts and stop strings for the two flan CoT few-shot tasks (offline cache copy)."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    cache = Path(tempfile.mkdtemp(prefix="orchard-bench-hf-"))
    os.environ["HF_DATASETS_CACHE"] = str(cache)  # datasets writes locks: a private copy
    shutil.copytree(HF_CACHE, cache / HF_CACHE.name)
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict(list(TASKS), TaskManager())
    contexts, until = [], ()
    for name in TASKS:
        tasks[name].build_all_requests(limit=per_subject, rank=0, world_size=1)
        for inst in tasks[name].instances:
            contexts.append(inst.args[0])
            until = tuple(inst.args[1].get("until", ()))
    shutil.rmtree(cache, ignore_errors=True)
    return f"lm-eval {' + '.join(TASKS)}", contexts, until


def csv_contexts(per_subject: int) -> tuple[str, list[str], tuple[str, ...]]:
    """The flan CoT few-shot format from the MMLU CSVs: 5 dev exemplars, then each test question."""

    def q(row):
        return f"Q: {row[0].strip()}\n" + " ".join(f"({c}) {row[1 + i]}" for i, c in enumerate("ABCD")) + "\nA: Let's think step by step."

    contexts = []
    for s in SUBJECTS:
        rows = {split: list(csv.reader(open(bw.MMLU / split / f"{s}_{split}.csv", encoding="utf-8"))) for split in ("dev", "test")}
        head = f"The following are multiple choice questions (with answers) about {s}.\n\n"
        shots = "".join(f"{q(r)} The answer is ({r[5].strip()}).\n\n" for r in rows["dev"][:5])
        contexts += [head + shots + q(r) for r in rows["test"][:per_subject]]
    return f"MMLU CSVs in the flan CoT format ({bw.MMLU})", contexts, ("</s>",)


def contexts(per_subject: int) -> tuple[str, list[str], tuple[str, ...]]:
    if HF_CACHE.is_dir():
        try:
            return lm_eval_contexts(per_subject)
        except Exception as e:  # noqa: BLE001  (a bench falls back and says why)
            print(f"lm-eval tasks unavailable ({type(e).__name__}: {e}); using the MMLU CSVs")
    return csv_contexts(per_subject)


# --- rows --------------------------------------------------------------------------------------------


def variants(lm, plain, tokenizer, reqs, batch_size: int, stored: dict | None = None) -> dict:
    """The timed rows; each records its peak MLX memory in `peaks`. `stored`: the prefix store's entries after
    one sharing run (a later chunk of the same task finds its exemplars there)."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    from worker.generate import generate_tokens
    from worker.prefix_cache import store

    prompts = [list(r.context) for r in reqs]
    n = reqs[0].max_gen_toks

    def mlx_lm_rows():
        return [list(t) for t in batch_generate(plain, tokenizer, prompts, max_tokens=n, return_token_ids=True).token_ids]

    def orchard(reuse: bool, entries: dict | None = None):
        def run():
            s = store(lm)
            s.clear()  # a first chunk computes its prefixes
            for key, (cache, size) in (entries or {}).items():
                s.entries[key] = (cache, size)
                s.nbytes += size
            out = generate_tokens(lm, reqs, batch_size=batch_size, prefix_reuse=reuse)
            STORE_PEAK[0] = max(STORE_PEAK[0], s.peak, s.nbytes)
            return out
        return run

    rows = {
        "mlx_lm.batch_generate": mlx_lm_rows,
        "orchard, no sharing": orchard(False),
        "orchard, sharing": orchard(True),
    }
    if stored is not None:
        rows["orchard, sharing, prefixes stored"] = orchard(True, stored)

    def peak(name, f):
        def run():
            mx.reset_peak_memory()
            out = f()
            PEAKS[name] = max(PEAKS.get(name, 0), mx.get_peak_memory())
            return out
        return run

    return {name: peak(name, f) for name, f in rows.items()}


def head_rows(lm, reqs, batch_size: int) -> dict:
    """An attn_head run's rows (head 0 of layer 1, `positions: all`, a random vector, alpha 4): the store emptied
    first (a task's first chunk) vs holding the exemplars' KV stored under that steering (a later chunk). Until the
    store knew a head's op (issue 29.6) it stayed empty under one, and both rows computed every prefix."""
    import numpy as np

    from worker.generate import generate_tokens
    from worker.prefix_cache import store
    from worker.spec import Intervention, Steering, head_shape
    from worker.steer import steered

    vec = tuple(np.random.default_rng(0).standard_normal(head_shape(lm.config)[1]).tolist())
    spec = Steering(interventions=(Intervention(layer=min(1, lm.n_layers - 1), site="attn_head", head=0, vector=vec, alpha=4.0),))

    def steered_run():
        with steered(lm, spec):
            return generate_tokens(lm, reqs, batch_size=batch_size)

    store(lm).clear()
    steered_run()  # a first chunk: what it stores, a later chunk finds
    entries = dict(store(lm).entries)

    def row(name: str, stored: dict):
        def go():
            s = store(lm)
            s.clear()
            for key, (cache, size) in stored.items():
                s.entries[key] = (cache, size)
                s.nbytes += size
            out = steered_run()
            HEAD_STORE[name] = f"store: {len(s.entries)} entries, {s.reused} prefix tokens reused, {max(s.peak, s.nbytes) / 2**20:.1f} MiB held"
            return out
        return name, go

    return dict([row("head-steered, store emptied", {}), row("head-steered, prefixes stored", entries)])


def sweep_rows(lm, reqs, configs: int, batch_size: int) -> dict:
    """The sweep's timed rows: one grid job each, the prefix store emptied first. `positions: all` at every layer
    in turn, and `continuation`; then every configuration at resid_pre of the last layer (its blocks below shared:
    worker.grid.generation) and of layer 0 (nothing to share)."""
    import numpy as np

    from worker.jobs import run
    from worker.prefix_cache import store
    from worker.spec import Batching, Intervention, Job, Steering

    rng = np.random.default_rng(0)
    hidden, layers = lm.config["hidden_size"], lm.n_layers
    vecs = [tuple(rng.standard_normal(hidden).tolist()) for _ in range(configs)]

    def grid(positions: str, layer: int | None, site: str) -> tuple:
        return tuple(Steering(interventions=(Intervention(layer=c % layers if layer is None else layer, vector=v, site=site,
                                                          alpha=float(1 + c % 3), positions=positions),)) for c, v in enumerate(vecs))

    def row(name: str, positions: str, layer: int | None = None, site: str = "resid_post"):
        splits = [c % layers + 1 for c in range(configs)] if layer is None else [layer + (site == "resid_post")] * configs
        SWEEP_GFLOP[name] = sweep_gflop(lm, reqs, configs, positions, splits)

        def go():
            store(lm).clear()
            out = run(lm, Job(kind="generate", grid=grid(positions, layer, site)), reqs, Batching(batch_size=batch_size))
            SWEEP_STORE[name] = max(SWEEP_STORE.get(name, 0), store(lm).peak)
            return out
        return name, go

    return dict([row("sweep, resid_pre.0, all", "all", 0, "resid_pre"),
                 row("sweep, resid_pre.0, continuation", "continuation", 0, "resid_pre"),
                 row("sweep, layers in turn, all", "all"), row("sweep, layers in turn, continuation", "continuation"),
                 row(f"sweep, resid_pre.{layers - 1}, all", "all", layers - 1, "resid_pre")])


def sweep_gflop(lm, reqs, configs: int, positions: str, splits: list[int]) -> float:
    """The arithmetic of a sweep's grid job (GFLOP, matmuls only; attention's score products left out): each
    family's prompt tokens (its exemplars once) through the blocks run on them, and every (request, configuration)
    row's forwards with logits (its prompt's last token, then each new token but the last) through every block and
    the vocabulary head. `splits`: per configuration the block its steering enters (resid_post.L: L + 1; resid_pre.L: L). `continuation` runs every prompt once;
    `all` runs the blocks below the highest split once (splits chain) and each configuration's blocks from its
    split up (worker.grid.generation)."""
    from worker.generate import _prefix_families

    c = lm.config
    d, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads) * (d // heads)
    block = 2 * d * (2 * d + 2 * kv + 3 * c["intermediate_size"])  # q, o; k, v; gate, up, down
    layers, head = lm.n_layers, 2 * d * c["vocab_size"]
    contexts = [r.context for r in reqs]
    tokens = sum(len(c) - 1 for c in contexts)  # a prompt's last token runs with its rows
    tokens -= sum(p * (len(idx) - 1) for p, idx in _prefix_families(contexts, True))  # a family's exemplars once
    run = layers if positions == "continuation" else max(splits) + sum(layers - s for s in splits)
    rows = configs * len(reqs) * reqs[0].max_gen_toks  # forwards with logits: the prompt's last token, the new ones
    return (tokens * run * block + rows * (layers * block + head)) / 1e9


PEAKS: dict[str, int] = {}  # peak MLX memory per row (bytes)
SWEEP_STORE: dict[str, int] = {}  # the prefix store's peak bytes per sweep row
SWEEP_GFLOP: dict[str, float] = {}  # each sweep row's arithmetic (sweep_gflop)
STORE_PEAK = [0]  # the prefix store's peak bytes over the timed runs
HEAD_STORE: dict[str, str] = {}  # the prefix store after each attn_head row's last run


def kv_report(lm, reqs, batch_size: int) -> str:
    """The shared prefixes' KV size (once per family) and the per-row copy each batch makes of it."""
    from worker.generate import _prefix_families

    cfg = lm.config
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    fams = [(p, len(idx)) for p, idx in _prefix_families([r.context for r in reqs], True) if p]
    once = sum(p for p, _ in fams) * per_token
    copied = max((min(n, batch_size) * p for p, n in fams), default=0) * per_token
    return (f"families: {len(fams)} (prefix tokens, rows: {fams}); prefix KV held once: {once / 2**20:.1f} MiB; "
            f"largest per-batch copy where a model keeps copies (failing worker.cascade's self-check): {copied / 2**20:.1f} MiB")


def copy_cost(lm, reqs, batch_size: int) -> str:
    """What copying the shared prefix into a per-row cache costs (BatchKVCache writes into one buffer per row,
    so the broadcast prefix is materialized once per batch, then rolled by each row's pads)."""
    import mlx.core as mx
    from mlx_lm.models.cache import dynamic_roll

    from worker.generate import _prefix_families, shared_batch_cache
    from worker.score import _prefix_cache

    prefix, idx = max(_prefix_families([r.context for r in reqs], True), key=lambda f: f[0])
    if not prefix:
        return "no shared prefix"
    batch = min(len(idx), batch_size)
    base = _prefix_cache(lm, reqs[idx[0]].context[:prefix])
    pads = mx.array([b % 7 for b in range(batch)])
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        caches = shared_batch_cache(base, batch)
        out = [mx.contiguous(x) for c in caches for x in (c.keys, c.values)]
        mx.eval([dynamic_roll(x, pads[:, None], axis=2) for x in out])
        best = min(best, time.perf_counter() - t)
    size = sum(x.nbytes for x in out)
    from worker import cascade
    from worker.generate import _prefill_copied

    path = ("one copy read by every row (worker.cascade)" if cascade.usable(lm, _prefill_copied)
            else "copied per row (the model failed worker.cascade's self-check)")
    return (f"prefix attention: {path}; the copied path's per-batch prefix copy + roll ({batch} rows x {prefix} tokens, "
            f"{size / 2**20:.1f} MiB): {best * 1e3:.0f} ms")


def agreement(a: list, b: list) -> str:
    same = sum(x == y for x, y in zip(a, b))
    return f"{same}/{len(a)} rows identical"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 x 4 documents, 8 new tokens, best of 1")
    p.add_argument("--docs", type=int, default=16, help="documents per subject (2 subjects)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best counts")
    p.add_argument("--batch-size", type=int, default=32, help="Orchard's rows per forward (Batching's default)")
    p.add_argument("--sweep-configs", type=int, default=10, help="steering configurations in the sweep row (0: none)")
    p.add_argument("--sweep-prompts", type=int, default=16, help="documents in the sweep row (half per subject)")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.new_tokens, args.repeat, args.sweep_configs, args.sweep_prompts = 4, 8, 1, 3, 4
    return args


def sweep_tables(times: dict, cells: int, grid: str) -> None:
    """The sweep's tables: `continuation` vs `all` on one grid at a time (the target: where `all` has no block
    below to share, every configuration prefilling the prompts again), then what `all` shares below its splits.
    Each row shows its arithmetic (sweep_gflop): a time ratio above the arithmetic's ratio is batching efficiency."""
    names = list(times)
    low = min(SWEEP_GFLOP.values())

    def row(name: str, target: float | None = None) -> dict:
        extra = f"{SWEEP_GFLOP[name]:.0f} GFLOP ({SWEEP_GFLOP[name] / low:.2f}x); prefix store peak {SWEEP_STORE[name] / 2**20:.1f} MiB"
        return {"name": name, "times": times[name], "n": cells, "target": target, "extra": extra}

    head = f"Sweep: {grid}, one grid job (generations/s; arithmetic: matmul GFLOP, x the least)"
    bs.table(f"{head}; every configuration at resid_pre.0 (`all` shares no block)", "gen",
             [row(names[0]), row(names[1], VS_SWEEP_ALL)], speedup=True)
    bs.table(f"{head}; configurations at resid_post of each layer in turn (`all` shares the blocks below each)", "gen",
             [row(names[2]), row(names[3])], speedup=True)
    bs.table(f"{head}; `all`: blocks below the splits shared (resid_pre.L: L blocks) vs none", "gen",
             [row(names[0]), row(names[4]), row(names[2])], speedup=True)


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    from worker.generate import GenRequest, generate_tokens
    from worker.load import load
    from worker.prefix_cache import store

    print(f"BLAS: {bs.blas_line()}")
    print(f"mlx {mx.__version__}, {os.cpu_count()} cpus, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    source, texts, until = contexts(args.docs)
    with tempfile.TemporaryDirectory(prefix="orchard-bench-generate-") as tmp:
        path, tok_name = bw.write_bench_model(Path(tmp) / "model")
        cfg = json.loads((path / "config.json").read_text())
        lm = load(str(path))
        plain, tokenizer = mlx_load(str(path))
        ids = [tuple(lm.tokenizer.encode(t)) for t in texts]
        reqs = [GenRequest(c, until=until, max_gen_toks=args.new_tokens) for c in ids]
        lens = sorted(map(len, ids))
        print(f"model: random llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, window "
              f"{lm.max_length}; tokenizer: {tok_name}")
        print(f"prompts: {source}; {len(reqs)} documents, tokens min/median/max {lens[0]}/{lens[len(lens) // 2]}/"
              f"{lens[-1]}; {args.new_tokens} new tokens, greedy, Orchard stop strings {until}")
        print(kv_report(lm, reqs, args.batch_size))
        print(copy_cost(lm, reqs, args.batch_size))
        warm = variants(lm, plain, tokenizer, [GenRequest(c, until=until, max_gen_toks=2) for c in ids[:2]], 2)
        bs.interleave(warm, 1)
        store(lm).clear()
        generate_tokens(lm, reqs, batch_size=args.batch_size)  # fills the prefix store for the "stored" row
        rows = variants(lm, plain, tokenizer, reqs, args.batch_size, dict(store(lm).entries))
        PEAKS.clear()
        times, outs = bs.interleave(rows, args.repeat)
        stats = store(lm).stats()
        head_times, head_outs = bs.interleave(head_rows(lm, reqs, args.batch_size), args.repeat)
        half = args.sweep_prompts // 2
        sweep = [*reqs[:half], *reqs[args.docs : args.docs + half]]
        sweep_times = bs.interleave(sweep_rows(lm, sweep, args.sweep_configs, args.batch_size), args.repeat)[0] if args.sweep_configs else {}
    names = list(rows)
    n = len(reqs)
    ref, off = outs[names[0]], outs[names[1]]

    def row(i, target=None, against=None, label=""):
        extra = f"peak {PEAKS[names[i]] / 2**20:.0f} MiB"
        if against is not None:
            extra += "; " + agreement(outs[names[i]], against) + label
        return {"name": names[i], "times": times[names[i]], "n": n, "target": target, "extra": extra}

    bs.table(f"Generation, {n} few-shot documents (docs/s; speed-up vs mlx_lm.batch_generate)", "doc",
             [row(0), row(1, None, ref, " with mlx_lm"), row(2, VS_MLX_LM, ref, " with mlx_lm"),
              row(3, VS_MLX_LM, ref, " with mlx_lm")], speedup=True)
    bs.table("Prefix sharing on vs off (speed-up vs no sharing)", "doc",
             [row(1), row(2, VS_NO_SHARING, off, " with no sharing"), row(3, VS_NO_SHARING, off, " with no sharing")],
             speedup=True)
    heads = list(head_times)
    bs.table("An attn_head run (head 0 of layer 1, all positions): prefixes stored vs a first chunk", "doc",
             [{"name": h, "times": head_times[h], "n": n, "target": None,
               "extra": HEAD_STORE[h] + ("; " + agreement(head_outs[h], head_outs[heads[0]]) + " with the first chunk" if i else "")}
              for i, h in enumerate(heads)], speedup=True)
    if sweep_times:
        sweep_tables(sweep_times, args.sweep_configs * len(sweep), f"{args.sweep_configs} configurations x {len(sweep)} documents")
    print(f"\nprefix store: {stats['entries']} entries after the last run; peak {STORE_PEAK[0] / 2**20:.1f} MiB over the "
          f"timed runs, budget {stats['budget'] / 2**20:.0f} MiB (worker.prefix_cache.DEFAULT_BUDGET)")
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
