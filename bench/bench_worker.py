"""Benchmark: Orchard's in-process `mlx` scorer against mlx-lm's evaluator, the seed wrapper and the bare forward.

    python bench/bench_worker.py                 # full run (~5 min on a 2-core CPU box, reference BLAS)
    python bench/bench_worker.py --quick         # smoke run: ~40 s reference BLAS, ~15 s OpenBLAS
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_worker.py

Requests are lm-eval `mmlu` loglikelihood requests (0-shot and 5-shot, the task's exact prompt format) built
from the real MMLU CSVs at ../shared/data/mmlu (synthetic questions when that folder is absent). Every row
scores them with one random-weight llama (hidden 256, 4 layers) that carries the GPT-2 tokenizer (vocab
50257), so both the LM head and the decoder blocks cost something. Rows, all in this one process:

  orchard mlx        driver.lm.mlx.MLXLM(...).loglikelihood(instances): tokenization + worker.score kernel
  orchard kernel     worker.score.loglikelihood on the pre-tokenized pairs (what the driver hands a worker)
  mlx_lm.evaluate    mlx_lm.evaluate.MLXLM(...).loglikelihood(instances)
  seed 000           the seed wrapper's loop: one full forward per request, log(softmax(vocab)) and two host
                     syncs per continuation token (same token ids as Orchard)
  bare forward       exactly the forward calls Orchard's kernel makes (shared-prefix passes + padded batches,
                     same shapes, same KV-cache broadcast), timing only lm.head.body(...) + mx.eval: no
                     gathering, no LM head, no log-softmax, no bookkeeping. A floor, not a competitor.

Not a test: it asserts nothing, it prints tables (and whether the issue's targets are met).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # mlx_lm.evaluate draws a progress bar per call
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # GPT-2's model_max_length=1024 warning

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
MMLU = SHARED / "data" / "mmlu"
GPT2 = SHARED / "data" / "tokenizers" / "gpt2"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

# A handful of subjects with different question lengths (5-shot prompts ~330-570 GPT-2 tokens for the first four).
SUBJECTS = ("abstract_algebra", "anatomy", "college_biology", "high_school_geography", "marketing", "philosophy")
LETTERS = ("A", "B", "C", "D")

TARGETS = {"0-shot": 1.3, "5-shot": 3.0}  # Orchard rate / mlx_lm.evaluate rate
BARE_TARGET = 0.85  # Orchard kernel rate / bare forward rate


# --- BLAS ------------------------------------------------------------------------------------------


def blas_in_use() -> str:
    """Which BLAS the process mapped: MLX's CPU wheel bundles reference BLAS; OpenBLAS only when preloaded."""
    import mlx.core as mx

    from cluster.facts import blas

    a = mx.ones((8, 8))
    mx.eval(a @ a)  # loads the BLAS
    name = blas()
    if name.startswith("reference"):
        how = f"LD_PRELOAD={OPENBLAS}" if Path(OPENBLAS).exists() else f"apt-get install libopenblas0-pthread, then LD_PRELOAD={OPENBLAS}"
        name += f"; ~10x faster: {how}"
    return name


# --- benchmark model ------------------------------------------------------------------------------


def write_bench_model(out: Path, hidden: int = 256, layers: int = 4, seed: int = 0) -> tuple[Path, str]:
    """testbed.models.write_model's llama, re-vocabbed to the GPT-2 tokenizer when ../shared has it."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from testbed.models import write_model

    write_model(
        out, arch="llama", hidden=hidden, layers=layers, heads=4, kv_heads=2, intermediate=3 * hidden,
        vocab_size=512, max_positions=2048, seed=seed,
    )
    if not (GPT2 / "tokenizer.json").exists():
        return out, "synthetic byte-level BPE (vocab ~512; ../shared/data/tokenizers/gpt2 absent)"
    for f in GPT2.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt"):
            shutil.copy(f, out / f.name)
    vocab = len(json.loads((GPT2 / "vocab.json").read_text()))  # 50257, <|endoftext|> = 50256 included
    eos = vocab - 1
    rng = np.random.default_rng(seed + 1)
    weights = load_file(str(out / "model.safetensors"))
    # Same scales as write_model: embedding N(0, 1), untied head N(0, 16/d).
    weights["model.embed_tokens.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
    weights["lm_head.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(4 * hidden**-0.5)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}))
    return out, f"GPT-2 byte-level BPE (vocab {vocab}, bos = eos = {eos})"


# --- MMLU requests, formatted like lm-eval's `mmlu` task --------------------------------------------


def _read(split: str, subject: str) -> list[dict]:
    with open(MMLU / split / f"{subject}_{split}.csv", newline="", encoding="utf-8") as f:
        return [{"question": r[0], "choices": r[1:5], "answer": LETTERS.index(r[5].strip())} for r in csv.reader(f)]


def _synthetic(subject: str, n: int, seed: int) -> list[dict]:
    from testbed.models import _WORDS

    rng = random.Random(f"{subject}-{seed}")

    def words(lo, hi):
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    return [
        {"question": words(8, 40).capitalize() + "?", "choices": [words(1, 8) for _ in LETTERS], "answer": rng.randrange(4)}
        for _ in range(n)
    ]


def load_subjects(n_subjects: int, per_subject: int, warm: int) -> tuple[str, dict[str, dict[str, list[dict]]]]:
    """{subject: {"dev": 5 exemplars, "test": questions, "warm": questions no timed row sees}}."""
    if MMLU.is_dir():
        out = {}
        for s in SUBJECTS[:n_subjects]:
            test = _read("test", s)
            out[s] = {"dev": _read("dev", s), "test": test[:per_subject], "warm": _read("val", s)[:warm]}
        return f"real MMLU ({MMLU})", out
    names = [f"synthetic_{c}" for c in "abcdefgh"[:n_subjects]]
    data = {s: {"dev": _synthetic(s, 5, 1), "test": _synthetic(s, per_subject, 2), "warm": _synthetic(s, warm, 3)} for s in names}
    return "synthetic questions (../shared/data/mmlu absent)", data


def doc_to_text(doc: dict) -> str:
    c = doc["choices"]
    return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def contexts(subject: str, docs: list[dict], dev: list[dict], shots: int) -> list[str]:
    description = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    fewshot = "".join(doc_to_text(d) + " " + LETTERS[d["answer"]] + "\n\n" for d in dev[:shots])  # sampler: first_n
    return [description + fewshot + doc_to_text(d) for d in docs]


def instances(ctxs: list[str]):
    from lm_eval.api.instance import Instance

    out = []
    for q, ctx in enumerate(ctxs):
        for letter in LETTERS:
            out.append(Instance("loglikelihood", {}, (ctx, " " + letter), len(out), ("mmlu_bench", q, 1)))
    return out


# --- the seed wrapper's loop (seeds/000), on Orchard's token ids -------------------------------------


def seed000_loglikelihood(model, pairs, max_length: int) -> list[tuple[float, bool]]:
    import mlx.core as mx

    results = []
    for context_ids, cont_ids in pairs:
        full_ids = list(context_ids) + list(cont_ids)
        token_ids = full_ids[-max_length:] if len(full_ids) > max_length else full_ids
        cont_len_total = max(0, len(full_ids) - len(context_ids))
        context_len = max(0, min(len(context_ids), len(token_ids) - max(1, cont_len_total)))
        cont_len = len(token_ids) - context_len
        if cont_len <= 0:
            results.append((float("-inf"), False))
            continue
        logits = model(mx.array([token_ids]))
        total, greedy = 0.0, True
        for i in range(cont_len):
            pos = context_len + i
            target = token_ids[pos]
            log_probs = mx.log(mx.softmax(logits[0, pos - 1, :], axis=-1))
            total += float(mx.take(log_probs, mx.array([target])))
            if int(mx.argmax(logits[0, pos - 1, :], axis=-1)) != target:
                greedy = False
        results.append((total, greedy))
    return results


# --- the bare forward: Orchard's kernel's forward calls, nothing else --------------------------------


def bare_plan(lm, pairs, batching):
    """Everything the kernel decides before it runs a forward: families, prefixes, padded batches."""
    import mlx.core as mx

    from worker.score import _batches, _families, _rows

    rows, _ = _rows(pairs, lm.max_length)
    plan = []
    for fam in _families(rows, batching.prefix_reuse):
        prefix_tokens = fam.rows[0].tokens[: fam.prefix] if fam.prefix else None
        batches = []
        for prefix in sorted({fam.prefix, 0}) if fam.prefix else [0]:
            # The kernel falls back to prefix 0 when the architecture has no plain KVCache; plan both.
            arrays = []
            for batch in _batches(fam.rows, prefix, batching):
                width = max(len(r.tokens) for r in batch) - prefix
                x = mx.array([list(r.tokens[prefix:]) + [0] * (width - len(r.tokens) + prefix) for r in batch])
                arrays.append((x, sum(len(r.tokens) - prefix for r in batch)))
            batches.append((prefix, arrays))
        plan.append((prefix_tokens, dict(batches)))
    mx.eval([x for _, b in plan for arrays in b.values() for x, _ in arrays])
    return plan


def bare_forward(lm, plan) -> tuple[int, int]:
    """Run the plan; returns (forward calls, tokens run incl. padding, of which real)."""
    import mlx.core as mx

    from worker.score import _broadcast, _prefix_cache

    calls = tokens = real = 0
    for prefix_tokens, batches in plan:
        cache = _prefix_cache(lm, prefix_tokens) if prefix_tokens else None  # one body forward + eval
        if cache is not None:
            calls, tokens, real = calls + 1, tokens + len(prefix_tokens), real + len(prefix_tokens)
        prefix = len(prefix_tokens) if cache is not None else 0
        for x, n_real in batches[prefix]:
            mx.eval(lm.head.body(x, cache=_broadcast(cache, x.shape[0]) if cache is not None else None))
            calls, tokens, real = calls + 1, tokens + x.size, real + n_real
    return calls, tokens, real


# --- running and printing ----------------------------------------------------------------------------


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def max_delta(a, b) -> float:
    return max((abs(x[0] - y[0]) for x, y in zip(a, b)), default=0.0)


def greedy_mismatch(a, b) -> int:
    return sum(bool(x[1]) != bool(y[1]) for x, y in zip(a, b))


def table(title: str, rows: list[tuple[str, int, float]], orchard_rate: float) -> None:
    print(f"\n{title}")
    print(f"  {'row':<18}{'requests':>9}{'seconds':>10}{'req/s':>10}{'rate / Orchard':>16}")
    for name, n, sec in rows:
        rate = n / sec if sec > 0 else float("inf")
        print(f"  {name:<18}{n:>9}{sec:>10.2f}{rate:>10.1f}{rate / orchard_rate:>15.2f}x")


def budgeted(run, units: list[list[int]], budget: float) -> tuple[dict[int, tuple[float, bool]], int, float]:
    """Run `run(indices)` on the first units (lists of request indices) until `budget` seconds are spent.

    The first call takes one unit; later calls take as many as the measured rate says still fit, so the
    slow baselines get a comparable req/s without scoring everything. Returns (results, requests, seconds).
    """
    done, spent, results = 0, 0.0, {}
    while done < len(units):
        if done:
            left = budget - spent
            per_unit = spent / done
            if left < 0.5 * per_unit:
                break
            take = max(1, min(int(left / per_unit), 2 * done))  # grow geometrically: estimates firm up
        else:
            take = 1
        idx = [i for u in units[done : done + take] for i in u]
        out, sec = timed(lambda: run(idx))
        results.update(zip(idx, out))
        done, spent = done + take, spent + sec
    return results, len(results), spent


def run_setting(label, shots, data, orchard, mlxlm_eval, seed_model, args) -> dict:
    import mlx.core as mx

    from worker.score import loglikelihood as kernel

    lm = orchard.executor.lm
    per_subject = []
    warm_ctxs = []
    for subject, d in data.items():
        per_subject.append(contexts(subject, d["test"], d["dev"], shots))
        warm_ctxs += contexts(subject, d["warm"], d["dev"], shots)
    ctxs = [c for group in per_subject for c in group]
    inst, warm = instances(ctxs), instances(warm_ctxs)
    n = len(inst)
    # Round-robin over subjects, so a budgeted prefix of the questions covers every subject.
    offsets = [sum(map(len, per_subject[:s])) for s in range(len(per_subject))]
    order = [offsets[s] + q for q in range(max(map(len, per_subject))) for s in range(len(per_subject)) if q < len(per_subject[s])]
    questions = [[4 * q + j for j in range(4)] for q in order]

    # Tokenize once, as the driver does (TemplateLM: trailing-space move, encode(ctx+cont)[len(ctx):]).
    pairs, tok_s = timed(lambda: [tuple(map(tuple, orchard._encode_pair(*r.args))) for r in inst])
    warm_pairs = [tuple(map(tuple, orchard._encode_pair(*r.args))) for r in warm]
    lens = sorted(len(c) + len(t) for c, t in pairs)
    print(
        f"\n== {label}: {len(ctxs)} questions x 4 = {n} requests; prompt tokens min/median/max "
        f"{lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}; tokenization {tok_s:.2f}s "
        f"({n / tok_s:.0f} req/s, included in 'orchard mlx') =="
    )

    # Warm up every row once, on requests no timed row sees (held-out val questions); the slow rows only
    # in the first setting (a 5-shot warm-up costs them seconds and they hold no shape-dependent state).
    orchard.loglikelihood(warm[:8], disable_tqdm=True)
    kernel(lm, warm_pairs[:8], orchard.batching)
    bare_forward(lm, bare_plan(lm, warm_pairs[:8], orchard.batching))
    if not getattr(mlxlm_eval, "_bench_warm", False):
        mlxlm_eval.loglikelihood(warm[:4])
        seed000_loglikelihood(seed_model, warm_pairs[:1], orchard.max_length)
        mlxlm_eval._bench_warm = True

    res = {}
    plan = bare_plan(lm, pairs, orchard.batching)
    t_orchard = t_kernel = t_bare = float("inf")
    for _ in range(args.repeat):  # interleaved; the best of each row counts
        res["orchard"], t = timed(lambda: orchard.loglikelihood(inst, disable_tqdm=True))
        t_orchard = min(t_orchard, t)
        res["kernel"], t = timed(lambda: kernel(lm, pairs, orchard.batching))
        t_kernel = min(t_kernel, t)
        (calls, toks, real), t = timed(lambda: bare_forward(lm, plan))
        t_bare = min(t_bare, t)
    mlx_res, n_mlx, t_mlxlm = budgeted(lambda idx: mlxlm_eval.loglikelihood([inst[i] for i in idx]), questions, args.baseline_seconds)
    seed_units = [[i] for q in questions for i in q]
    seed_res, n_seed, t_seed = budgeted(
        lambda idx: seed000_loglikelihood(seed_model, [pairs[i] for i in idx], orchard.max_length), seed_units, args.baseline_seconds
    )

    rows = [
        ("orchard mlx", n, t_orchard),
        ("orchard kernel", n, t_kernel),
        ("mlx_lm.evaluate", n_mlx, t_mlxlm),
        ("seed 000", n_seed, t_seed),
        ("bare forward", n, t_bare),
    ]
    orchard_rate = n / t_orchard
    b = orchard.batching
    table(f"{label} (Orchard batch_size={b.batch_size}, max_batch_tokens={b.max_batch_tokens}, prefix_reuse={b.prefix_reuse})",
          rows, orchard_rate)
    print(f"  bare forward = the kernel's {calls} body forwards ({toks} tokens, {1 - real / toks:.0%} of them padding) "
          f"+ mx.eval, nothing else: no LM head, gather, log-softmax or bookkeeping")
    if args.repeat > 1:
        print(f"  orchard and bare rows: best of {args.repeat} interleaved runs")
    if n_mlx < n or n_seed < n:
        print(f"  mlx_lm.evaluate and seed 000 ran a {args.baseline_seconds:.0f}s budget each: the first requests, "
              f"round-robin over subjects")

    r_mlx = orchard_rate / (n_mlx / t_mlxlm)
    r_bare = t_bare / t_kernel
    target = TARGETS.get(label, 1.0)
    print(f"  Orchard vs mlx_lm.evaluate: {r_mlx:.2f}x  (target >= {target}x: {'MET' if r_mlx >= target else 'NOT MET'})")
    print(f"  Orchard kernel vs bare:     {r_bare:.2f}   (target >= {BARE_TARGET}: {'MET' if r_bare >= BARE_TARGET else 'NOT MET'}); "
          f"end-to-end 'orchard mlx' vs bare {t_bare / t_orchard:.2f}")

    def agree(other: dict) -> str:
        keys = sorted(other)
        mine, theirs = [res["orchard"][i] for i in keys], [other[i] for i in keys]
        return f"{max_delta(mine, theirs):.2e} over {len(keys)} (greedy flags differ: {greedy_mismatch(mine, theirs)})"

    print(f"  agreement, max |dLL| of orchard mlx vs: mlx_lm.evaluate {agree(mlx_res)}; seed 000 {agree(seed_res)}; "
          f"orchard kernel {max_delta(res['orchard'], res['kernel']):.2e}")
    mx.clear_cache()
    return {"orchard": orchard_rate, "ratio_mlx": r_mlx, "ratio_bare": r_bare}


def main(argv=None) -> int:
    global MMLU
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=None, help="test questions per subject (default 25; --quick 4)")
    p.add_argument("--subjects", type=int, default=None, help=f"how many of {', '.join(SUBJECTS)} (default 4; --quick 2)")
    p.add_argument("--baseline-seconds", type=float, default=None,
                   help="time budget per setting for each slow row, mlx_lm.evaluate and seed 000 (default 20; --quick 2)")
    p.add_argument("--batch-size", type=int, default=32, help="Orchard batch_size (its default: 32)")
    p.add_argument("--settings", default="0,5", help="comma-separated shot counts (default 0,5)")
    p.add_argument("--repeat", type=int, default=1, help="time the orchard and bare rows this many times, keep the best")
    p.add_argument("--mmlu", type=Path, default=None, help="hendrycks MMLU CSV folder (default ../shared/data/mmlu; synthetic questions when absent)")
    p.add_argument("--quick", action="store_true", help="smoke run (~40 s with reference BLAS)")
    args = p.parse_args(argv)
    MMLU = args.mmlu or MMLU
    args.questions = args.questions or (4 if args.quick else 25)
    args.subjects = args.subjects or (2 if args.quick else 4)
    args.baseline_seconds = args.baseline_seconds if args.baseline_seconds is not None else (2.0 if args.quick else 20.0)

    t0 = time.perf_counter()
    import mlx.core as mx

    print(f"BLAS: {blas_in_use()}")
    print(f"host: {platform.machine()} {platform.system()}, {os.cpu_count()} cpus, mlx {mx.__version__}, "
          f"device {mx.default_device()}, load average {os.getloadavg()[0]:.2f}")
    source, data = load_subjects(args.subjects, args.questions, warm=2)
    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        path, tokenizer = write_bench_model(Path(tmp) / "model")
        cfg = json.loads((path / "config.json").read_text())
        print(f"model: random-weight llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
              f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} kv, vocab {cfg['vocab_size']}; "
              f"tokenizer: {tokenizer}")
        print(f"requests: {source}; subjects: {', '.join(data)}; {args.questions} questions each")

        from mlx_lm.evaluate import MLXLM as MLXLMEval

        from driver.lm.mlx import MLXLM

        orchard = MLXLM(pretrained=str(path), batch_size=args.batch_size)
        mlxlm_eval = MLXLMEval(str(path))
        seed_model = mlxlm_eval._model  # what the seed's mlx_lm.load(path) returns: the plain model
        print(f"orchard head split: {orchard.executor.lm.head.split}; max_length {orchard.max_length}; "
              f"setup {time.perf_counter() - t0:.1f}s")
        summary = {}
        for shots in (int(s) for s in args.settings.split(",")):
            summary[f"{shots}-shot"] = run_setting(f"{shots}-shot", shots, data, orchard, mlxlm_eval, seed_model, args)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
