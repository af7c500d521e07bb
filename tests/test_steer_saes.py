"""lm-eval `steered` CSV files and SAE features as steering vectors, against lm-eval's own `steered` model (torch).

The SAE folders are written in each library's documented layout (sparsify: `hookpoint/cfg.json + sae.safetensors`;
sae-lens: `cfg.json + sae_weights.safetensors`; Goodfire: `decoder_linear.weight`), and the folders sparsify and
sae-lens save themselves (both test extras) are read too. lm-eval runs the same CSV where it can (clamp with
sparsify: its reader loads the folder with sparsify); elsewhere it is given the same tensors as a .pt
(its sae_lens reader only downloads, and its `add` refuses the b_dec its CSV reader always passes).

sae-lens is a test extra beside sparsify since 2026-12-05: an earlier session measured its install at 3.6 min and
`import sae_lens` at 32 s on this box at load ~15 and left it out; measured again on a quiet box, `pip install
sae-lens==6.54.12` over the installed extras took 11 s (34 packages, transformer-lens 3.9 among them, no installed
package changed) and `import sae_lens` 6 s. `write_sae_lens` (sae-lens 6's `SAE.save_model` layout written by hand)
stays for the lm-eval comparisons, whose runs are given the same tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from test_steer_sites import evaluate, responses  # noqa: E402  lm-eval's runs on the shared tasks

from driver.steering.spec import SteeringError, for_model, load_steering  # noqa: E402

MAX_LENGTH, N_FEATURES = 64, 12
HEADER = "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description,\n"


def write_sparsify(folder: Path, w_dec: np.ndarray, b_dec: np.ndarray) -> Path:
    """sparsify's SparseCoder.save_to_disk layout: cfg.json ({**cfg, d_in}) and sae.safetensors."""
    from safetensors.numpy import save_file

    n, d = w_dec.shape
    folder.mkdir(parents=True)
    save_file({"encoder.weight": w_dec.copy(), "encoder.bias": np.zeros(n, np.float32), "W_dec": w_dec, "b_dec": b_dec},
              str(folder / "sae.safetensors"))  # fmt: skip
    (folder / "cfg.json").write_text(json.dumps({"expansion_factor": 32, "normalize_decoder": True, "num_latents": n, "k": 4,
                                                 "multi_topk": False, "skip_connection": False, "transcode": False, "d_in": d}))  # fmt: skip
    return folder


def write_sae_lens(folder: Path, w_dec: np.ndarray, b_dec: np.ndarray, hook_name: str) -> Path:
    """sae-lens 6's SAE.save_model layout: cfg.json (hook_name under metadata) and sae_weights.safetensors."""
    from safetensors.numpy import save_file

    n, d = w_dec.shape
    folder.mkdir(parents=True)
    save_file({"W_enc": w_dec.T.copy(), "b_enc": np.zeros(n, np.float32), "W_dec": w_dec, "b_dec": b_dec},
              str(folder / "sae_weights.safetensors"))  # fmt: skip
    (folder / "cfg.json").write_text(json.dumps({"d_in": d, "d_sae": n, "dtype": "float32", "device": "cpu", "architecture": "standard",
                                                 "apply_b_dec_to_input": True, "normalize_activations": "none",
                                                 "metadata": {"hook_name": hook_name, "model_name": "tiny-llama"}}))  # fmt: skip
    return folder


def decoder(seed: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N_FEATURES, width)).astype(np.float32), rng.standard_normal(width).astype(np.float32)


def width(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["hidden_size"]


@pytest.fixture(scope="module")
def manager(tasks_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir))


def lm_eval_steered(model: Path, steer: Path, manager) -> dict:
    return evaluate("steered", {"pretrained": str(model), "steer_path": str(steer), "dtype": "float32", "max_length": MAX_LENGTH}, manager)


def assert_same(ours: dict, theirs: dict, plain: dict | None = None) -> None:
    mc = list(zip(responses(ours, "orchard_mc"), responses(theirs, "orchard_mc")))
    assert max(abs(x[0] - y[0]) for x, y in mc) <= 1e-4 and all(x[1] == y[1] for x, y in mc)
    ppl = list(zip(responses(ours, "orchard_ppl"), responses(theirs, "orchard_ppl")))
    assert all(abs(x - y) <= 1e-4 + 1e-6 * abs(y) for x, y in ppl), ppl
    assert responses(ours, "orchard_gen") == responses(theirs, "orchard_gen")
    if plain is not None:  # the steering did something
        assert max(abs(x[0] - p[0]) for (x, _), p in zip(mc, responses(plain, "orchard_mc"))) > 1e-2


def test_an_lm_eval_csv_of_both_loaders_and_actions_at_three_hookpoints_equals_lm_evals_steered(llama_path, manager, tmp_path):
    """One CSV: clamp (about b_dec) with sparsify at layers.1, clamp with sae_lens at layers.0.self_attn (hookpoint
    from the SAE's hook_name), add with sparsify at layers.1.mlp; lm-eval given the same tensors as a .pt."""
    d = width(llama_path)
    (w1, b1), (w2, b2), (w3, b3) = decoder(1, d), decoder(2, d), decoder(3, d)
    write_sparsify(tmp_path / "sp" / "layers.1", w1, b1)
    write_sae_lens(tmp_path / "sl" / "L0", w2, b2, "blocks.0.hook_attn_out")
    write_sparsify(tmp_path / "sp" / "layers.1.mlp", w3, b3)
    csv = tmp_path / "steer.csv"
    csv.write_text(HEADER + "sparsify,clamp,sp,layers.1,5,3.0,,,,\nsae_lens,clamp,sl,,7,-2.0,,L0,,\nsparsify,add,sp,layers.1.mlp,2,4.0,,,,\n")
    pt = tmp_path / "steer.pt"
    torch.save({
        "layers.1": {"action": "clamp", "steering_vector": torch.tensor(w1[5]), "steering_coefficient": 3.0, "bias": torch.tensor(b1)},
        "layers.0.self_attn": {"action": "clamp", "steering_vector": torch.tensor(w2[7]), "steering_coefficient": -2.0, "bias": torch.tensor(b2)},
        "layers.1.mlp": {"action": "add", "steering_vector": torch.tensor(w3[2]), "steering_coefficient": 4.0},
    }, pt)  # fmt: skip
    model_args = {"pretrained": str(llama_path), "max_length": MAX_LENGTH}
    ours = evaluate("mlx", {**model_args, "steer": str(csv)}, manager)
    assert_same(ours, lm_eval_steered(llama_path, pt, manager), evaluate("mlx", model_args, manager))


def test_a_sparsify_clamp_csv_equals_lm_eval_running_the_same_csv(llama_path, manager, tmp_path, monkeypatch):
    """lm-eval reads the CSV itself (its sparsify loader, SparseCoder.load_from_disk): the very same file."""
    pytest.importorskip("sparsify")
    pytest.importorskip("pandas")
    d = width(llama_path)
    w, b = decoder(4, d)
    write_sparsify(tmp_path / "sp" / "layers.0", w, b)
    csv = tmp_path / "steer.csv"
    csv.write_text(HEADER + "sparsify,clamp,sp,layers.0,9,6.0,,,,\n")
    monkeypatch.chdir(tmp_path)  # lm-eval reads sparse_model relative to the working directory
    ours = evaluate("mlx", {"pretrained": str(llama_path), "max_length": MAX_LENGTH, "steer": str(csv)}, manager)
    assert_same(ours, lm_eval_steered(llama_path, csv, manager))


def run_ll(lm, steering):
    from worker.score import loglikelihood

    from worker.steer import steered

    requests = [((1, 17, 33, 250), (9, 71)), ((5, 6, 7), (8,)), ((2, 3, 4, 5, 6, 7, 8), (9, 10, 11))]
    with steered(lm, steering):
        return np.array([x for x, _ in loglikelihood(lm, requests)])


def test_a_head_index_row_is_attn_head_with_the_feature_and_its_b_dec_clamp(llama_path, tmp_path):
    """head_index h at layers.L.self_attn steers head h's output (attn_head) with a head_dim feature; clamp about
    b_dec equals clamp to coefficient + b_dec·u written by hand (attn_head itself is proven in test_steer_sites)."""
    from worker.load import load

    lm = load(str(llama_path))
    w, b = decoder(5, 16)  # head_dim 16
    write_sparsify(tmp_path / "sp" / "layers.1.self_attn", w, b)
    csv = tmp_path / "h.csv"
    csv.write_text(HEADER + "sparsify,clamp,sp,layers.1.self_attn,3,2.5,2,,heads,\n")
    loaded = for_model(csv, lm.config)
    got = loaded.steering
    assert loaded.record["csv_rows"] == [{"line": 2, "description": "heads"}] and loaded.record["format"] == "lm-eval steered csv"
    u = w[3].astype(np.float64) / np.linalg.norm(w[3].astype(np.float64))
    np.save(tmp_path / "v.npy", w[3])
    spec = {"interventions": [{"layer": 1, "site": "attn_head", "head": 2, "op": "clamp", "alpha": 2.5 + float(b @ u), "vector": str(tmp_path / "v.npy")}]}
    want = for_model(spec, lm.config).steering
    assert got.interventions[0].model_dump() == want.interventions[0].model_dump()
    assert np.abs(run_ll(lm, got) - run_ll(lm, None)).max() > 1e-3


@pytest.mark.parametrize("layout", ["sae_lens", "sparsify", "goodfire"])
def test_a_spec_feature_is_the_decoder_row_in_each_layout(llama_path, tmp_path, layout):
    from safetensors.numpy import save_file

    from worker.load import load

    lm = load(str(llama_path))
    w, b = decoder(6, 64)
    if layout == "sae_lens":
        folder = write_sae_lens(tmp_path / "sae", w, b, "blocks.1.hook_resid_post")
    elif layout == "sparsify":
        folder = write_sparsify(tmp_path / "run" / "layers.1", w, b).parent  # a run's folder: picked by hookpoint
    else:
        folder = tmp_path / "gf.safetensors"
        save_file({"decoder_linear.weight": w.T.copy(), "decoder_linear.bias": b, "encoder_linear.weight": w.copy()}, str(folder))
    spec = {"interventions": [{"layer": 1, "alpha": 3.0, "vector": {"sae": str(folder), "feature": 4}}]}
    loaded = for_model(spec, lm.config)
    assert np.array_equal(loaded.steering.interventions[0].array(), w[4])
    assert loaded.record["vectors"][0]["layout"] == layout and loaded.record["vectors"][0]["feature"] == 4
    np.save(tmp_path / "v.npy", w[4])
    plain = for_model({"interventions": [{"layer": 1, "alpha": 3.0, "vector": str(tmp_path / "v.npy")}]}, lm.config).steering
    assert np.array_equal(run_ll(lm, loaded.steering), run_ll(lm, plain))


def test_sae_files_the_libraries_save_themselves_read_as_their_tensors(tmp_path):
    """The layouts above are the libraries' own: an SAE saved by sparsify and one saved by sae-lens read back
    as its W_dec and b_dec."""
    from driver.steering.saes import read_sae

    sparsify = pytest.importorskip("sparsify")
    coder = sparsify.SparseCoder(64, sparsify.SparseCoderConfig(num_latents=N_FEATURES, k=4), dtype=torch.float32)
    with torch.no_grad():
        coder.b_dec.normal_()
    coder.save_to_disk(tmp_path / "layers.1")
    sae = read_sae(tmp_path / "layers.1")
    assert np.array_equal(sae.decoder(), coder.W_dec.detach().numpy()) and np.array_equal(sae.b_dec, coder.b_dec.detach().numpy())
    assert sae.site == ("resid_post", 1)
    sae_lens = pytest.importorskip("sae_lens")
    lens = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=64, d_sae=N_FEATURES))
    lens.cfg.metadata.hook_name = "blocks.1.hook_mlp_out"
    with torch.no_grad():
        lens.W_dec.normal_()
        lens.b_dec.normal_()
    lens.save_model(tmp_path / "lens")
    sae = read_sae(tmp_path / "lens")
    assert np.array_equal(sae.decoder(), lens.W_dec.detach().numpy()) and sae.site == ("mlp_out", 1)


# --- bad input: one line each, before any worker ------------------------------------------------------------


def bad_csv(tmp_path: Path, body: str, header: str = HEADER) -> str:
    w, b = decoder(7, 64)
    if not (tmp_path / "sp").exists():
        write_sparsify(tmp_path / "sp" / "layers.1", w, b)
        write_sparsify(tmp_path / "sp" / "layers.0", w[:, :32].copy(), b[:32].copy())  # another width
        w[3, 5] = np.nan
        write_sparsify(tmp_path / "sp" / "layers.0.mlp", w, b)
    (tmp_path / "bad.csv").write_text(header + body)
    return str(tmp_path / "bad.csv")


@pytest.mark.parametrize("header, body, message", [
    ("loader,action,sparse_model,hookpoint,feature_idx,steering_coefficient\n", "", r"line 1: unknown column 'feature_idx' \(did you mean 'feature_index'\?"),
    (HEADER, "saelens,add,sp,layers.1,3,1.0,,,,\n", r"line 2: loader: 'saelens' is not a loader Orchard reads"),
    (HEADER, "sparsify,ablate,sp,layers.1,3,1.0,,,,\n", r"line 2: action: 'ablate' is not an action"),
    (HEADER, "sparsify,add,sp,layers.1,12,1.0,,,,\n", r"line 2: feature_index: .*feature 12 is past the SAE's 12 features \(use 0..11\)"),
    (HEADER, "sparsify,add,sp,layers.0,3,1.0,,,,\n", r"line 2: sparse_model: the SAE at .* is 32 wide \(d_in\) but the model.s hidden size is 64"),
    (HEADER, "sparsify,add,sp,layers.0.mlp,3,1.0,,,,\n", r"line 2: feature_index: .*feature 3.s decoder row holds 1 NaN/inf value"),
    (HEADER, "sparsify,add,sp,layers.1,3,1.0,,,,\nsparsify,clamp,sp,layers.1,4,1.0,,,,\n", r"line 3: hookpoint: steers the same place as line 2"),
    (HEADER, "sparsify,add,sp,blocks.1.resid,3,1.0,,,,\n", r"line 2: hookpoint: 'blocks.1.resid' is not a hook point"),
    (HEADER, "sparsify,add,sp,layers.1,3,big,,,,\n", r"line 2: steering_coefficient: 'big' is not a finite number"),
])  # fmt: skip
def test_bad_csv_files_are_one_line_refusals(llama_path, tmp_path, header, body, message):
    config = json.loads((llama_path / "config.json").read_text())
    with pytest.raises(SteeringError, match=message) as e:
        for_model(bad_csv(tmp_path, body, header), config)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / "bad.csv"))


def test_an_sae_of_another_site_or_a_pickle_is_refused(tmp_path):
    w, b = decoder(8, 64)
    folder = write_sae_lens(tmp_path / "sae", w, b, "blocks.2.hook_mlp_out")
    spec = {"interventions": [{"layer": 1, "site": "mlp_out", "vector": {"sae": str(folder), "feature": 0}}]}
    with pytest.raises(SteeringError, match=r"interventions\[0\]\.vector\.sae: .*reads blocks.2.hook_mlp_out \(mlp_out at layer 2\), but the intervention steers mlp_out at layer 1"):
        load_steering(spec, n_layers=4)
    ok = {"interventions": [{"layer": 3, "site": "resid_pre", "vector": {"sae": str(write_sae_lens(tmp_path / "r", w, b, "blocks.2.hook_resid_post")), "feature": 0}}]}
    assert load_steering(ok, n_layers=4).steering.interventions[0].layer == 3  # resid_pre 3 reads resid_post 2
    (tmp_path / "steer.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(SteeringError, match=r"steer.pt: a pickled steering file .*`driver steer convert .*steer.pt`"):
        load_steering(tmp_path / "steer.pt")


def test_driver_steer_convert_reads_lm_evals_pt_as_the_csv_it_came_from(llama_path, tmp_path):
    """The .pt given to lm-eval in the CSV test above, converted (torch.load weights_only=True), is the CSV's steering;
    a .pt holding code is refused by weights_only, in one line, with nothing written."""
    from click.testing import CliRunner

    from driver.cli import main

    config = json.loads((llama_path / "config.json").read_text())
    (w1, b1), (w2, b2) = decoder(1, 64), decoder(2, 64)
    write_sparsify(tmp_path / "sp" / "layers.1", w1, b1)
    write_sae_lens(tmp_path / "sl", w2, b2, "blocks.0.hook_attn_out")
    (tmp_path / "s.csv").write_text(HEADER + "sparsify,clamp,sp,layers.1,5,3.0,,,,\nsae_lens,add,sl,layers.0.self_attn,7,-2.0,,,,\n")
    torch.save({"layers.1": {"action": "clamp", "steering_vector": torch.tensor(w1[5]), "steering_coefficient": 3.0, "bias": torch.tensor(b1)},
                "layers.0.self_attn": {"action": "add", "steering_vector": torch.tensor(w2[7]), "steering_coefficient": -2.0}},
               tmp_path / "s.pt")  # fmt: skip
    result = CliRunner().invoke(main, ["steer", "convert", str(tmp_path / "s.pt"), "--out", str(tmp_path / "conv")])
    assert result.exit_code == 0, result.output
    converted = for_model(tmp_path / "conv" / "steer.yaml", config).steering.interventions
    from_csv = for_model(tmp_path / "s.csv", config).steering.interventions
    for a, b in zip(converted, from_csv, strict=True):
        assert a.model_dump(exclude={"alpha"}) == b.model_dump(exclude={"alpha"}) and abs(a.alpha - b.alpha) <= 1e-9

    class Code:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"layers.1": Code()}, tmp_path / "evil.pt")
    result = CliRunner().invoke(main, ["steer", "convert", str(tmp_path / "evil.pt")])
    assert result.exit_code == 1 and "not a plain steering file" in result.output and "ran" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "evil").exists()


# --- sweeps: a features axis --------------------------------------------------------------------------------


def test_a_sweep_over_sae_features_equals_plain_steered_runs_of_each_feature(ray_cluster, llama_path, tasks_dir, tmp_path):
    """vectors: {sae: RUN, features: [2, 5]} over layers 0 and 1 (a sparsify run: the layers.L folder of each layer)
    × alphas: every configuration equals a plain steered run of `vector: {sae, feature}`; an SAE of another width is
    refused in one line (exit 1, as every unusable file a sweep names) before any worker."""
    from test_sweep import assert_equals_plain_runs, site_study, sweep_cli

    from driver.sweep import report

    folder = tmp_path / "study"
    sweep = site_study(folder, llama_path, tasks_dir, "[resid_post]", {"unused.0": np.zeros(64, np.float32)})
    for layer in (0, 1):
        write_sparsify(folder / "run" / f"layers.{layer}", *decoder(10 + layer, 64))
    sweep.write_text(sweep.read_text().replace("  v: {file: v.safetensors, normalize: true}", "  feat: {sae: run, features: [2, 5]}"))
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    assert code == 0, output
    rows = report.read_csv(out / "results.csv")
    assert {(r["vector"], r["layer"], r["alpha"]) for r in rows if r["config"] != "baseline"} == {
        (f"feat-f{f}", layer, a) for f in (2, 5) for layer in (0, 1) for a in (-2.0, 2.0)}

    def spec_of(r: dict) -> dict:
        return {"layer": r["layer"], "alpha": r["alpha"], "vector": {"sae": "run", "feature": int(r["vector"].rpartition("-f")[2])}}

    diffs = assert_equals_plain_runs(rows, sweep, spec_of)
    assert len({round(d, 4) for d in diffs.values()}) == len(diffs)  # every feature, layer and alpha moved the score
    write_sparsify(folder / "narrow" / "layers.0", *decoder(3, 32))
    write_sparsify(folder / "narrow" / "layers.1", *decoder(3, 32))
    sweep.write_text(sweep.read_text().replace("{sae: run,", "{sae: narrow,"))
    code, output = sweep_cli(sweep, "--output", tmp_path / "out2")
    assert code == 1 and "32 wide (d_in) but the model's hidden size is 64" in output and len(output.strip().splitlines()) == 1, output


def test_driver_run_refuses_a_bad_csv_in_one_line_before_the_cluster(llama_path, tasks_dir, tmp_path):
    """`driver run --steer FILE.csv`: a feature past the SAE's width is one `Error:` line (exit 1) naming the CSV's
    line and column, before anything tries the (unreachable) cluster."""
    from click.testing import CliRunner

    from driver.cli import main

    csv = bad_csv(tmp_path, "sparsify,add,sp,layers.1,40,1.0,,,,\n")
    args = ["run", "--model", str(llama_path), "--tasks", "orchard_mc", "--include-path", str(tasks_dir), "--steer", csv,
            "--address", "127.0.0.1:1", "--output-path", str(tmp_path / "out")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert f"{csv}: line 2: feature_index:" in errors[0] and "feature 40 is past the SAE's 12 features" in errors[0]
    assert "127.0.0.1:1" not in result.output and not (tmp_path / "out").exists()


def test_a_sae_lens_head_sae_steers_its_own_head_only(llama_path, tmp_path):
    """A sae-lens SAE of one head's hook_z (hook_head_index 2, d_in = head_dim 16) gives attn_head layer 1 head 2 its
    feature; another head, or another layer, is refused in one line."""
    config = json.loads((llama_path / "config.json").read_text())
    w, b = decoder(9, 16)
    folder = write_sae_lens(tmp_path / "z", w, b, "blocks.1.attn.hook_z")
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg["metadata"]["hook_head_index"] = 2
    (folder / "cfg.json").write_text(json.dumps(cfg))

    def spec(head, layer=1):
        return {"interventions": [{"layer": layer, "site": "attn_head", "head": head, "vector": {"sae": str(folder), "feature": 1}}]}

    assert np.array_equal(for_model(spec(2), config).steering.interventions[0].array(), w[1])
    with pytest.raises(SteeringError, match=r"reads head 2 \(hook_head_index\) but the intervention steers head 3"):
        for_model(spec(3), config)
    with pytest.raises(SteeringError, match=r"reads blocks.1.attn.hook_z \(attn_head at layer 1\), but the intervention steers attn_head at layer 0"):
        for_model(spec(2, layer=0), config)
