"""Sweep axes over SAE features and conditions (issue 28): `top: K` features of an SAE ranked by their mean activation
on a prompt set (captured on the workers, encoded with the SAE's own encoder), and `grid.thresholds` under a CAST
`condition:`, each configuration equal to a plain (or conditional) steered run of it.

The encoder is checked against sparsify's own `SparseCoder.encode` (the installed test-only oracle) and, where it is
installed, sae-lens' (tests/test_steer_saes.py says why sae-lens is not a test extra); the other layouts against the
formula each library's code computes, written out here in numpy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from driver.cli import main
from driver.steering.encoders import capture_requests, per_prompt, prompt_weights, ranked, read_encoder
from driver.steering.saes import SaeError, read_sae

torch = pytest.importorskip("torch")

HIDDEN, N_LATENTS = 64, 12
PROMPTS = ["Once upon a time a girl felt", "The king said he was", "At night the cat was very", "Dog"]


def sweep_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["sweep", *map(str, args)])
    return result.exit_code, result.output


def write_sparsify(folder: Path, seed: int, k: int = 4, activation: str | None = None) -> tuple[np.ndarray, ...]:
    """A sparsify folder (SparseCoder.save_to_disk's layout) with an encoder of its own, not the decoder's transpose."""
    rng = np.random.default_rng(seed)
    w_enc, b_enc = rng.standard_normal((N_LATENTS, HIDDEN)).astype(np.float32), rng.standard_normal(N_LATENTS).astype(np.float32)
    w_dec, b_dec = rng.standard_normal((N_LATENTS, HIDDEN)).astype(np.float32), 3 * rng.standard_normal(HIDDEN).astype(np.float32)
    folder.mkdir(parents=True)
    save_file({"encoder.weight": w_enc, "encoder.bias": b_enc, "W_dec": w_dec, "b_dec": b_dec}, str(folder / "sae.safetensors"))
    cfg = {"num_latents": N_LATENTS, "k": k, "d_in": HIDDEN, "multi_topk": False, "skip_connection": False, "transcode": False}
    (folder / "cfg.json").write_text(json.dumps(cfg | ({"activation": activation} if activation else {})))
    return w_enc, b_enc, w_dec, b_dec


def write_sae_lens(folder: Path, seed: int, hook: str, **cfg) -> dict[str, np.ndarray]:
    """sae-lens 6's SAE.save_model layout with an encoder (W_enc [d_in, d_sae]); `threshold` for jumprelu."""
    rng = np.random.default_rng(seed)
    t = {"W_enc": rng.standard_normal((HIDDEN, N_LATENTS)), "b_enc": rng.standard_normal(N_LATENTS), "W_dec": rng.standard_normal((N_LATENTS, HIDDEN)),
         "b_dec": 3 * rng.standard_normal(HIDDEN), "threshold": np.abs(rng.standard_normal(N_LATENTS))}  # fmt: skip
    t = {k: v.astype(np.float32) for k, v in t.items() if k != "threshold" or cfg.get("architecture") == "jumprelu"}
    folder.mkdir(parents=True)
    save_file(t, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": HIDDEN, "d_sae": N_LATENTS, "dtype": "float32", "architecture": "standard",
                                                 "apply_b_dec_to_input": True, "normalize_activations": "none",
                                                 "metadata": {"hook_name": hook}} | cfg))  # fmt: skip
    return t


# --- the encoder, per layout --------------------------------------------------------------------------------


def sparsify_encode(folder: Path, x: np.ndarray) -> np.ndarray:
    """sparsify's own encoder (SparseCoder.load_from_disk + encode), its top-k activations made dense."""
    sparsify = pytest.importorskip("sparsify")
    coder = sparsify.SparseCoder.load_from_disk(folder, device="cpu")
    with torch.no_grad():
        out = coder.encode(torch.tensor(x))
    dense = torch.zeros(len(x), coder.num_latents).scatter_(1, out.top_indices, out.top_acts)
    return dense.numpy()


def sae_lens_formula(t: dict[str, np.ndarray], x: np.ndarray, arch: str, k: int | None = None, rescale: bool = False) -> np.ndarray:
    """sae-lens' encode (StandardSAE, JumpReLUSAE, TopKSAE: saes/*.py) written out: pre = (x - b_dec) W_enc + b_enc."""
    pre = (x - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
    if rescale:
        pre = pre * np.linalg.norm(t["W_dec"], axis=1)
    if arch == "jumprelu":
        return np.maximum(pre, 0) * (pre > t["threshold"])
    if arch == "topk":
        keep = np.zeros_like(pre, dtype=bool)
        np.put_along_axis(keep, np.argsort(-pre, axis=1)[:, :k], True, axis=1)
        return np.maximum(pre, 0) * keep
    return np.maximum(pre, 0)


def orchard_dense(folder: Path, x: np.ndarray) -> np.ndarray:
    """Orchard's activations [tokens, d_sae] (one token per weight row: mean_activation over a one-hot weighting),
    checked equal to each feature's own (`Encoder.feature`, which encodes only that feature's block)."""
    enc = read_encoder(read_sae(folder))
    dense = np.stack([enc.mean_activation(x, np.eye(len(x))[t]) for t in range(len(x))])
    assert np.allclose(np.stack([enc.feature(x, f) for f in range(enc.d_sae)], axis=1), dense, atol=1e-5)
    return dense


@pytest.mark.parametrize("blocks", [1 << 24, 7 * 5])  # one block, and blocks of 7 features (5 tokens): merged across blocks
def test_the_encoder_of_each_layout_gives_its_librarys_activations(tmp_path, monkeypatch, blocks):
    from driver.steering import encoders

    monkeypatch.setattr(encoders, "_BLOCK", blocks)
    x = np.random.default_rng(0).standard_normal((5, HIDDEN)).astype(np.float32) * 2
    write_sparsify(tmp_path / "sp", 1, k=3)
    assert np.allclose(orchard_dense(tmp_path / "sp", x), sparsify_encode(tmp_path / "sp", x), atol=1e-4)
    write_sparsify(tmp_path / "gm", 2, k=4, activation="groupmax")
    assert np.allclose(orchard_dense(tmp_path / "gm", x), sparsify_encode(tmp_path / "gm", x), atol=1e-4)
    for arch, extra in (("standard", {}), ("jumprelu", {}), ("topk", {"k": 3}), ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True})):
        t = write_sae_lens(tmp_path / f"sl-{arch}-{len(extra)}", 3, "blocks.1.hook_resid_post", architecture=arch, **extra)
        want = sae_lens_formula(t, x, arch, extra.get("k"), bool(extra.get("rescale_acts_by_decoder_norm")))
        assert np.allclose(orchard_dense(tmp_path / f"sl-{arch}-{len(extra)}", x), want, atol=1e-4), arch
        assert (want > 0).any() and (want == 0).any()
    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((N_LATENTS, HIDDEN)).astype(np.float32), rng.standard_normal(N_LATENTS).astype(np.float32)
    save_file({"encoder_linear.weight": w, "encoder_linear.bias": b, "decoder_linear.weight": w.T.copy(),
               "decoder_linear.bias": np.zeros(HIDDEN, np.float32)}, str(tmp_path / "gf.safetensors"))  # fmt: skip
    assert np.allclose(orchard_dense(tmp_path / "gf.safetensors", x), np.maximum(x @ w.T + b, 0), atol=1e-4)  # Goodfire: relu(Wx + b)


def test_sae_lens_itself_encodes_as_orchard_reads_its_saved_folder(tmp_path):
    """StandardSAE, JumpReLUSAE and TopKSAE saved by sae-lens's SAE.save_model (a test extra), encoded by sae-lens and
    by Orchard."""
    sae_lens = pytest.importorskip("sae_lens")
    x = np.random.default_rng(5).standard_normal((6, HIDDEN)).astype(np.float32) * 2
    made = [(sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}), (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
            (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 3})]  # fmt: skip
    for n, (cls, config, extra) in enumerate(made):
        sae = cls(config(d_in=HIDDEN, d_sae=N_LATENTS, **extra))
        sae.cfg.metadata.hook_name = "blocks.1.hook_resid_post"
        with torch.no_grad():
            for p in sae.parameters():
                p.normal_()
        sae.save_model(tmp_path / f"s{n}")
        with torch.no_grad():
            want = sae.encode(torch.tensor(x)).numpy()
        assert np.allclose(orchard_dense(tmp_path / f"s{n}", x), want, atol=1e-4), cls.__name__
        assert (want > 0).any() and (want == 0).any()


def test_capture_weights_skip_the_bos_and_weigh_each_prompt_once_and_ranking_breaks_ties_by_index():
    requests, owners = capture_requests([[1, 5, 6, 7], [1, 9], [4, 2]], prefix=1)
    assert requests == [((1, 5, 6, 7), 1), ((1, 5, 6, 7), 2), ((1, 5, 6, 7), 3), ((1, 9), 1), ((4, 2), 0), ((4, 2), 1)]
    weights = prompt_weights(owners)
    assert np.allclose(weights, [1 / 9] * 3 + [1 / 3] + [1 / 6] * 2) and abs(weights.sum() - 1) < 1e-12
    assert np.allclose(per_prompt(np.array([1.0, 2, 6, 5, 0, 4]), owners), [3, 5, 2])
    assert ranked(np.array([0.5, 2.0, 0.5, 3.0, 0.0]), 3) == [(3, 3.0), (1, 2.0), (0, 0.5)]


@pytest.mark.parametrize("change, says", [
    (lambda f: (f / "sae_weights.safetensors").write_bytes(b""), "not a readable .safetensors"),
    ("decoder only", "no encoder (W_enc): this SAE was saved with its decoder only"),
    ({"architecture": "gated"}, "a sae-lens 'gated' SAE, whose encoder Orchard does not compute"),
    ({"normalize_activations": "layer_norm"}, "normalize_activations 'layer_norm': Orchard encodes unnormalised inputs only"),
    ({"architecture": "topk", "k": 40}, "cfg.json's k (40) is not a number of features this 12-feature topk SAE keeps"),
])  # fmt: skip
def test_an_encoder_orchard_cannot_compute_is_one_line(tmp_path, change, says):
    t = write_sae_lens(tmp_path / "s", 6, "blocks.1.hook_resid_post")
    if change == "decoder only":
        save_file({k: v for k, v in t.items() if k in ("W_dec", "b_dec")}, str(tmp_path / "s" / "sae_weights.safetensors"))
    elif callable(change):
        change(tmp_path / "s")
    else:
        cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
        (tmp_path / "s" / "cfg.json").write_text(json.dumps(cfg | change))
    with pytest.raises(SaeError, match=re.escape(says)) as e:
        read_encoder(read_sae(tmp_path / "s"))
    assert "\n" not in str(e.value)


# --- top: K through `driver sweep` --------------------------------------------------------------------------


def captured(llama_path: Path, layer: int) -> list[np.ndarray]:
    """resid_post.`layer` at every token of each prompt as lm-eval tokenizes it (tok_encode), in process."""
    import mlx.core as mx

    from driver.steering.vectors import head_encoder
    from worker.hooks import Rows
    from worker.load import load

    lm, encode = load(str(llama_path)), head_encoder(llama_path)
    out = []
    for p in PROMPTS:
        seen = []
        with lm.hooks.installed([(f"resid_post.{layer}", lambda x, ctx: seen.append(x) or x)]), lm.hooks.forward(Rows()):
            mx.eval(lm.model(mx.array([encode(p)])))
        out.append((encode(p)[0], np.asarray(seen[0][0], dtype=np.float32)))
    return out


def prompt_states(llama_path: Path, layer: int) -> list[np.ndarray]:
    """resid_post.`layer` of each prompt's tokens but its BOS."""
    from driver.lm.model_setup import load_tokenizer

    bos = load_tokenizer(llama_path, False).bos_token_id
    return [h[1:] if first == bos and len(h) > 1 else h for first, h in captured(llama_path, layer)]


def mean_activations(folder: Path, states: list[np.ndarray], shift: np.ndarray | float = 0.0) -> np.ndarray:
    """Each feature's activation (sparsify's own encoder) at `states` + `shift`: each prompt's tokens averaged, then
    the prompts."""
    return np.mean([sparsify_encode(folder, h + shift).astype(np.float64).mean(axis=0) for h in states], axis=0)


def expected_top(llama_path: Path, folder: Path, layer: int, k: int) -> list[tuple[int, float]]:
    """The k features of highest mean activation, by sparsify's own encoder: each prompt's tokens but its BOS averaged,
    then the prompts averaged."""
    means = mean_activations(folder, prompt_states(llama_path, layer))
    order = sorted(range(len(means)), key=lambda f: (-means[f], f))[:k]
    return [(f, float(means[f])) for f in order]


def top_study(folder: Path, llama_path: Path, extra_vectors: str = "") -> Path:
    """A prompts-only sweep over the top 2 features of a sparsify run (an SAE per layer) on the prompts above."""
    from test_sweep import site_study

    sweep = site_study(folder, llama_path, None, "[resid_post]", {"unused.0": np.zeros(HIDDEN, np.float32)})
    (folder / "rank.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for layer in (0, 1):
        write_sparsify(folder / "run" / f"layers.{layer}", 20 + layer)
    text = sweep.read_text().replace("  v: {file: v.safetensors, normalize: true}", f"  feat: {{sae: run, top: 2, prompts: rank.jsonl}}{extra_vectors}")
    sweep.write_text(text)
    return sweep


def test_a_top_k_sweep_ranks_each_layers_sae_on_the_prompts_and_equals_plain_runs(ray_cluster, llama_path, tmp_path):
    """`{sae: RUN, top: 2, prompts: FILE}` over layers 0 and 1 on 2 workers: at each layer the two features of highest
    mean activation on the prompts (sparsify's own encoder on activations captured here in process), recorded in
    run.json and summary.md with their activations; every configuration equals a plain steered run of its feature, and
    says how far it moved its feature on those prompts (as does `features: [3]` with `prompts:` beside it)."""
    from test_sweep import assert_equals_plain_runs

    from driver.sweep import report

    sweep = top_study(tmp_path / "study", llama_path, "\n  sel: {sae: run, features: [3], prompts: rank.jsonl}")
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    assert code == 0, output
    facts = json.loads((out / "run.json").read_text())["top_features"]
    want = {layer: expected_top(llama_path, tmp_path / "study" / "run" / f"layers.{layer}", layer, 2) for layer in (0, 1)}
    assert [(t["layer"], t["site"], t["n_prompts"]) for t in facts] == [(0, "resid_post", 4), (1, "resid_post", 4)]
    for t in facts:
        got = [(f["feature"], f["mean_activation"]) for f in t["features"]]
        assert [f for f, _ in got] == [f for f, _ in want[t["layer"]]], (t["layer"], got, want[t["layer"]])
        assert np.allclose([a for _, a in got], [a for _, a in want[t["layer"]]], rtol=1e-4, atol=1e-5)
    assert want[0] != want[1]  # each layer its own SAE, its own features
    rows = report.read_csv(out / "results.csv")
    assert {(r["vector"], r["layer"]) for r in rows if r["config"] != "baseline"} == {
        (f"feat-f{f}", layer) for layer in (0, 1) for f, _ in want[layer]} | {("sel-f3", 0), ("sel-f3", 1)}
    text = (out / "summary.md").read_text()
    assert "## Top features" in text and f"| feat | resid_post | 1 | rank.jsonl (4, " in text
    assert f"| {want[1][0][0]} | {want[1][0][1]:.4g} |" in text

    def spec_of(r: dict) -> dict:
        return {"layer": r["layer"], "alpha": r["alpha"], "vector": {"sae": "run", "feature": int(r["vector"].rpartition("-f")[2])}}

    diffs = assert_equals_plain_runs(rows, sweep, spec_of)
    steered = {(r["layer"], r["vector"].rpartition("-f")[2], r["alpha"]): diffs[r["config"]] for r in rows if r["config"] != "baseline"}
    assert len({round(d, 4) for d in steered.values()}) == len(steered) and diffs["baseline"] not in steered.values()  # sel-f3 may be a top one
    # each configuration's own feature under its steering: add α·W_dec[f] at the SAE's site, read there by its encoder
    for layer in (0, 1):
        folder, states = tmp_path / "study" / "run" / f"layers.{layer}", prompt_states(llama_path, layer)
        w_dec, before = read_sae(folder).decoder(), mean_activations(folder, states)
        for r in (r for r in rows if r["metric"] == "feature_activation" and r["layer"] == layer):
            f = int(r["vector"].rpartition("-f")[2])
            steered = mean_activations(folder, states, r["alpha"] * w_dec[f])[f]
            assert r["task"] == "rank" and r["n"] == len(PROMPTS) and r["value"] == pytest.approx(steered, rel=1e-4, abs=1e-4), r
            assert r["delta"] == pytest.approx(steered - before[f], rel=1e-4, abs=1e-4), r
    moved = [r for r in rows if r["metric"] == "feature_activation"]
    assert len(moved) == 12 and all(abs(r["delta"]) > 1e-3 for r in moved) and (out / "plots" / "heatmap-rank-feature_activation.png").exists()


@pytest.mark.parametrize("edit, says", [
    (("top: 2", "top: 13"), "vectors.feat.top: 13 is past the SAE's 12 features \\(use 1..12"),
    (("rank.jsonl", "empty.jsonl"), "vectors.feat.prompts: .*empty.jsonl: no prompts \\(the file is empty\\)"),
    (("rank.jsonl", "missing.jsonl"), "sweep.yaml: vectors.feat: prompts: .*missing.jsonl does not exist"),
    (("sae: run,", "sae: lens,"), "vectors.feat.sae: the SAE at .*lens reads blocks.1.hook_resid_post \\(resid_post at layer 1\\), but the intervention steers resid_post at layer 0"),
    (("sae: run,", "sae: dec,"), "vectors.feat.sae: .*no encoder \\(W_enc\\)"),
    (("sae: run,", "sae: narrow,"), "vectors.feat.sae: the SAE at .*narrow/layers.0 is 32 wide \\(d_in\\) but the model's hidden size is 64"),
    (("top: 2, prompts: rank.jsonl", "top: 2"), "`top:` needs `prompts: FILE`"),
    (("top: 2", "top: 2, features: [1]"), "`sae:` takes either `features: \\[..\\]`"),
    (("layers: all\n", "layers: all\n  heads: [0]\n"), "vectors.feat.top: ranks features on a whole site's activations, not on attn_head's heads"),
])  # fmt: skip
def test_a_top_k_source_that_cannot_rank_is_refused_in_one_line_before_the_cluster(llama_path, tmp_path, edit, says):
    import re

    sweep = top_study(tmp_path / "study", llama_path)
    (tmp_path / "study" / "empty.jsonl").write_text("")
    write_sae_lens(tmp_path / "study" / "lens", 7, "blocks.1.hook_resid_post")
    rng = np.random.default_rng(8)
    for layer in (0, 1):  # a sparsify run of another model's width
        (tmp_path / "study" / "narrow" / f"layers.{layer}").mkdir(parents=True)
        save_file({"encoder.weight": rng.standard_normal((N_LATENTS, 32)).astype(np.float32), "W_dec": rng.standard_normal((N_LATENTS, 32)).astype(np.float32),
                   "b_dec": np.zeros(32, np.float32)}, str(tmp_path / "study" / "narrow" / f"layers.{layer}" / "sae.safetensors"))  # fmt: skip
        (tmp_path / "study" / "narrow" / f"layers.{layer}" / "cfg.json").write_text(json.dumps({"k": 4, "d_in": 32}))
    t = write_sae_lens(tmp_path / "study" / "dec", 7, "blocks.0.hook_resid_post")
    save_file({k: v for k, v in t.items() if k in ("W_dec", "b_dec")}, str(tmp_path / "study" / "dec" / "sae_weights.safetensors"))
    text = sweep.read_text().replace(*edit)
    if "heads" in edit[1]:
        text = text.replace("sites: [resid_post]", "sites: [attn_head]")
    sweep.write_text(text)
    code, output = sweep_cli(sweep, "--address", "127.0.0.1:1", "--output", tmp_path / "out")
    assert code == 1 and len(output.strip().splitlines()) == 1 and re.search(says, output), output
    assert "127.0.0.1:1" not in output and not (tmp_path / "out" / "run.json").exists()


# --- grid.thresholds under a CAST condition ---------------------------------------------------------------------


def cast_study(folder: Path, tasks: Path, thresholds: str, extra: str = "") -> Path:
    """A sweep on the stories model: vector v added at layer 3 (alpha 6) only where the prompt's mean input of layer 2
    lies along c (test_steer_condition's vectors and prompts), at `thresholds`, on two tasks and a prompt set."""
    from test_steer_condition import ALPHA, C_LAYER, PROMPTS as STORY_PROMPTS, S_LAYER

    from testbed.stories import MODEL

    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "v.npy", np.random.default_rng(3).standard_normal(64).astype(np.float32))
    np.save(folder / "c.npy", np.random.default_rng(7).standard_normal(64).astype(np.float32))
    lines = [json.dumps({"prompt": p, "targets": {"positive": " happy", "negative": " sad"}}) for p in STORY_PROMPTS]
    (folder / "stories.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "sweep.yaml").write_text(f"""model: {{pretrained: {MODEL}, batch_size: 8}}
vectors:
  v: {{layers: {{{S_LAYER}: v.npy}}}}
grid: {{layers: [{S_LAYER}], alphas: [{ALPHA}], thresholds: {thresholds}}}
condition: {{vector: c.npy, layers: [{C_LAYER}]}}
tasks: {{names: [tinystories_mc, tinystories_gen], limit: 6, include_path: {tasks}}}
prompts:
  - {{file: stories.jsonl, max_gen_toks: 8}}
{extra}""")
    return folder / "sweep.yaml"


def spec_at(folder: Path, threshold: float) -> dict:
    from test_steer_condition import ALPHA, C_LAYER, S_LAYER

    return {"interventions": [{"layer": S_LAYER, "vector": str(folder / "v.npy"), "alpha": ALPHA,
                               "condition": {"vector": str(folder / "c.npy"), "layers": [C_LAYER], "threshold": threshold}}]}  # fmt: skip


def story_target_scores(folder: Path, spec: dict) -> list[float]:
    """The prompt set's target log-likelihoods under `spec` in one conditional run of the in-process `mlx` model."""
    from lm_eval.api.instance import Instance

    from driver.lm.mlx import MLXLM
    from test_steer_condition import PROMPTS as STORY_PROMPTS
    from testbed.stories import MODEL

    lm = MLXLM(pretrained=str(MODEL), batch_size=8, steer=spec)
    requests = [Instance("loglikelihood", {}, (p, t), 0) for p in STORY_PROMPTS for t in (" happy", " sad")]
    return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]


@pytest.fixture(scope="module")
def story_sims():
    """CAST's similarity of each prompt of the set (test_steer_condition's numpy rule), and a threshold between them."""
    from test_steer_condition import C_LAYER, PROMPTS as STORY_PROMPTS, between, cast_rule, ids

    from testbed.stories import MODEL
    from worker.load import load

    lm = load(str(MODEL))
    c = np.random.default_rng(7).standard_normal(64).astype(np.float32)
    sims = [cast_rule(lm, ids(lm, p), c, C_LAYER) for p in STORY_PROMPTS]
    return sims, round(between(sims), 6)


@pytest.fixture(scope="module")
def story_tasks(tmp_path_factory):
    from testbed.stories import write_story_tasks

    return write_story_tasks(tmp_path_factory.mktemp("tasks"))


def test_a_threshold_sweep_equals_an_independent_conditional_run_per_threshold(ray_cluster, tmp_path, story_tasks, story_sims):
    """grid.thresholds [t, -1.5] under `condition:` on 2 workers: each configuration's lm-eval metrics and rows fired per
    task equal `driver run --steer` of that conditional spec, its prompt-set targets a conditional in-process run;
    the prompt set's `fired` share is CAST's numpy rule on its prompts; summary.md tabulates the fire rates."""
    from driver.sweep import report
    from testbed import inproc
    from testbed.stories import MODEL

    sims, t = story_sims
    sweep = cast_study(tmp_path / "study", story_tasks, f"[{t}, -1.5]")
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out, "--address", inproc.session_address())
    assert code == 0, output
    rows = report.read_csv(out / "results.csv")
    by = {(r["threshold"], r["task"], r["metric"]): r for r in rows if r["config"] != "baseline"}
    assert {r["threshold"] for r in rows} == {None, t, -1.5}
    for threshold in (t, -1.5):
        (tmp_path / f"s{threshold}.yaml").write_text(json.dumps(spec_at(tmp_path / "study", threshold)))
        proc = inproc.driver("run", "--model", MODEL,
                             "--tasks", "tinystories_mc,tinystories_gen", "--include-path", story_tasks, "--limit", "6", "--batch-size", "8",
                             "--steer", tmp_path / f"s{threshold}.yaml", "--workers", "1", "--output-path", tmp_path / f"run{threshold}",
                             "--address", inproc.session_address(), cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        plain = json.loads(next((tmp_path / f"run{threshold}").rglob("results_*.json")).read_text())
        for task, metrics in plain["results"].items():
            for name, value in metrics.items():
                if "," in name and "_stderr" not in name and isinstance(value, float):
                    label = name.removesuffix(",none")  # as results.csv names a metric: its filter unless none
                    assert by[(threshold, task, label)]["value"] == pytest.approx(value, abs=1e-9), (threshold, task, name)
        for task, f in plain["orchard_fired"].items():
            assert (by[(threshold, task, "fired")]["value"], by[(threshold, task, "fired")]["n"]) == (f["rate"], f["rows"])
        want = story_target_scores(tmp_path / "study", spec_at(tmp_path / "study", threshold))
        assert by[(threshold, "stories", "logprob_positive")]["value"] == pytest.approx(np.mean(want[0::2]), abs=1e-5)
        assert by[(threshold, "stories", "logprob_negative")]["value"] == pytest.approx(np.mean(want[1::2]), abs=1e-5)
        fired = by[(threshold, "stories", "fired")]
        assert (fired["value"], fired["n"]) == (np.mean([s > threshold for s in sims]), 3 * len(sims))  # 2 targets + 1 generation a prompt
    assert 0 < by[(t, "stories", "fired")]["value"] < 1 == by[(-1.5, "stories", "fired")]["value"]
    assert by[(t, "stories", "logprob_diff")]["value"] != by[(-1.5, "stories", "logprob_diff")]["value"]
    text = (out / "summary.md").read_text()
    assert "## Condition" in text and "| -1.5 | tinystories_mc | 100% | 1 |" in text and f"| {t:g} | stories |" in text
    assert json.loads((out / "run.json").read_text())["condition"]["thresholds"] == [t, -1.5]


@pytest.mark.parametrize("edit, says", [
    ((", thresholds: [0.1]}", "}"), "condition: give grid.thresholds, the thresholds to sweep it at"),
    (("condition: {vector: c.npy, layers: [2]}", ""), "`condition:` and grid.thresholds go together"),
    (("layers: [2]}", "layers: [2], threshold: 0.1}"), "condition: a sweep takes its thresholds as an axis: list them in grid.thresholds"),
    (("layers: [2]}", "layers: [4]}"), "condition.layers: 4 comes after the steered layer 3: .* (layer 3, site resid_post)"),
    (("c.npy", "c32.npy"), "condition.vector: has 32 values but the model's hidden size is 64"),
    (("thresholds: [0.1]", "thresholds: [0.1, 0.1]"), "grid.thresholds: 0.1 is listed twice"),
    (("thresholds: [0.1]", "thresholds: [.nan]"), "grid.thresholds"),
])  # fmt: skip
def test_a_bad_condition_or_threshold_is_refused_in_one_line_before_the_cluster(tmp_path, story_tasks, edit, says):
    sweep = cast_study(tmp_path / "study", story_tasks, "[0.1]")
    np.save(tmp_path / "study" / "c32.npy", np.ones(32, np.float32))
    text = sweep.read_text()
    assert edit[0] in text
    sweep.write_text(text.replace(*edit))
    code, output = sweep_cli(sweep, "--address", "127.0.0.1:1", "--output", tmp_path / "out")
    pattern = re.escape(says).replace(re.escape(".* "), ".* ")
    assert code == 1 and len(output.strip().splitlines()) == 1 and re.search(pattern, output), output
    assert "127.0.0.1:1" not in output and not (tmp_path / "out" / "run.json").exists()


def test_a_conditional_sweep_on_a_pipeline_group_equals_one_worker(ray_cluster, tmp_path, story_tasks, story_sims):
    """The condition layer on rank 0, the steered layer on rank 1 (stories: layers 0-2 | 3-4): every row of
    results.csv, fire rates included, as one unsplit worker gives it (the decisions relayed between the ranks)."""
    from driver.sweep import report
    from testbed import inproc

    _, t = story_sims
    rows = {}
    for name, flags in (("single", ()), ("group", ("--group-size", 2, "--split", "pipeline"))):
        sweep = cast_study(tmp_path / name, story_tasks, f"[{t}]")
        code, output = sweep_cli(sweep, "--workers", 1, *flags, "--output", tmp_path / name / "out", "--address", inproc.session_address())
        assert code == 0, output
        rows[name] = {(r["config"], r["task"], r["metric"]): r["value"] for r in report.read_csv(tmp_path / name / "out" / "results.csv")}
    assert rows["group"].keys() == rows["single"].keys() and any(metric == "fired" for _, _, metric in rows["single"])
    for key, value in rows["single"].items():
        assert rows["group"][key] == (pytest.approx(value, abs=1e-4) if isinstance(value, float) else value), key


def test_a_threshold_sweep_draws_a_panel_per_threshold():
    """Rows of two thresholds: a heatmap panel each, titled with its threshold (never one panel's cells overwritten)."""
    from driver.sweep import plots

    def row(layer, alpha, threshold):
        return {"config": f"{layer}.{alpha}.{threshold}", "vector": "v", "site": "resid_post", "head": None, "layer": layer, "op": "add",
                "positions": "all", "alpha": alpha, "threshold": threshold, "value": layer + alpha + threshold, "delta": 1.0, "stderr": None}  # fmt: skip

    rows = [row(layer, a, t) for layer in (0, 1) for a in (-2.0, 2.0) for t in (0.1, 0.2)]
    panels = plots.facets(rows)
    assert list(panels) == [("v", "resid_post", "add", "all", ("t", 0.1)), ("v", "resid_post", "add", "all", ("t", 0.2))]
    assert all(len(p) == 4 for p in panels.values())
    assert plots._facet_title(next(iter(panels))).endswith("positions all, threshold 0.1")
    assert plots.heatmap("t", "m", rows)[:4] == b"\x89PNG"
