"""Fit a small SAE on TinyStories-260K and write the files the rest of this example reads (offline; 110 s on a loaded 2-core box).

1. Capture the residual stream at the input of layer 3 (`resid_pre.3`, TransformerLens' blocks.3.hook_resid_pre)
   at every token of the example stories, prompts and task contexts (examples/tinystories, examples/happy).
2. Fit a ReLU SAE (d_sae 128, tied-free encoder/decoder, L1 penalty, Adam, a few hundred full-batch steps) in
   numpy, and save it as sae-lens saves one (out/sae/cfg.json + sae_weights.safetensors: W_enc [d_in, d_sae],
   b_enc, W_dec [d_sae, d_in], b_dec).
3. Pick the feature to steer with (the most active on the two tasks' prompts, by the rule the sweep's `top: K`
   ranks with: each prompt's tokens but the BOS averaged, then the prompts) and a condition feature, calibrate its
   CAST threshold on those prompts (the median similarity, so about half the rows fire), and write
   out/task_prompts.jsonl, out/features.json, out/sweep.yaml (a sweep over the SAE's top 3 features on those
   prompts, ranked by the sweep itself on the workers), out/cast.yaml (the conditional steering spec) and
   out/thresholds.yaml (a sweep of the condition's threshold: the quartiles of the similarities).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from worker.hooks import Rows  # noqa: E402
from worker.load import load  # noqa: E402
from worker.spec import ModelSpec  # noqa: E402

LAYER, D_SAE, STEPS, L1, SEED = 3, 128, 600, 0.3, 0


def texts() -> tuple[list[str], list[str]]:
    """(everything to fit on, the two tasks' prompts: tinystories_mc contexts and tinystories_gen prompts)."""
    data = ROOT / "examples" / "tinystories"
    rows = lambda name: [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]  # noqa: E731
    prompts = [r["context"] for r in rows("mc.jsonl")] + [r["prompt"] for r in rows("gen.jsonl")]
    happy = [json.loads(line)["prompt"] for line in (ROOT / "examples/happy/prompts.jsonl").read_text().splitlines() if line]
    return [r["text"] for r in rows("stories.jsonl")] + prompts + happy, prompts


def capture(lm, text: str) -> np.ndarray:
    """[tokens, 64]: the input of block LAYER at every token of `text` (BOS first, as lm-eval feeds it)."""
    seen = []
    tokens = [lm.tokenizer.bos_token_id, *lm.tokenizer.encode(text, add_special_tokens=False)]
    with lm.hooks.installed([(f"resid_pre.{LAYER}", lambda x, ctx: seen.append(x) or x)]), lm.hooks.forward(Rows()):
        mx.eval(lm.model(mx.array([tokens])))
    return np.asarray(seen[0][0], dtype=np.float32)


def fit(x: np.ndarray) -> dict[str, np.ndarray]:
    """A ReLU SAE: f = relu((x - b_dec) W_enc + b_enc), x̂ = f W_dec + b_dec; loss |x - x̂|² + L1·|f|₁·|W_dec|."""
    rng = np.random.default_rng(SEED)
    d_in = x.shape[1]
    w_dec = rng.standard_normal((D_SAE, d_in)).astype(np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    p = {"W_enc": w_dec.T.copy(), "b_enc": np.zeros(D_SAE, np.float32), "W_dec": w_dec, "b_dec": x.mean(0)}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(val) for k, val in p.items()}
    scale = float(np.sqrt((x**2).sum(1).mean()))  # the residual's typical norm: the loss in its units
    for step in range(1, STEPS + 1):
        xc = x - p["b_dec"]
        pre = xc @ p["W_enc"] + p["b_enc"]
        f = np.maximum(pre, 0)
        err = f @ p["W_dec"] + p["b_dec"] - x
        norms = np.linalg.norm(p["W_dec"], axis=1)
        g_out = 2 * err / len(x) / scale**2
        g_f = (g_out @ p["W_dec"].T + L1 * norms / len(x) / scale) * (pre > 0)
        grads = {"W_dec": f.T @ g_out + L1 * (f.sum(0) / len(x) / scale)[:, None] * p["W_dec"] / np.maximum(norms, 1e-8)[:, None],
                 "b_dec": g_out.sum(0) - (g_f @ p["W_enc"].T).sum(0), "W_enc": xc.T @ g_f, "b_enc": g_f.sum(0)}
        for k in p:  # Adam, lr 3e-3
            m[k] = 0.9 * m[k] + 0.1 * grads[k]
            v[k] = 0.999 * v[k] + 0.001 * grads[k] ** 2
            p[k] -= (3e-3 * (m[k] / (1 - 0.9**step)) / (np.sqrt(v[k] / (1 - 0.999**step)) + 1e-8)).astype(np.float32)
        if step % 100 == 0:
            mse = float((err**2).sum(1).mean()) / scale**2
            print(f"  step {step}: relative MSE {mse:.3f}, active features per token {float((f > 0).sum(1).mean()):.1f}", flush=True)
    return {k: val.astype(np.float32) for k, val in p.items()}


def cast_similarity(h: np.ndarray, c: np.ndarray) -> float:
    """CAST's cos(h, tanh(P h)), P = c c^T / c.c, on the mean of a prompt's hidden states (as worker.hooks.condition)."""
    h = h.mean(0).astype(np.float64)
    projected = np.tanh(c * (c @ h) / (c @ c))
    return float(h @ projected / (np.linalg.norm(h) * np.linalg.norm(projected)))


def main() -> int:
    out = HERE / "out"
    (out / "sae").mkdir(parents=True, exist_ok=True)
    lm = load(ModelSpec(model=str(ROOT / "examples" / "stories260K")))
    fit_on, prompts = texts()
    x = np.concatenate([capture(lm, t) for t in fit_on])
    print(f"captured {len(x)} tokens at resid_pre.{LAYER} from {len(fit_on)} texts; fitting a {D_SAE}-feature ReLU SAE", flush=True)
    sae = fit(x)
    save_file(sae, str(out / "sae" / "sae_weights.safetensors"))
    cfg = {"architecture": "standard", "d_in": int(x.shape[1]), "d_sae": D_SAE, "hook_name": f"blocks.{LAYER}.hook_resid_pre",
           "hook_layer": LAYER, "dtype": "float32", "model_name": "stories260K", "apply_b_dec_to_input": True}  # fmt: skip
    (out / "sae" / "cfg.json").write_text(json.dumps(cfg, indent=2))
    hidden = [capture(lm, p) for p in prompts]
    acts = np.stack([np.maximum((h[1:] - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"], 0).mean(0) for h in hidden])  # BOS left out
    top = [int(i) for i in np.argsort(-acts.mean(0))[:3]]
    selective = int(np.argmax(acts.std(0) / (acts.mean(0) + 1e-6) * (acts.mean(0) > 0)))  # on for some prompts, off for others
    sims = [cast_similarity(h, sae["W_dec"][selective]) for h in hidden]
    threshold = round(float(np.median(sims)), 4)
    quartiles = [round(float(q), 4) for q in np.quantile(sims, [0.25, 0.5, 0.75])]
    (out / "task_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (out / "features.json").write_text(json.dumps({"top": top, "condition": selective, "threshold": threshold, "quartiles": quartiles}, indent=2))
    spec = (f"# Written by fit_sae.py: add SAE feature {top[0]} at layer {LAYER} only on prompts whose mean hidden state at\n"
            f"# layer {LAYER} lies along feature {selective} (CAST's cos(h, tanh(P h)) > {threshold}: the median on the two tasks' prompts).\n"
            f"interventions:\n  - layer: {LAYER}\n    site: resid_pre\n    vector: {{sae: sae, feature: {top[0]}}}\n    alpha: 4.0\n"
            f"    condition:\n      vector: {{sae: sae, feature: {selective}}}\n      layers: [{LAYER}]\n      threshold: {threshold}\n"
            f"      compare: greater\n      pool: mean\n")  # fmt: skip
    (out / "cast.yaml").write_text(spec)
    sweep = (f"# Written by fit_sae.py: the {len(top)} SAE features most active on the task prompts (ranked by the sweep on the\n"
             f"# workers with the SAE's encoder), added at layer {LAYER}'s input.\n"
             f"model: {{pretrained: ../../stories260K, max_length: 256, batch_size: 16}}\n"
             f"vectors:\n  feat: {{sae: sae, top: {len(top)}, prompts: task_prompts.jsonl}}\n"
             f"grid: {{layers: [{LAYER}], sites: [resid_pre], ops: [add], positions: [all], alphas: [-8, -4, 4, 8]}}\n"
             f"prompts:\n  - file: ../../happy/prompts.jsonl\n    max_gen_toks: 32\n    until: [\"\\n\"]\n    target_score: sum\n")  # fmt: skip
    (out / "sweep.yaml").write_text(sweep)
    thresholds = (f"# Written by fit_sae.py: feature {top[0]} added at layer {LAYER} under the condition of cast.yaml, at the quartiles of\n"
                  f"# its similarity on the two tasks' prompts: the fire rate per threshold and task is summary.md's Condition table.\n"
                  f"model: {{pretrained: ../../stories260K, max_length: 256, batch_size: 16}}\n"
                  f"vectors:\n  feat: {{sae: sae, features: [{top[0]}]}}\n"
                  f"condition: {{vector: {{sae: sae, feature: {selective}}}, layers: [{LAYER}], compare: greater, pool: mean}}\n"
                  f"grid: {{layers: [{LAYER}], sites: [resid_pre], alphas: [4.0], thresholds: {quartiles}}}\n"
                  f"tasks: {{names: [tinystories_mc, tinystories_gen], include_path: tasks}}\n")  # fmt: skip
    (out / "thresholds.yaml").write_text(thresholds)
    print(f"top features {top} (the sweep ranks them itself); condition feature {selective}, threshold {threshold}, "
          f"quartiles {quartiles}: wrote {out / 'cast.yaml'} and {out / 'thresholds.yaml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
