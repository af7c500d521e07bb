"""The tasks' datasets, checked before Ray: each one is on disk (a task's own files, the datasets cache, the Hub
cache) or the Hugging Face Hub can be reached. Else one line naming the task, its dataset and the fix for this
case, in about a second, where lm-eval would retry the Hub for a minute after Ray started.

A task's dataset is read off its YAML (includes merged; groups and tags followed to their tasks) with the task
index's fast scan (driver.checks.tasks). What the YAMLs do not say (a task `class`, a `custom_dataset`) is left
to lm-eval, which has the last word; so is every dataset when the Hub answers.
"""

from __future__ import annotations

import fnmatch
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from driver.checks.errors import Refused
from driver.checks.taskdata import check_task_files
from driver.checks.tasks import _read_task_yaml, default_task_files, scan_task_files

OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
REACH_S = 3.0  # seconds to wait for the Hub's TCP port before calling it unreachable
_LOCAL_KWARGS = ("data_files", "data_dir")  # dataset_kwargs naming the task's own files


def offline_set() -> list[str]:
    """The offline variables that are set (to anything but 0 / empty)."""
    return [name for name in OFFLINE if os.environ.get(name, "").strip() not in ("", "0")]


def cache_hint(error: object = "") -> str:
    """Where a missing dataset would be found: the datasets cache (a prepared MMLU cache only for an MMLU task)."""
    where = "put the dataset in the datasets cache (HF_DATASETS_CACHE"
    return where + ("; a prepared cais___mmlu folder: docs/cluster.md)" if "mmlu" in str(error).lower() else ")")


def dataset_hint(error: object = "") -> str:
    """What would let a task's dataset load, for this case: the datasets cache (cache_hint), and downloads:
    unsetting only the offline variables that are set, else the network."""
    offline = offline_set()
    if offline:
        return f"{cache_hint(error)}, or allow downloads (unset {' and '.join(offline)})"
    return f"{cache_hint(error)}, or let this machine reach the Hugging Face Hub (it could not)"


def _hf_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface").expanduser()


def datasets_cache() -> Path:
    """Where `datasets` keeps prepared datasets (its HF_DATASETS_CACHE rule)."""
    return Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets").expanduser()


def cached(path: str, name: str | None) -> bool:
    """Whether the Hub dataset `path` (its config `name`) is prepared in the datasets cache, or its files are in
    the Hub cache (which `datasets` reads offline too)."""
    ds = datasets_cache() / path.replace("/", "___")
    if ds.is_dir() and (name is None or any(p.name == name or p.name.startswith(f"{name}-") for p in ds.iterdir())):
        return True
    hub = Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub").expanduser()
    return (hub / f"datasets--{path.replace('/', '--')}").is_dir()


def hub_reachable() -> bool:
    """Whether the Hub's host (HF_ENDPOINT's) answers on its port within REACH_S; a proxy is trusted to."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=REACH_S).close()
    except OSError:
        return False
    return True


def hub_dataset(cfg: dict) -> tuple[str, str | None] | None:
    """(dataset_path, dataset_name) of a task config whose data comes from the Hub; None for its own files, a
    local folder, or what the YAML does not say."""
    path, kwargs = cfg.get("dataset_path"), cfg.get("dataset_kwargs") or {}
    if not isinstance(path, str) or "class" in cfg or "custom_dataset" in cfg:
        return None
    if isinstance(kwargs, dict) and any(kwargs.get(k) for k in _LOCAL_KWARGS) or Path(path).expanduser().exists():
        return None
    name = cfg.get("dataset_name")
    return path, name if isinstance(name, str) else None


def task_configs(name: str, files: dict[str, list[str]], seen: frozenset = frozenset()) -> Iterator[tuple[str, dict]]:
    """(task name, config) of every task `name` stands for: itself, a group's members, a tag's tasks."""
    if name in seen:
        return
    for path in files.get(name, ()):
        try:
            cfg = _read_task_yaml(Path(path), "--tasks") or {}
        except Refused:  # lm-eval's own trouble: it says so later
            continue
        if cfg.get("group") == name and "class" not in cfg:
            for member in cfg.get("task") if isinstance(cfg.get("task"), list) else ():
                if isinstance(member, str):
                    yield from task_configs(member, files, seen | {name})
                elif isinstance(member, dict) and "dataset_path" in member:
                    yield str(member.get("task", name)), member
                elif isinstance(member, dict) and isinstance(member.get("task"), str):
                    yield from task_configs(member["task"], files, seen | {name})
        else:
            yield str(cfg.get("task", name)), cfg


def named_configs(names: list[str], include_path: str | None) -> Iterator[tuple[str, dict]]:
    """(task name, config) of every task the --tasks names (patterns, groups and tags followed) stand for."""
    files = dict(default_task_files())
    if include_path:
        for key, paths in scan_task_files(Path(include_path).expanduser()).items():
            files[key] = paths  # lm-eval: the include path's definition wins
    for pattern in names:
        for name in fnmatch.filter(sorted(files), pattern) if any(c in pattern for c in "*?[") else [pattern]:
            yield from task_configs(name, files)


def missing_datasets(names: list[str], include_path: str | None) -> list[tuple[str, str, str | None]]:
    """(task, dataset_path, dataset_name) of each Hub dataset the tasks need that is not on this machine."""
    out, said = [], set()
    for task, cfg in named_configs(names, include_path):
        ds = hub_dataset(cfg)
        if ds is not None and ds not in said and not cached(*ds):
            said.add(ds)
            out.append((task, *ds))
    return out


def check_datasets(names: list[str], include_path: str | None) -> None:
    """Every task's dataset on disk, or the Hub reachable to fetch it; else one line for the first missing one. A
    task's own data file that holds no rows is refused too (lm-eval fails on it after the model loaded)."""
    check_task_files(named_configs(names, include_path))
    missing = missing_datasets(names, include_path)
    if not missing:
        return
    offline = offline_set()
    if not offline and hub_reachable():
        return  # lm-eval downloads it
    task, path, name = missing[0]
    others = sorted({p for _, p, _ in missing} - {path})
    more = f" (and {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
    dataset = f"{path}{f' ({name})' if name else ''}{more}"
    if offline:
        why, fix = f"downloads are off ({' and '.join(offline)} set)", f"or allow downloads (unset {' and '.join(offline)})"
    else:
        why, fix = "this machine cannot reach the Hugging Face Hub", "or connect this machine to the Hub"
    said = " ".join(f"{t} {p}" for t, p, _ in missing)  # an MMLU task among them: the prepared MMLU cache fits
    raise Refused(f"--tasks: task {task}'s dataset {dataset} is not in the datasets cache ({datasets_cache()}) and "
                  f"{why}: {cache_hint(said)}, {fix}")
