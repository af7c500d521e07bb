"""Benchmark: what conditional steering (CAST, worker.hooks.condition) costs next to the same steering unconditioned.

    python bench/bench_condition.py               # ~1-2 min on a 2-core box
    python bench/bench_condition.py --shots 5     # MMLU 5-shot: long shared few-shot prefixes
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_condition.py

The model and requests of bench_steer.py (random-weight llama, hidden 256, 4 layers, GPT-2 tokenizer; lm-eval mmlu
loglikelihood requests from ../shared/data/mmlu, synthetic when absent), through worker.jobs.run as a worker runs
a job. Rows, each against the anchor measured in this process, interleaved (ABC BCA ...), best of --repeat:

  loglikelihood   one add at the middle layer (anchor); the same add with a condition at the layer below
                  (target <= 1.1x); and, for scale, the unconditional add with prefix sharing off (what a
                  conditional job cost before it shared its prefixes per decision: worker.hooks.condition_share).
                  With --interventions 2, a second add at the layer above, conditioned at the middle layer, joins
                  each variant (a conditional job then needs each shared prefix 4 ways, one per combination: the
                  blocks below layer 2 once, block 2 per first decision, block 3 per combination).
  generate        greedy generation of --gen-tokens tokens on the first --gen-prompts contexts: the same rows.

The worker's prefix store (worker.prefix_cache) is emptied before every timed run: generation keeps unconditional
prefixes there across jobs, which would time the anchor's repeats on stored prefixes (conditional ones are not
stored: their prefix passes also give the probes' sums).
  CSV             an lm-eval steered CSV (an sae-lens SAE's feature, `add`) vs the same direction as a .npy spec,
                  the driver's reading of the file included (target <= 1.05x).

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


def steerings(lm, count: int = 1):
    """(unconditional, conditional): `count` adds at the middle layer and up, each conditioned at the layer below."""
    import numpy as np

    from worker.spec import Condition, Gate, Intervention, Steering

    rng = np.random.default_rng(0)
    hidden, layer = lm.model.args.hidden_size, lm.n_layers // 2
    plain, conditional = [], []
    for at in range(layer, layer + count):
        v = tuple(float(x) for x in rng.standard_normal(hidden) / np.sqrt(hidden))
        c = tuple(float(x) for x in rng.standard_normal(hidden))
        gate = Gate(conditions=(Condition(vector=c, layers=(at - 1,), threshold=0.0),))
        plain.append(Intervention(layer=at, vector=v, alpha=2.0))
        conditional.append(Intervention(layer=at, vector=v, alpha=2.0, condition=gate))
    return Steering(interventions=tuple(plain)), Steering(interventions=tuple(conditional))


def part(kind: str, lm, batching, requests, warm, repeats: int, count: int = 1) -> None:
    from worker.jobs import run
    from worker.prefix_cache import store
    from worker.spec import Job

    plain, conditional = steerings(lm, count)
    variants = {
        "add, unconditional (anchor)": (Job(kind=kind, steering=plain), batching, None),
        "add if cos>0 (conditional)": (Job(kind=kind, steering=conditional), batching, CONDITION_TARGET),
        "add, unconditional, no prefix sharing": (Job(kind=kind, steering=plain), batching.model_copy(update={"prefix_reuse": False}), None),
    }
    for job, b, _ in variants.values():
        run(lm, job, warm, b)
    def timed(job, b):
        store(lm).clear()
        return run(lm, job, requests, b)

    times, out = bs.interleave({name: (lambda j=job, b=b: timed(j, b)) for name, (job, b, _) in variants.items()}, repeats)
    fired = sum(r[-1] for r in out["add if cos>0 (conditional)"])
    rows = [{"name": name, "times": times[name], "n": len(requests), "target": target} for name, (_, _, target) in variants.items()]
    bs.table(f"{kind}: {len(requests)} requests, {count} add(s), conditional fired on {fired}; best of {repeats}", "req", rows)


def write_csv_and_spec(folder: Path, hidden: int, layer: int) -> tuple[Path, Path]:
    """An sae-lens SAE folder (16 random features), an lm-eval steered CSV adding feature 3 at layers.{layer}, and the
    same direction as a .npy in a plain spec: the two runs steer alike, only how the driver reads them differs."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    sae = folder / "sae"
    sae.mkdir(parents=True, exist_ok=True)
    w_dec = rng.standard_normal((16, hidden)).astype(np.float32) / np.sqrt(hidden)
    save_file({"W_dec": w_dec, "b_dec": np.zeros(hidden, np.float32), "W_enc": w_dec.T.copy(), "b_enc": np.zeros(16, np.float32)},
              str(sae / "sae_weights.safetensors"))  # fmt: skip
    (sae / "cfg.json").write_text(json.dumps({"d_in": hidden, "d_sae": 16, "hook_name": f"blocks.{layer}.hook_resid_post"}))
    csv = folder / "steer.csv"
    csv.write_text("loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description\n"
                   f"sae_lens,add,{sae},layers.{layer},3,2.0,,,bench\n")  # fmt: skip
    np.save(folder / "f3.npy", w_dec[3])
    spec = folder / "steer.yaml"
    spec.write_text(f"interventions:\n  - {{layer: {layer}, vector: f3.npy, alpha: 2.0}}\n")
    return csv, spec


def part_csv(lm, batching, config: dict, requests, folder: Path, repeats: int) -> None:
    """A CSV-steered run vs a vector-steered run: the driver's reading of the file (for_model) and the job."""
    from driver.steering.spec import for_model
    from worker.jobs import run
    from worker.spec import Job

    csv, spec = write_csv_and_spec(folder, config["hidden_size"], lm.n_layers // 2)

    def steered_by(source: Path):
        return lambda: run(lm, Job(kind="loglikelihood", steering=for_model(str(source), config).steering), requests, batching)

    variants = {"vector-steered spec (anchor)": steered_by(spec), "lm-eval steered CSV (sae_lens)": steered_by(csv)}
    for fn in variants.values():
        fn()
    times, out = bs.interleave(variants, repeats)
    same = all(a == b for a, b in zip(*out.values()))
    rows = [{"name": name, "times": times[name], "n": len(requests), "target": 1.05 if "CSV" in name else None} for name in variants]
    bs.table(f"CSV vs vector: {len(requests)} loglikelihood requests, file read included; same numbers: {same}; best of {repeats}", "req", rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shots", type=int, default=0)
    p.add_argument("--subjects", type=int, default=3)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--gen-prompts", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--interventions", type=int, default=1, choices=(1, 2))
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
        part("loglikelihood", lm, batching, pairs, warm_pairs, args.repeat, args.interventions)
        contexts = list(dict.fromkeys(c for c, _ in pairs))
        gen = [GenRequest(context=c, max_gen_toks=args.gen_tokens) for c in contexts[: args.gen_prompts]]
        part("generate", lm, batching, gen, gen[:4], args.repeat, args.interventions)
        part_csv(lm, batching, cfg, pairs, Path(tmp), args.repeat)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
