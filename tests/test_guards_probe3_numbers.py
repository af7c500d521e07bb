"""Whole numbers as a user writes them, the last places that read them with str.isdigit() (issue 27.9: ASCII digits
only), and a grouping asked for by a sweep file refused as the file's other values are (named, exit 1):

- `--address HOST:PORT`: '٦٣٧٩' was read as port 6379 and '²' was an internal error (str.isdigit passes both);
- a safetensors key `attn_head.L.²`: an internal error where a key is not a head's;
- `--heads x` suggested '-1', which heads refuse."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from cluster.connect import AddressError, check_syntax
from driver.cli import main
from driver.steering.spec import SteeringError, for_model
from driver.steering.vectors import parse_layers

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 4, "num_attention_heads": 2}


@pytest.mark.parametrize("port", ["\u0666\u0663\u0667\u0669", "\u00b2", "6_379", "+6379", "６３７９"])
def test_a_port_takes_ascii_digits_only(port):
    with pytest.raises(AddressError, match="is not a Ray address: use auto, local or HOST:PORT"):
        check_syntax(f"127.0.0.1:{port}")
    check_syntax("127.0.0.1:6379")


@pytest.mark.parametrize("port", ["\u0666\u0663\u0667\u0669", "\u00b2"])
def test_a_command_refuses_such_a_port_in_one_line_exit_2(port):
    result = CliRunner().invoke(main, ["nodes", "--address", f"127.0.0.1:{port}"])
    assert result.exit_code == 2 and result.output.startswith(f"Error: --address '127.0.0.1:{port}' is not a Ray address")


def test_a_key_with_other_digits_is_not_an_internal_error(tmp_path):
    save_file({"attn_head.0.\u00b2": np.ones(2, np.float32)}, str(tmp_path / "h.safetensors"))
    ref = {"file": "h.safetensors", "key": "attn_head.0.\u00b2"}
    for_model({"interventions": [{"layer": 0, "site": "attn_head", "head": 1, "vector": ref}]}, CONFIG, base_dir=tmp_path)
    with pytest.raises(SteeringError, match=r"no tensor 'attn_head.0.1' in .* \(it has: attn_head.0.\u00b2\)"):  # listed, sorted
        for_model({"interventions": [{"layer": 0, "site": "attn_head", "head": 1, "vector": {"file": "h.safetensors"}}]},
                  CONFIG, base_dir=tmp_path)  # fmt: skip


def test_a_bad_head_is_not_told_to_count_from_the_end():
    with pytest.raises(ValueError, match=r"use 'all' or integers like 0,3$"):
        parse_layers("x", 8, "head")
    with pytest.raises(ValueError, match=r"use 'all' or integers like 2,3,4 or -1$"):
        parse_layers("x", 8)


def _sweep(folder, model, extra: str = "", grid: str = "") -> str:
    np.save(folder / "v.npy", np.ones(64, np.float32))
    (folder / "p.jsonl").write_text('{"prompt": "The dog was"}\n')
    text = (f"model: {{pretrained: {model}, max_length: 64{extra}}}\nvectors:\n  v: {{layers: {{0: v.npy}}}}\n"
            f"grid: {{layers: [0], alphas: [2.0]{grid}}}\nprompts:\n  - {{file: p.jsonl, max_gen_toks: 4}}\n")  # fmt: skip
    (folder / "sweep.yaml").write_text(text)
    return str(folder / "sweep.yaml")


@pytest.mark.parametrize("extra, says", [
    (", group_size: 6", "model: group size 6 is larger than the model's 5 layers"),
    (", group_size: 3, split: tensor", "model: the model's 8 attention heads do not divide by group size 3: use a group size "
                                       "that divides 8, or split: pipeline (group_size 3, split tensor)"),
])  # fmt: skip
def test_a_grouping_the_sweep_file_asks_for_is_refused_naming_the_file(stories_path, tmp_path, extra, says):
    path = _sweep(tmp_path, stories_path, extra)
    result = CliRunner().invoke(main, ["sweep", path, "--workers", "1", "--address", "local", "--output", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {path}: {says}") and result.output.count("\n") == 1, result.output


def test_the_same_grouping_from_a_flag_is_a_usage_error(stories_path, tmp_path):
    path = _sweep(tmp_path, stories_path)
    result = CliRunner().invoke(main, ["sweep", path, "--workers", "1", "--address", "local", "--group-size", "6",
                                       "--output", str(tmp_path / "o")])  # fmt: skip
    assert result.exit_code == 2 and result.output.startswith("Error: group size 6 is larger than the model's 5 layers")
