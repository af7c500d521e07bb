"""Probe cases of issues 27.9 / 29.4 for `driver vectors` and --seed, all refused in one line, exit 2, before Ray
(the CLI in-process, `--address 127.0.0.1:1`: a refusal must come before anything reaches it), nothing written:
a position where the pairs' texts agree (--position 0 reads the BOS token of both sides: zero vectors), an --out
not named .safetensors, and whole numbers as Python's int() reads them (1_0, an Arabic-Indic digit)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from driver.cli import main
from driver.lm.evaluation import parse_seeds
from driver.steering.vectors import PairsError, check_pairs, head_encoder, read_pairs

PAIRS = [{"positive": "Once upon a time the dog was happy", "negative": "Once upon a time the dog was sad"},
         {"positive": "The sun was warm", "negative": "The rain was cold"}]  # fmt: skip


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


def _vectors(stories_path, pairs, *flags, out=None):
    out = out or pairs.parent / "v.safetensors"
    result = CliRunner().invoke(main, ["vectors", "--model", str(stories_path), "--pairs", str(pairs), "--out", str(out),
                                       "--workers", "1", "--address", "127.0.0.1:1", *map(str, flags)])  # fmt: skip
    assert "Traceback" not in result.output and "127.0.0.1:1" not in result.output, result.output
    assert not out.exists() and not (pairs.parent / "cache").exists()
    return result.exit_code, result.output


@pytest.mark.parametrize("position", ["0", "1"])
def test_a_position_where_every_pair_agrees_is_refused_before_ray(stories_path, pairs, position):
    # "Once upon..." / "The ..." each side of a pair starts alike: BOS at 0, the same first word at 1
    code, output = _vectors(stories_path, pairs, "--position", position)
    assert code == 1 and f"agree on every token up to position {position}" in output and "--position last" in output, output


def test_the_agreement_is_checked_on_the_tokens_the_capture_reads(stories_path, pairs):
    encode = head_encoder(stories_path)
    read = read_pairs(pairs)
    check_pairs(pairs, read, encode, "mean-diff", -1, 512)  # the last tokens differ
    check_pairs(pairs, read, encode, "mean-diff", 3, 512)  # "The sun was" / "The rain was": differ by token 2
    with pytest.raises(PairsError, match="every pair agree on every token up to position 1"):
        check_pairs(pairs, read, encode, "mean-diff", 1, 512)


@pytest.mark.parametrize("name", ["x.npy", "x", "x.json"])
def test_out_must_be_named_safetensors(stories_path, pairs, name):
    code, output = _vectors(stories_path, pairs, out=pairs.parent / name)
    assert code == 2 and "driver vectors writes a safetensors file: give a name ending in .safetensors" in output, output


@pytest.mark.parametrize("flag", ["--layers", "--heads", "--position"])
@pytest.mark.parametrize("text", ["1_0", "\u0663"])
def test_layers_heads_and_position_take_ascii_digits_only(stories_path, pairs, flag, text):
    extra = ["--site", "attn_head"] if flag == "--heads" else []
    code, output = _vectors(stories_path, pairs, flag, text, *extra)
    assert code == 2 and f"{flag} {text}" in output and "bad " in output, output


@pytest.mark.parametrize("text", ["1_0", "\u0663", "0,1234,1_0,1234", "-1", "4294967296"])
def test_seed_takes_ascii_digits_in_numpy_s_range(text):
    import click

    with pytest.raises(click.BadParameter):
        parse_seeds(text)
    assert parse_seeds(" 8 ")["torch_random_seed"] == 8 and parse_seeds("0,None,3,4")["numpy_random_seed"] is None


def test_run_refuses_a_bad_seed_in_one_line_exit_2(llama_path, tasks_dir, tmp_path):
    result = CliRunner().invoke(main, ["run", "--model", str(llama_path), "--tasks", "orchard_mc", "--include-path",
                                       str(tasks_dir), "--address", "127.0.0.1:1", "--output-path", str(tmp_path / "o"),
                                       "--seed", "1_0"])  # fmt: skip
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output, result.output
