"""A task's own YAML, checked before Ray (issue 38.9): a task whose data file holds no rows was lm-eval's
`internal error (StopIteration)` after the model loaded, and `--max-length 12` with a task generating up to 16
tokens an internal error after 45 s. Each is now one line naming the task (exit 1 and 2), nothing started."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from driver.checks.datasets import check_datasets
from driver.checks.errors import BadUsage, Refused
from driver.checks.model import check_generation_room
from driver.cli import main

LLAMA = {"model_type": "llama", "max_position_embeddings": 64}


def _task(folder, name: str, rows: int, max_gen_toks: int | None = 16, split: str = "test"):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}?", "a": "yes"}) + "\n" for i in range(rows)) + ("\n" if not rows else ""))
    kwargs = f"\n  max_gen_toks: {max_gen_toks}" if max_gen_toks is not None else ""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    {split}: {data}\noutput_type: generate_until\n"
        f"test_split: {split}\ndoc_to_text: '{{{{q}}}}'\ndoc_to_target: '{{{{a}}}}'\ngeneration_kwargs:\n  until: ['.']{kwargs}\n"
        "metric_list:\n  - metric: exact_match\n")  # fmt: skip
    return data


def test_a_task_whose_data_file_holds_no_rows_is_refused(tmp_path):
    data = _task(tmp_path, "probe_empty", rows=0)
    _task(tmp_path, "probe_full", rows=3)
    check_datasets(["probe_full"], str(tmp_path))
    with pytest.raises(Refused, match=rf"^--tasks probe_empty: its test data file {data} holds no rows: fill it"):
        check_datasets(["probe_full", "probe_empty"], str(tmp_path))


@pytest.mark.parametrize("max_length, yaml_toks, gen_kwargs, says", [
    (12, 16, None, "--tasks probe_gen generates up to 16 tokens (its max_gen_toks), which must be less than the context window (12 tokens)"),
    (12, None, None, "--tasks probe_gen generates up to 256 tokens (the default max_gen_toks)"),
    (None, 64, None, "--tasks probe_gen generates up to 64 tokens (its max_gen_toks), which must be less than the context window (64 tokens)"),
    (12, 16, {"max_gen_toks": 4}, None),  # --gen-kwargs replaces the task's
    (32, 16, None, None),
])  # fmt: skip
def test_a_task_s_max_gen_toks_must_leave_room_in_the_window(tmp_path, max_length, yaml_toks, gen_kwargs, says):
    _task(tmp_path, "probe_gen", rows=2, max_gen_toks=yaml_toks)
    check = lambda: check_generation_room(LLAMA, max_length, {}, gen_kwargs, (["probe_gen"], str(tmp_path)))  # noqa: E731
    if says is None:
        check()
    else:
        with pytest.raises(BadUsage, match="^" + re.escape(says)):
            check()


@pytest.mark.parametrize("rows, flags, code, says", [
    (0, [], 1, "Error: --tasks probe_cli: its test data file"),
    (2, ["--max-length", "12"], 2, "Error: --tasks probe_cli generates up to 16 tokens"),
])  # fmt: skip
def test_the_run_command_says_it_in_one_line_before_ray(llama_path, tmp_path, rows, flags, code, says):
    _task(tmp_path, "probe_cli", rows=rows)
    result = CliRunner().invoke(main, ["run", "--model", str(llama_path), "--tasks", "probe_cli", "--include-path", str(tmp_path),
                                       "--address", "local", "--workers", "1", "--output-path", str(tmp_path / "out"), *flags])  # fmt: skip
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code and len(lines) == 1 and lines[0].startswith(says), result.output
    assert not (tmp_path / "out").exists()
