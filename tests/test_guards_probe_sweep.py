"""Probe cases of issue 27.8 / 29.4 that a sweep file, --gen-kwargs or the context window decide: each refused in
one line before any worker (or Ray) starts, nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file
from test_sweep import sweep_cli, write_study

from driver.checks import settings
from driver.cli import main

UNREACHABLE = ["--workers", "1", "--address", "127.0.0.1:1"]  # a refusal must come before anything reaches it


def _refused(sweep, out, *flags, code=1, where=UNREACHABLE) -> str:
    got, output = sweep_cli(sweep, *where, "--output", out, *flags)
    assert got == code, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in output and "127.0.0.1:1" not in output, output
    assert not out.exists()
    return errors[0]


@pytest.mark.parametrize("old, new, says", [
    ("max_gen_toks: 6}", "max_gen_toks: 6, temperature: true}", "temperature"),  # `true` was read as 1.0
    ("limit: 4", "limit: 1.5", "1.5 is not a whole number"),  # the CLI's --limit refuses it too
    ("limit: 4", "limit: 4\n  gen_kwargs: max_gen_toks=4,max_new_tokens=5", "name the same limit (new tokens at most) with different values"),
    ("limit: 4", "limit: 4\n  gen_kwargs: temprature=0.5", "unknown key 'temprature'"),
])  # fmt: skip
def test_sweep_values_the_cli_would_refuse_are_refused(llama_path, tasks_dir, tmp_path, old, new, says):
    sweep = write_study(tmp_path, llama_path, tasks_dir)
    assert old in sweep.read_text()
    sweep.write_text(sweep.read_text().replace(old, new))
    assert says in _refused(sweep, tmp_path / "out")


@pytest.mark.parametrize("ops", ["[clamp]", "[add, clamp]"])  # beside add, the zero vector is checked as add writes it
def test_clamp_of_a_zero_vector_names_clamp(llama_path, tasks_dir, tmp_path, ops):
    sweep = write_study(tmp_path, llama_path, tasks_dir)
    text = sweep.read_text().replace("normalize: true", "normalize: false").replace("layers: all", f"layers: all\n  ops: {ops}")
    sweep.write_text(text)
    save_file({f"resid_post.{i}": np.zeros(64, np.float32) for i in range(2)}, str(tmp_path / "v.safetensors"))
    line = _refused(sweep, tmp_path / "out")
    assert "has no direction for op clamp" in line and "ablate" not in line, line


def test_a_head_sweep_on_a_tensor_group_is_refused_before_workers(llama_path, tasks_dir, tmp_path):
    sweep = write_study(tmp_path, llama_path, tasks_dir)
    save_file({f"attn_head.{i}.0": np.ones(16, np.float32) for i in range(2)}, str(tmp_path / "h.safetensors"))
    text = sweep.read_text().replace("file: v.safetensors", "file: h.safetensors").replace("layers: all", "layers: all\n  sites: [attn_head]\n  heads: [0]")
    sweep.write_text(text)
    line = _refused(sweep, tmp_path / "out", "--group-size", "2", "--split", "tensor", code=2,
                    where=["--workers", "1", "--address", "local"])  # a local Ray would start only after the checks
    assert "attn_head steering on a tensor-split group" in line and "--split pipeline" in line, line


# --- max-token settings: aliases that disagree, a limit past the context window ----------------------------------


def test_max_token_aliases_that_disagree_are_refused_and_equal_ones_kept():
    with pytest.raises(settings.SettingError, match="max_gen_toks=4 and max_new_tokens=5: these name the same limit"):
        settings.gen_kwargs("max_gen_toks=4,max_new_tokens=5")
    assert settings.gen_kwargs("max_gen_toks=4,max_new_tokens=4") == {"max_gen_toks": 4, "max_new_tokens": 4}


@pytest.mark.parametrize("flag", [["--gen-kwargs", "max_gen_toks=1000000000"], ["--model-args", "max_gen_toks=64"],
                                  ["--gen-kwargs", "max_new_tokens=70", "--max-length", "64"]])  # fmt: skip
def test_a_max_gen_toks_past_the_context_window_is_refused_before_ray(llama_path, tasks_dir, tmp_path, flag):
    out = tmp_path / "out"
    window = ["--max-length", "64"] if "--max-length" not in flag else []
    result = CliRunner().invoke(main, ["run", "--model", str(llama_path), "--tasks", "orchard_gen", "--include-path",
                                       str(tasks_dir), *UNREACHABLE, "--output-path", str(out), *window, *flag])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "must be less than the model's context window (64 tokens)" in result.output, result.output
    assert "Traceback" not in result.output and "127.0.0.1:1" not in result.output and not out.exists()
