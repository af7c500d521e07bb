"""The judge's time per generation (issue 36 item 5): Orchard rating every generation on AxBench's three 0–2 scales
(driver.judge.rate: each rubric prompt three one-token loglikelihood requests, scored in one row; the prompts of a
scale share their rubric prefix, run once per chunk) against mlx-lm scoring one rubric prompt at a time (a plain
forward of the whole prompt, its last position's digit probabilities): the anchor.

    python bench/bench_judge.py             # ~3-6 min on a 2-core box with reference BLAS
    python bench/bench_judge.py --quick     # smoke run
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_judge.py

Rows: mlx-lm per prompt (anchor); Orchard in this process (`mlx`, LocalExecutor: prefix sharing and batching
alone); Orchard on 2 workers (`mlx-ray`, an embedded local Ray, one thread each; Ray's start and the judge's loads
are not timed, reported below). Judge: bench_worker's random-weight llama (hidden 256, 4 layers) with the GPT-2
tokenizer (its digits "0", "1", "2"); generations: 48-word texts after the happy example's prompts. The variants
are interleaved and the best of N counts; every rating is checked equal across the three (max |Δ|)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_steer as bs  # noqa: E402  (BLAS line, interleaving, tables; puts the project on sys.path)
import bench_worker as bw  # noqa: E402  (the judge model)

TARGET = 3.0  # Orchard on 2 workers: generations/s over mlx-lm's one prompt at a time
WORDS = ("the little girl was happy and she played with her dog in the sun while her mom made a big cake for "
         "everyone at the party then they laughed and sang songs until night came and the stars").split()  # fmt: skip


def items(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(instruction, generated text) pairs: the happy example's prompts, 48 random words each."""
    import json

    prompts = [json.loads(line)["prompt"] for line in open(bw.ROOT / "examples" / "happy" / "prompts.jsonl")]
    rng = random.Random(seed)
    return [(prompts[i % len(prompts)], " ".join(rng.choice(WORDS) for _ in range(48))) for i in range(n)]


def mlx_lm_variant(path: Path, plan, pairs):
    """Each rubric prompt alone: mlx-lm's model on the whole prompt (the LM head at its last position only, as
    Orchard's kernel computes it only where a token is scored), the digit probabilities there."""
    import mlx.core as mx
    from mlx_lm import load

    from driver.judge.rubric import SCALES, digit_ids, judge_prompt, rating

    model, tok = load(str(path))
    digits = digit_ids(tok._tokenizer)

    def run() -> list[dict]:
        out = []
        for instruction, text in pairs:
            ratings = {}
            for s in SCALES:
                prompt = judge_prompt(tok._tokenizer, plan.rubric[s], concept=plan.concept, instruction=instruction, sentence=text)
                hidden = model.model(mx.array([tok.encode(prompt)]))[:, -1:]  # the head at the last position only
                logits = (model.lm_head(hidden) if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear(hidden))[0, -1]
                logits = logits.astype(mx.float32)
                logprobs = logits - mx.logsumexp(logits)
                ratings[s] = rating(logprobs[mx.array(digits)].tolist())
            out.append(ratings)
        return out

    return run


def orchard_variant(lm, plan, pairs):
    from driver.judge.rate import rate

    return lambda: [j.ratings for j in rate(lm, plan, pairs)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generations", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="24 generations, best of 2")
    args = p.parse_args(argv)
    n = 24 if args.quick else args.generations
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from driver.judge.rate import JudgePlan
    from driver.judge.rubric import load_rubric
    from driver.lm.mlx import MLXLM
    from driver.lm.mlx_ray import MLXRayLM

    print(f"BLAS: {bs.blas_line()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        path, about = bw.write_bench_model(Path(tmp) / "judge")
        plan, pairs = JudgePlan({"pretrained": str(path)}, "happiness", load_rubric()), items(n)
        local = MLXLM(pretrained=str(path))
        t0 = time.perf_counter()
        ray_lm = MLXRayLM.create_from_arg_obj({"pretrained": str(path), "workers": 2, "threads": 1, "address": "local"})
        try:
            ray_lm.executor.wait_ready()
            startup = time.perf_counter() - t0
            variants = {"mlx-lm, one prompt per forward (anchor)": mlx_lm_variant(path, plan, pairs),
                        "Orchard in-process (mlx)": orchard_variant(local, plan, pairs),
                        "Orchard, 2 workers (mlx-ray)": orchard_variant(ray_lm, plan, pairs)}  # fmt: skip
            orchard_variant(ray_lm, plan, pairs[:6])()  # warm-up: both workers hold the judge
            times, out = bs.interleave(variants, args.repeats)
            blas = sorted({f["blas"] for f in ray_lm.executor.facts})
        finally:
            ray_lm.executor.close()
        tokens = sorted(len(local.tok_encode(t)) for t in _prompts(local, plan, pairs))
    names = list(variants)
    rows = [{"name": name, "times": times[name], "n": n, "target": None if i == 0 else (TARGET if i == 2 else None),
             "extra": f"{1000 * min(times[name]) / n:.1f}", "extra_head": "ms per generation"} for i, name in enumerate(names)]
    bs.table(f"judge time per generation: 3 rubric prompts each, {n} generations (best of {args.repeats})", "generation", rows, speedup=True)
    diff = max(abs(a[s] - b[s]) for other in names[1:] for a, b in zip(out[names[0]], out[other]) for s in a)
    print(f"  judge: {about}; rubric prompts {len(tokens)}, tokens min/median/max {tokens[0]}/{tokens[len(tokens) // 2]}/{tokens[-1]}")
    print(f"  ratings: max |Δ| between the variants {diff:.2g}; workers' BLAS {', '.join(blas)}; Ray start + 2 judge loads "
          f"{startup:.1f} s (not timed)")
    return 0


def _prompts(lm, plan, pairs) -> list[str]:
    from driver.judge.rubric import SCALES, judge_prompt

    return [judge_prompt(lm.tokenizer, plan.rubric[s], concept=plan.concept, instruction=i, sentence=t) for i, t in pairs for s in SCALES]


if __name__ == "__main__":
    sys.exit(main())
