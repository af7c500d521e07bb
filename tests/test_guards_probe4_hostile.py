"""What the hostile probe of issue 38.9 found in SAE folders, lm-eval CSVs and YAML keys, each refused in one line
(or read right) before any worker starts:

- a sae-lens folder without cfg.json (it names the SAE's site and architecture) was accepted at any layer and
  site, and a JumpReLU one encoded as a plain ReLU: refused; a cfg.json naming no architecture reads a threshold
  tensor as JumpReLU; an all-NaN threshold is refused when the encoder is read, not after the capture;
- a top-K of features that never fire (mean activation 0) was features 0, 1, 2: refused, saying so;
- a bfloat16 SAE (as sae-lens saves one) was "bfloat16 not understood": read, widened exactly;
- a steered CSV with only its header ran unsteered: refused; `feature_index` `1_0` and `٧` read as 10 and 7:
  refused as the flags refuse them; a head index or width the model refuses is named by the CSV's line and column;
- YAML keys `1:` and `true:` were "key True is given twice": said as two keys read as one."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from driver.steering.encoders import ranked, read_encoder
from driver.steering.lmeval_csv import read_csv
from driver.steering.saes import SaeError, read_sae
from driver.steering.spec import SteeringError, for_model
from driver.steering.userfiles import load_yaml, yaml_problem

D_IN, D_SAE = 8, 6
CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": D_IN, "num_attention_heads": 2}


def _sae_lens(folder, cfg: dict | None, threshold=None, dtype=np.float32):
    rng = np.random.default_rng(0)
    t = {"W_enc": rng.standard_normal((D_IN, D_SAE)), "b_enc": rng.standard_normal(D_SAE), "W_dec": rng.standard_normal((D_SAE, D_IN)),
         "b_dec": rng.standard_normal(D_IN)}  # fmt: skip
    if threshold is not None:
        t["threshold"] = threshold
    t = {k: np.asarray(v, dtype=np.float32) for k, v in t.items()}
    folder.mkdir(parents=True)
    save_file(t, str(folder / "sae_weights.safetensors"))
    if cfg is not None:
        (folder / "cfg.json").write_text(json.dumps({"d_in": D_IN, "d_sae": D_SAE, "metadata": {"hook_name": "blocks.1.hook_resid_post"}} | cfg))
    return t


def test_a_sae_lens_folder_without_cfg_json_is_refused(tmp_path):
    _sae_lens(tmp_path / "s", None, threshold=np.full(D_SAE, 0.5))
    with pytest.raises(SaeError, match=r"s: no cfg.json beside sae_weights.safetensors \(sae-lens saves one: the SAE's hook_name"):
        read_sae(tmp_path / "s")
    spec = {"interventions": [{"layer": 3, "site": "mlp_out", "vector": {"sae": "s", "feature": 1}}]}
    with pytest.raises(SteeringError, match="no cfg.json"):
        for_model(spec, CONFIG, base_dir=tmp_path)  # at any site: refused, not steered with a guess


def test_a_threshold_tensor_without_an_architecture_is_jumprelu(tmp_path):
    threshold = np.full(D_SAE, 1.5, np.float32)
    t = _sae_lens(tmp_path / "s", {}, threshold=threshold)
    encoder = read_encoder(read_sae(tmp_path / "s"))
    assert encoder.activation == "jumprelu"
    x = np.random.default_rng(1).standard_normal((5, D_IN)).astype(np.float32)
    pre = (x - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
    assert np.allclose(encoder.activations(x, 0, D_SAE), np.where(pre > threshold, pre, 0), atol=1e-5)
    assert (pre > 0).sum() > (pre > threshold).sum()  # a plain ReLU would have differed
    _sae_lens(tmp_path / "plain", {})
    assert read_encoder(read_sae(tmp_path / "plain")).activation == "relu"


def test_an_all_nan_threshold_is_refused_when_the_encoder_is_read(tmp_path):
    _sae_lens(tmp_path / "s", {"architecture": "jumprelu"}, threshold=np.full(D_SAE, np.nan))
    with pytest.raises(SaeError, match=r"threshold holds NaN/inf values \(features 0..5\); this SAE file is damaged"):
        read_encoder(read_sae(tmp_path / "s"))


def test_a_top_k_of_features_that_never_fire_is_refused():
    with pytest.raises(SaeError, match=r"^no feature of vectors.f's SAE is active on the prompts \(mean activation > 0\), fewer than top: 3"):
        ranked(np.zeros(6), 3, "vectors.f's SAE")
    with pytest.raises(SaeError, match=r"^only 2 feature\(s\) of the SAE are active on the prompts"):
        ranked(np.array([0.0, 0.5, 0.0, 2.0]), 3)
    assert ranked(np.array([0.0, 0.5, 0.1, 2.0]), 3) == [(3, 2.0), (1, 0.5), (2, 0.1)]


def test_a_bfloat16_sae_reads_as_its_float32_values(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    t = _sae_lens(tmp_path / "f32", {"architecture": "standard"})
    halves = {k: torch.tensor(v).to(torch.bfloat16) for k, v in t.items()}
    (tmp_path / "bf16").mkdir()
    save_torch(halves, str(tmp_path / "bf16" / "sae_weights.safetensors"))
    (tmp_path / "bf16" / "cfg.json").write_text((tmp_path / "f32" / "cfg.json").read_text())
    sae = read_sae(tmp_path / "bf16")
    want = {k: v.float().numpy() for k, v in halves.items()}
    assert np.array_equal(sae.feature(4), want["W_dec"][4]) and np.array_equal(sae.b_dec, want["b_dec"])
    x = np.random.default_rng(1).standard_normal((3, D_IN)).astype(np.float32)
    pre = (x - want["b_dec"]) @ want["W_enc"] + want["b_enc"]
    assert np.allclose(read_encoder(sae).activations(x, 0, D_SAE), np.maximum(pre, 0), atol=1e-5)


HEADER = "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description\n"


def test_a_csv_with_only_its_header_is_refused(tmp_path):
    (tmp_path / "s.csv").write_text(HEADER)
    with pytest.raises(SteeringError, match=r"s.csv: has a header but no rows: add one row per feature to steer$"):
        read_csv(tmp_path / "s.csv")


@pytest.mark.parametrize("text", ["1_0", "\u0667", "１", "1e400"])
def test_a_feature_index_takes_ascii_digits_only(tmp_path, text):
    (tmp_path / "s.csv").write_text(HEADER + f"sparsify,add,saes,layers.1,{text},2.0,,,\n")
    with pytest.raises(SteeringError, match=rf"s.csv: line 2: feature_index: {re.escape(repr(text))} is not a whole number of 0 or more"):
        read_csv(tmp_path / "s.csv")


def _sparsify(folder, width: int):
    folder.mkdir(parents=True)
    save_file({"W_dec": np.ones((4, width), np.float32), "b_dec": np.zeros(width, np.float32)}, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text("{}")


@pytest.mark.parametrize("head, width, says", [
    (5, 4, "line 3: head_index: 5 is out of range for a model with 2 attention heads (use 0..1)"),
    (1, 6, "line 3: feature_index: has 6 values but attn_head takes head_dim = 4 values"),
])  # fmt: skip
def test_a_head_the_model_refuses_is_named_by_the_csv_s_line_and_column(tmp_path, head, width, says):
    _sparsify(tmp_path / "saes" / "layers.1.self_attn", 4)
    _sparsify(tmp_path / "wide" / "layers.1.self_attn", width)
    (tmp_path / "s.csv").write_text(HEADER + "sparsify,add,saes,layers.1.self_attn,1,1.0,0,,\n"
                                    f"sparsify,add,{'wide' if width != 4 else 'saes'},layers.1.self_attn,3,2.0,{head},,\n")  # fmt: skip
    with pytest.raises(SteeringError, match=re.escape(f"s.csv: {says}")):
        for_model(tmp_path / "s.csv", CONFIG, base_dir=tmp_path)


def test_yaml_keys_1_and_true_are_said_as_two_keys_read_as_one():
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml("vectors:\n  v:\n    layers:\n      1: a.npy\n      true: b.npy\n")
    assert yaml_problem(e.value) == "keys 1 (line 4) and true (line 5) are one key once read (true is 1, false is 0): keep one"
    with pytest.raises(yaml.YAMLError, match=r"key 'a' is given twice \(lines 1 and 2\)"):
        load_yaml("a: 1\na: 2\n")


def test_a_file_refused_for_its_own_text_imports_no_mlx_lm_transformers_or_torch(tmp_path):
    """Refusals of spec and CSV files took 5-14 s: building the model's blocks (for its sites) imports mlx-lm, so
    transformers, so PyTorch where installed (sae-lens brings it); a file refused for its text never needs them."""
    import subprocess
    import sys

    (tmp_path / "s.csv").write_text(HEADER)
    (tmp_path / "s.yaml").write_text("interventions:\n  - {layer: 1, vector: v.npy, alpah: 2}\n")
    code = ("import sys\nfrom driver.steering.spec import SteeringError, for_model\n"
            f"for name in ('s.csv', 's.yaml'):\n    try:\n        for_model({str(tmp_path)!r} + '/' + name, {CONFIG!r})\n"
            "    except SteeringError as e:\n        print(str(e).split(': ', 1)[1][:20])\n"
            "print(sorted(m for m in ('mlx_lm', 'transformers', 'torch') if m in sys.modules))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240).stdout.splitlines()
    assert out == ["has a header but no ", "interventions[0].alp", "[]"], out
