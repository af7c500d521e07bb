"""Probe cases of issues 27.8 / 29.2-29.5 in steering specs (no workers): directions of huge vectors, the model's
dtype, a head's key, negative heads, what a mis-named .npy really is, the spec file named in shape refusals,
YAML merge keys."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from driver.checks.errors import Refused
from driver.checks.model import check_steering
from driver.steering.spec import SteeringError, for_model
from driver.steering.vectors import parse_layers
from worker.spec import Intervention
from worker.steer import Ablate, Clamp

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 4, "num_attention_heads": 2}
HUGE = np.array([1e30, -1e30, 1e30, 1e30], np.float32)  # finite in float32; its sum of squares is not
UNIT = np.array([0.5, -0.5, 0.5, 0.5], np.float32)


def spec(folder: Path, **iv) -> Path:
    path = folder / "s.json"
    path.write_text(json.dumps({"interventions": [{"layer": 0, "vector": "v.npy", **iv}]}))
    return path


# --- 27.8 silent wrong: entries of 1e30 normalize and ablate along their true direction ---------------------------


def test_normalize_of_huge_entries_gives_the_unit_vector():
    np.testing.assert_allclose(Intervention(layer=0, vector=tuple(HUGE.tolist()), normalize=True).array(), UNIT, rtol=1e-6)


@pytest.mark.parametrize("op", [Ablate, Clamp])
def test_ablate_and_clamp_keep_the_direction_of_huge_entries(op):
    np.testing.assert_allclose(np.array(op(HUGE).vector), UNIT, rtol=1e-6)


def test_a_spec_of_huge_entries_normalized_is_accepted_and_steers_along_them(tmp_path):
    np.save(tmp_path / "v.npy", HUGE)
    run = for_model(spec(tmp_path, normalize=True, alpha=2.0), CONFIG)
    np.testing.assert_allclose(run.steering.interventions[0].array(), UNIT, rtol=1e-6)


# --- 27.8 / 29.4: values checked in the dtype the model computes in (model_args dtype), before any worker ----------


def test_the_model_args_dtype_decides_the_overflow_check(tmp_path):
    np.save(tmp_path / "v.npy", np.full(4, 100.0, np.float32))
    path = spec(tmp_path, alpha=1000.0)  # alpha*v = 1e5: finite in float32, inf in float16 (largest 65504)
    assert check_steering(str(path), CONFIG) is not None
    with pytest.raises(Refused, match="alpha\\*vector reaches 1e\\+05, which is inf in float16"):
        check_steering(str(path), CONFIG, "float16")


def test_mlx_refuses_float16_overflow_before_loading_the_model(llama_path, tmp_path):
    from driver.lm.mlx import MLXLM

    hidden = json.loads((llama_path / "config.json").read_text())["hidden_size"]
    np.save(tmp_path / "v.npy", np.full(hidden, 100.0, np.float32))
    with pytest.raises(ValueError, match="inf in float16"):
        MLXLM(pretrained=str(llama_path), dtype="float16", steer=str(spec(tmp_path, alpha=1000.0)))


def test_huge_entries_are_refused_for_a_float16_model_unless_only_their_direction_enters(tmp_path):
    np.save(tmp_path / "v.npy", HUGE)
    with pytest.raises(SteeringError, match="inf in float16"):
        for_model(spec(tmp_path), CONFIG, "float16")
    for_model(spec(tmp_path, normalize=True), CONFIG, "float16")  # u = v/|v| is what the model sees
    for_model(spec(tmp_path, op="ablate"), CONFIG, "float16")


# --- 29.2 / accepted wrongly: a head's vector is its own; negative heads refused everywhere ------------------------


def test_a_key_naming_another_head_is_refused(tmp_path):
    save_file({"attn_head.0.1": np.ones(2, np.float32)}, str(tmp_path / "h.safetensors"))
    ref = {"file": "h.safetensors", "key": "attn_head.0.1"}
    with pytest.raises(SteeringError, match=r"key 'attn_head.0.1' is the vector of head 1, but this intervention steers head 0: give key 'attn_head.0.0', or head: 1"):
        for_model({"interventions": [{"layer": 0, "site": "attn_head", "head": 0, "vector": ref}]}, CONFIG, base_dir=tmp_path)
    for_model({"interventions": [{"layer": 0, "site": "attn_head", "head": 1, "vector": ref}]}, CONFIG, base_dir=tmp_path)


def test_negative_heads_are_refused_by_vectors_heads_and_specs_alike(tmp_path):
    with pytest.raises(ValueError, match="head -1: heads are numbered from 0 and a negative head does not count from the end"):
        parse_layers("0,-1", 8, "head")
    assert parse_layers("-1", 4) == [3]  # layers still count from the end
    save_file({"attn_head.0.1": np.ones(2, np.float32)}, str(tmp_path / "h.safetensors"))
    with pytest.raises(SteeringError, match="a negative head does not count from the end"):
        for_model({"interventions": [{"layer": 0, "site": "attn_head", "head": -1, "vector": {"file": "h.safetensors"}}]},
                  CONFIG, base_dir=tmp_path)  # fmt: skip


# --- 29.5: a file named .npy said for what it is; shape refusals name the spec file --------------------------------


@pytest.mark.parametrize("write, said", [
    (lambda p: save_file({"v": np.ones(4, np.float32)}, str(p)), "is a safetensors file, not a .npy array: rename it to .safetensors"),
    (lambda p: p.write_text("1.0 2.0 3.0 4.0\n"), "is a text file, not a .npy array"),
    (lambda p: p.write_bytes(pickle.dumps([1.0, 2.0, 3.0, 4.0])), "is a pickle, which Orchard never loads"),
])  # fmt: skip
def test_a_misnamed_npy_is_said_for_what_it_is(tmp_path, write, said):
    write(tmp_path / "v.npy")
    with pytest.raises(SteeringError, match=said):
        for_model(spec(tmp_path), CONFIG)


def test_a_shape_refusal_names_the_spec_file(tmp_path):
    np.save(tmp_path / "v.npy", np.ones(3, np.float32))  # the model's hidden size is 4
    path = spec(tmp_path)
    with pytest.raises(SteeringError) as e:
        for_model(str(path), CONFIG)
    assert str(path) in str(e.value) and "3" in str(e.value)


def test_a_yaml_merge_key_is_not_called_malformed(tmp_path):
    np.save(tmp_path / "v.npy", np.ones(4, np.float32))
    (tmp_path / "s.yaml").write_text("interventions:\n  - &b {vector: v.npy, alpha: 2, layer: 0}\n  - {<<: *b, layer: 1, alpha: 3}\n")
    run = for_model(str(tmp_path / "s.yaml"), CONFIG)
    assert [(i.layer, i.alpha) for i in run.steering.interventions] == [(0, 2.0), (1, 3.0)]
