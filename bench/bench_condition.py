"""Benchmark: what conditional steering (CAST, worker.hooks.condition) costs next to the same steering unconditioned.

    python bench/bench_condition.py               # ~1-2 min on a 2-core box
    python bench/bench_condition.py --shots 5     # MMLU 5-shot: long shared few-shot prefixes
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_condition.py

The model and requests of bench_steer.py (random-weight llama, hidden 256, 4 layers, GPT-2 tokenizer; lm-eval mmlu
loglikelihood requests from ../shared/data/mmlu, synthetic when absent), through worker.jobs.run as a worker runs
a job. Rows, each against the anchor measured in this process, interleaved (ABC BCA ...), best of --repeat:

  loglikelihood   one add at the middle layer (anchor); the same add with a condition at the layer below
                  (target <= 1.1x); and, for scale, the unconditional add with prefix sharing off (a conditional
                  job turns it off: every row's whole prompt must pass the condition's layers).
  generate        greedy generation of --gen-tokens tokens on the first --gen-prompts contexts: the same pair.

Not a test: it asserts nothing, it prints tables (the box is shared: say the load, rerun when it is high).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import bench_steer as bs  # noqa: E402  (sys.path, BLAS line, interleave, table, MMLU requests)

bw = bs.bw
CONDITION_TARGET = 1.1


def steerings(lm):
    import numpy as np

    from worker.spec import Condition, Gate, Intervention, Steering

    rng = np.random.default_rng(0)
    hidden, layer = lm.model.args.hidden_size, lm.n_layers // 2
    v = tuple(float(x) for x in rng.standard_normal(hidden) / np.sqrt(hidden))
    c = tuple(float(x) for x in rng.standard_normal(hidden))
    plain = Steering(interventions=(Intervention(layer=layer, vector=v, alpha=2.0),))
    gate = Gate(conditions=(Condition(vector=c, layers=(layer - 1,), threshold=0.0),))
    return plain, Steering(interventions=(Intervention(layer=layer, vector=v, alpha=2.0, condition=gate),))


def part(kind: str, lm, batching, requests, warm, repeats: int) -> None:
    from worker.jobs import run
    from worker.spec import Job

    plain, conditional = steerings(lm)
    variants = {
        "add, unconditional (anchor)": (Job(kind=kind, steering=plain), batching, None),
        "add if cos>0 (conditional)": (Job(kind=kind, steering=conditional), batching, CONDITION_TARGET),
        "add, unconditional, no prefix sharing": (Job(kind=kind, steering=plain), batching.model_copy(update={"prefix_reuse": False}), None),
    }
    for job, b, _ in variants.values():
        run(lm, job, warm, b)
    times, out = bs.interleave({name: (lambda j=job, b=b: run(lm, j, requests, b)) for name, (job, b, _) in variants.items()}, repeats)
    fired = sum(r[-1] for r in out["add if cos>0 (conditional)"])
    rows = [{"name": name, "times": times[name], "n": len(requests), "target": target} for name, (_, _, target) in variants.items()]
    bs.table(f"{kind}: {len(requests)} requests, conditional fired on {fired}; best of {repeats}", "req", rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shots", type=int, default=0)
    p.add_argument("--subjects", type=int, default=3)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--gen-prompts", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    import mlx.core as mx

    from driver.lm.mlx import MLXLM
    from worker.generate import GenRequest

    t0 = time.perf_counter()
    print(f"BLAS: {bs.blas_line()}")
    print(f"host: {platform.machine()} {platform.system()}, {os.cpu_count()} cpus, mlx {mx.__version__}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="orchard-bench-condition-") as tmp:
        path, tokenizer = bw.write_bench_model(Path(tmp) / "model")
        cfg = json.loads((path / "config.json").read_text())
        print(f"model: random-weight llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers; tokenizer: {tokenizer}")
        source, data = bw.load_subjects(args.subjects, args.questions, warm=1)
        orchard = MLXLM(pretrained=str(path))
        pairs, warm_pairs, lens = bs.mmlu_requests(orchard, data, args.shots)
        print(f"requests: {source}; {args.shots}-shot, {len(pairs)} loglikelihood requests, tokens median {lens[len(lens) // 2]}")
        lm, batching = orchard.executor.lm, orchard.batching
        part("loglikelihood", lm, batching, pairs, warm_pairs, args.repeat)
        contexts = list(dict.fromkeys(c for c, _ in pairs))
        gen = [GenRequest(context=c, max_gen_toks=args.gen_tokens) for c in contexts[: args.gen_prompts]]
        part("generate", lm, batching, gen, gen[:4], args.repeat)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
