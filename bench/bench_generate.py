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

Orchard runs lm-eval's stop strings too (mlx-lm has none: a handicap for Orchard). Rows are interleaved (ABC,
BCA, ...), best of N. Not a test: it asserts nothing; it prints the tables, the token agreement between rows,
the prefix KV sizes and the load average (timings are wall-clock: prefer an idle machine).
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


def variants(lm, plain, tokenizer, reqs, batch_size: int) -> dict:
    from mlx_lm.generate import batch_generate

    from worker.generate import generate_tokens

    prompts = [list(r.context) for r in reqs]
    n = reqs[0].max_gen_toks

    def mlx_lm_rows():
        out = batch_generate(plain, tokenizer, prompts, max_tokens=n, return_token_ids=True)
        return [list(t) for t in out.token_ids] if hasattr(out, "token_ids") else out.texts

    return {
        "mlx_lm.batch_generate": mlx_lm_rows,
        "orchard, no sharing": lambda: generate_tokens(lm, reqs, batch_size=batch_size, prefix_reuse=False),
        "orchard, sharing": lambda: generate_tokens(lm, reqs, batch_size=batch_size),
    }


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
            f"largest per-batch copy (BatchKVCache writes need a buffer per row): {copied / 2**20:.1f} MiB")


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
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.new_tokens, args.repeat = 4, 8, 1
    return args


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    from worker.generate import GenRequest
    from worker.load import load

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
        rows = variants(lm, plain, tokenizer, reqs, args.batch_size)
        warm = variants(lm, plain, tokenizer, [GenRequest(c, until=until, max_gen_toks=2) for c in ids[:2]], 2)
        bs.interleave(warm, 1)
        times, outs = bs.interleave(rows, args.repeat)
    names = list(rows)
    n = len(reqs)
    on, off, ref = outs["orchard, sharing"], outs["orchard, no sharing"], outs["mlx_lm.batch_generate"]
    bs.table(f"Generation, {n} few-shot documents (docs/s; speed-up vs mlx_lm.batch_generate)", "doc", [
        {"name": names[0], "times": times[names[0]], "n": n},
        {"name": names[1], "times": times[names[1]], "n": n, "extra": agreement(off, ref) + " with mlx_lm"},
        {"name": names[2], "times": times[names[2]], "n": n, "target": VS_MLX_LM, "extra": agreement(on, ref) + " with mlx_lm"},
    ], speedup=True)
    bs.table("Prefix sharing on vs off (speed-up vs no sharing)", "doc", [
        {"name": names[1], "times": times[names[1]], "n": n},
        {"name": names[2], "times": times[names[2]], "n": n, "target": VS_NO_SHARING, "extra": agreement(on, off) + " with no sharing"},
    ], speedup=True)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
