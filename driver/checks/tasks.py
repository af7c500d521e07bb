"""Task names and task YAMLs: --tasks, the YAMLs of --include-path, lm-eval's own index of names."""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from pathlib import Path

from driver.checks.errors import BadUsage, Refused

# Task names are checked against lm-eval's own index, names only: scanned in ~3 s (each of its ~14,000 YAMLs parsed
# once with the C loader; lm-eval's TaskManager takes ~8 s and re-reads shared includes) and remembered per lm-eval
# install under $ORCHARD_HOME (else ~/.cache/orchard), so an unknown name fails in about a second. lm-eval's
# TaskManager is still built afterwards, for the run, and has the last word.
_TASK_NAMES_FILE = "lm-eval-task-names.json"


def _yaml_loader(base: Path):
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        pass

    Loader.add_constructor("!function", lambda loader, node: str(base / loader.construct_scalar(node)))
    return Loader


def _read_task_yaml(path: Path, flag: str, seen: tuple[Path, ...] = ()) -> dict | None:
    """A task YAML as lm-eval reads it for its index (includes merged, functions unresolved); None if not a dict."""
    import yaml

    path = path.resolve()
    if path in seen:
        raise Refused(f"{flag}: {seen[-1]}: `include` cycle through {path}")
    try:
        with path.open("rb") as fh:
            cfg = yaml.load(fh, Loader=_yaml_loader(path.parent))  # noqa: S506  (a safe loader)
    except FileNotFoundError:
        where = f"{seen[-1]}: include {path}" if seen else str(path)
        raise Refused(f"{flag}: {where}: no such file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise Refused(f"{flag}: {path}{at}: malformed YAML ({problem}): fix it or move it out of the folder") from None
    except OSError as e:
        raise Refused(f"{flag}: cannot read {path} ({e.strerror})") from None
    if not isinstance(cfg, dict):
        return None
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_path = Path(inc) if Path(str(inc)).is_absolute() else path.parent / str(inc)
        sub = _read_task_yaml(inc_path, flag, (*seen, path)) or {}
        sub.pop("task_list", None)
        merged.update(sub)
    merged.update(cfg)
    return merged


def _names_of(cfg: dict) -> list[str]:
    """The index entries one config makes, as lm-eval's TaskIndex: a group's name; a task's name and its tags."""
    if "group" in cfg and "class" not in cfg:
        return [cfg["group"]] if isinstance(cfg["group"], str) else []
    if not isinstance(cfg.get("task"), str):
        return []
    tags = cfg.get("tag")
    return [cfg["task"], *(t for t in (tags if isinstance(tags, list) else [tags]) if isinstance(t, str))]


def _yaml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.yaml") if not any(part in ("__pycache__", ".ipynb_checkpoints") for part in p.parts))


def include_names(folder: Path, flag: str = "--include-path") -> set[str]:
    """Task, group and tag names the YAMLs of an --include-path folder define; a malformed one is an error."""
    names: set[str] = set()
    for path in _yaml_files(folder):
        cfg = _read_task_yaml(path, flag)
        names.update(_names_of(cfg) if cfg else ())
    return names


def scan_task_names(root: Path) -> set[str]:
    """lm-eval's index of a folder, names only: every YAML parsed once (C loader, includes remembered), files
    lm-eval would skip skipped. ~3x faster than building a TaskManager; the same names (lm-eval 0.4.13: 14,683)."""
    return set(scan_task_files(root))


def scan_task_files(root: Path) -> dict[str, list[str]]:
    """{name: the YAML files defining it} of a folder (a tag's: every task carrying it), as scan_task_names reads."""
    import yaml

    memo: dict[Path, dict | None] = {}
    loader = _yaml_loader(root)  # function paths do not matter for names: one loader class for all

    def load(path: Path) -> dict | None:
        path = path.resolve()
        if path in memo:
            return memo[path]
        memo[path] = None  # an include cycle reads as nothing
        try:
            with path.open("rb") as fh:
                cfg = yaml.load(fh, Loader=loader)  # noqa: S506  (a safe loader)
        except (OSError, yaml.YAMLError):
            return None
        if isinstance(cfg, dict) and "include" in cfg:
            includes, merged = cfg.pop("include"), {}
            for inc in includes if isinstance(includes, list) else [includes]:
                sub = dict(load(path.parent / str(inc)) or {})
                sub.pop("task_list", None)
                merged.update(sub)
            cfg = {**merged, **cfg}
        memo[path] = cfg if isinstance(cfg, dict) else None
        return memo[path]

    files: dict[str, list[str]] = {}
    for path in _yaml_files(root):
        cfg = load(path)
        for name in _names_of(cfg) if cfg else ():
            files.setdefault(name, []).append(str(path))
    return files


def _orchard_home() -> Path:
    home = os.environ.get("ORCHARD_HOME")
    if home:
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "orchard"


def _lm_eval_tasks() -> tuple[Path, dict]:
    from importlib.metadata import version

    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    st = root.stat()
    return root, {"lm_eval": version("lm_eval"), "root": str(root), "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def default_task_names() -> set[str]:
    """lm-eval's own task/group/tag names: remembered per lm-eval install, else scanned (and remembered)."""
    return set(default_task_files())


def default_task_files() -> dict[str, list[str]]:
    """{lm-eval's own task/group/tag name: its YAML files}: remembered per lm-eval install, else scanned."""
    root, key = _lm_eval_tasks()
    memo = _orchard_home() / _TASK_NAMES_FILE
    try:
        saved = json.loads(memo.read_text())
        if isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("files"), dict):
            return saved["files"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    files = scan_task_files(root)
    try:  # a cache: never worth failing a run for
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".task-names.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "names": sorted(files), "files": files}, fh)
        os.replace(tmp, memo)
    except OSError:
        pass
    return files


def task_names(tasks: str) -> list[str]:
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise BadUsage(f"--tasks {tasks!r}: give at least one task name (comma-separated)")
    return names


def _unknown(names: list[str]) -> BadUsage:
    return BadUsage(
        f"unknown task {', '.join(names)}: list tasks with `lm_eval ls tasks`, or pass a folder of task YAMLs with --include-path"
    )


def check_tasks(tasks: str, include_path: str | None) -> list[str]:
    """The task names, checked fast: the --include-path YAMLs parse, and every name (or glob) is one lm-eval knows."""
    names = task_names(tasks)
    found: set[str] = set()
    if include_path:
        folder = Path(include_path).expanduser()
        if not folder.is_dir():
            raise Refused(f"--include-path {include_path}: no such folder of task YAMLs")
        found = include_names(folder)
    if all(n in found for n in names):  # the folder's own tasks (the demo's): lm-eval's ~14,000 YAMLs not read
        return names
    known = sorted(found | default_task_names())
    unknown = [n for n in names if not fnmatch.filter(known, n)]
    if unknown:
        raise _unknown(unknown)
    return names


def task_manager(names: list[str], include_path: str | None):
    """lm-eval's TaskManager over only the folders holding the named tasks (and their groups' members): lm-eval
    indexes every YAML of a folder it is given, 5-17 s for its own ~14,000; names checked against it."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=task_folders(names, include_path), include_defaults=False)
    unknown = [t for t in names if not manager.match_tasks([t])]
    if unknown:
        raise _unknown(unknown)
    return manager


def task_folders(names: list[str], include_path: str | None) -> list[str]:
    """The folders whose YAMLs define `names` (globs too), a group's members and a tag's tasks: lm-eval's own
    (from the remembered index) first, then --include-path whole (it overrides them, as in lm-eval's full index)."""
    files = default_task_files()
    mine = scan_task_files(Path(include_path).expanduser()) if include_path else {}
    todo, seen, folders = list(names), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for match in fnmatch.filter(files, name) if any(c in name for c in "*?[") else [name]:
            for path in files.get(match, []) if match not in mine else []:
                folders.add(Path(path).parent)
                todo += _members(Path(path))
        todo += [m for path in mine.get(name, []) for m in _members(Path(path))]
    outer = sorted(f for f in folders if not any(a in folders for a in f.parents))  # a folder indexed once
    return [*map(str, outer), *([include_path] if include_path else [])]


def _members(path: Path) -> list[str]:
    """The task and group names a group YAML lists (nested groups' too); [] for a task's YAML."""
    cfg = _read_task_yaml(path, "--tasks") or {}
    if "group" not in cfg or "class" in cfg:
        return []

    def listed(entries) -> list[str]:
        out = []
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, str):
                out.append(entry)
            elif isinstance(entry, dict):
                out += [entry["task"]] if isinstance(entry.get("task"), str) else listed(entry.get("task", []))
        return out

    return listed(cfg.get("task", []))
