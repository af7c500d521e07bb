"""Whole numbers as a user writes them (driver.checks.settings): ASCII digits only. Python's int() reads `1_0` as 10
and an Arabic-Indic digit as its value; every int option, model_arg and gen_kwarg refuses both, exit 2, one line,
before Ray (the CLI in-process)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from driver.checks import settings
from driver.cli import main

ODD = ["1_0", "\u0663", "1\u00a00", "\uff13"]  # underscore, Arabic-Indic three, no-break space, fullwidth three


@pytest.mark.parametrize("text", ODD)
def test_whole_numbers_take_ascii_digits_only(text):
    with pytest.raises(settings.SettingError, match="not a whole number"):
        settings.whole("--group-size", text, 1, "nodes")
    assert settings.integer(text) is None
    with pytest.raises(settings.SettingError):
        settings.limit(text)
    with pytest.raises(settings.SettingError):
        settings.number("--gen-kwargs temperature=", text, "the sampling temperature")


def test_numbers_written_plainly_still_read():
    assert [settings.whole("--batch-size", v, 1, "rows") for v in ("10", " 7 ", "2.0", 5, "+3")] == [10, 7, 2, 5, 3]
    assert settings.integer("-2") == -2 and settings.number("--x", "0.5", "w") == 0.5 and settings.limit("3") == 3


def _run(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.output


@pytest.mark.parametrize("text", ["1_0", "\u0663"])
@pytest.mark.parametrize("flag", [["--group-size"], ["--batch-size"], ["--threads"], ["--num-fewshot"], ["--max-length"],
                                  ["--limit"], ["--workers"], ["--gen-kwargs", "max_gen_toks="], ["--model-args", "batch_size="]])
def test_every_int_option_refuses_them_in_one_line_exit_2(llama_path, tasks_dir, flag, text):
    value = flag[1] + text if len(flag) > 1 else text
    code, output = _run("run", "--model", llama_path, "--tasks", "orchard_mc", "--include-path", tasks_dir, "--address",
                        "local", flag[0], value)  # fmt: skip
    assert code == 2, output
    assert "Traceback" not in output and text in output
    assert "Ray" not in output and "loading" not in output.lower()


def test_a_pipeline_of_a_family_whose_blocks_it_cannot_find_is_refused_before_ray():
    from driver.checks.errors import BadUsage
    from driver.checks.groups import check_split

    mamba = {"model_type": "mamba", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "state_size": 8,
             "num_hidden_layers": 4, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 4,
             "tie_word_embeddings": True}  # fmt: skip
    with pytest.raises(BadUsage, match="^a pipeline split cannot find the list of decoder blocks of mlx-lm's mamba model"):
        check_split(mamba, 2, "pipeline")
    check_split({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64,
                 "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 100}, 2, "pipeline")  # fmt: skip


@pytest.mark.parametrize("text", ["1_0", "\u0663", True])
def test_the_worker_count_itself_takes_ascii_digits_only(text):
    """cluster.parse_workers is what every path reads --workers / model_args workers= with (mlx-ray too)."""
    from cluster import ClusterError, parse_workers

    with pytest.raises(ClusterError, match="is not a number: pass a count such as 4"):
        parse_workers(text)
    assert parse_workers(" 3 ") == 3 and parse_workers(2) == 2 and parse_workers("ALL") == "all"


@pytest.mark.parametrize(("value", "says"), [("0", "0 is too small: give at least 1"), ("33", "33 is too large: give at most 32")])
def test_a_bounded_option_names_the_bound_it_breaks(value, says):
    code, output = _run("cluster", "up", "--nodes", value)  # refused while parsing: nothing starts
    assert code == 2 and says in output, output
