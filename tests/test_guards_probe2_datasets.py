"""A task whose dataset is not on this machine (issue 27, a missing dataset): refused before Ray in one line that
names the task and its dataset, with no Hub retries, the fix fitting the case (only the offline variables that
are set; the MMLU cache only for an MMLU task; the network when nothing is set and the Hub does not answer).
Datasets on disk (the datasets cache, a task's own files) and a reachable Hub pass. The CLI in-process, lm-eval's
own arc_easy and mmlu YAMLs; the Hub stands in as a loopback port (HF_ENDPOINT), never the network."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from driver.checks.datasets import check_datasets, missing_datasets
from driver.checks.errors import Refused
from driver.cli import main


@pytest.fixture()
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the block ends: a connection is refused at once


def _run(llama_path, tmp_path, tasks: str):
    result = CliRunner().invoke(main, ["run", "--model", str(llama_path), "--tasks", tasks, "--address", "local",
                                       "--workers", "1", "--output-path", str(tmp_path / "out")])  # fmt: skip
    return result.exit_code, result.output


def test_a_missing_dataset_offline_is_one_line_before_ray(llama_path, empty_cache, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, output = _run(llama_path, empty_cache, "arc_easy")
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, output
    line = lines[0]
    assert line.startswith("Error: --tasks: task arc_easy's dataset allenai/ai2_arc (ARC-Easy) is not in the datasets cache")
    assert "unset HF_DATASETS_OFFLINE)" in line and "HF_HUB_OFFLINE" not in line and "mmlu" not in line, line
    assert not (empty_cache / "out").exists()  # nothing ran: no Ray, no results folder


def test_unreachable_hub_with_nothing_set_names_the_network(llama_path, empty_cache, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(Refused) as e:
        check_datasets(["arc_easy"], None)
    said = str(e.value)
    assert "cannot reach the Hugging Face Hub" in said and "connect this machine" in said and "unset" not in said, said


def test_an_mmlu_task_offers_the_mmlu_cache(empty_cache, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Refused) as e:
        check_datasets(["mmlu_anatomy"], None)
    assert "cais/mmlu (anatomy)" in str(e.value) and "cais___mmlu" in str(e.value)
    assert "unset HF_DATASETS_OFFLINE and HF_HUB_OFFLINE" in str(e.value)


def test_a_group_is_followed_to_its_tasks_datasets(empty_cache):
    missing = missing_datasets(["mmlu"], None)
    assert {p for _, p, _ in missing} == {"cais/mmlu"} and len(missing) == 57  # every subject's configuration


def test_datasets_on_disk_pass(empty_cache, monkeypatch, tasks_dir):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (empty_cache / "datasets" / "allenai___ai2_arc" / "ARC-Easy").mkdir(parents=True)
    check_datasets(["arc_easy"], None)  # prepared in the datasets cache
    (empty_cache / "hub" / "datasets--allenai--ai2_arc").mkdir(parents=True)
    check_datasets(["arc_challenge"], None)  # its files in the Hub cache
    check_datasets(["orchard_mc"], str(tasks_dir))  # the task's own files (data_files)
    assert missing_datasets(["arc_easy", "orchard_*"], str(tasks_dir)) == []


def test_a_reachable_hub_passes(empty_cache, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        check_datasets(["arc_easy"], None)  # lm-eval downloads it


def test_a_sweep_names_its_file_and_the_missing_dataset(empty_cache, monkeypatch):
    from driver.sweep.plan import SweepError, _check_datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SweepError, match=r"^s\.yaml: tasks\.names: task arc_easy's dataset allenai/ai2_arc \(ARC-Easy\) is not"):
        _check_datasets(["arc_easy"], None, "s.yaml")
