"""Checks that run before anything expensive (lm-eval's task index, Ray, a model load), each failing in one line.

In the order `driver run` runs them: the output folder (writable, not inside a file), the result cache (a folder
that can hold it, and an existing `results.sqlite` that is an Orchard cache: never overwritten), the model (a
local folder with config and weights whose safetensors headers fit their files and the config, or a Hub repo id
that resolves: offline, it must be in the HF cache), its tokenizer (its files parse; the chat template with
--apply-chat-template), the task names and the YAMLs of --include-path (a malformed YAML is named with its file
and line), the steering spec against the model's shape, and the cluster address (cluster.connect.resolve:
syntax, reachable, token authentication). `--num-fewshot` is checked against each task's examples once the
tasks' documents load (driver.checks.fewshot), still before Ray.

Exit codes, as the CLI uses them: `BadUsage` (2) for a command line that cannot be right whatever the machine
(a flag's value, an unknown task name); `Refused` (1) for a command line that is fine but names something that
is not (a file, a folder, a model, a cache, a cluster).

Task names are checked against lm-eval's own index, names only: scanned in ~3 s (each of its ~14,000 YAMLs
parsed once with the C loader; lm-eval's TaskManager takes ~8 s and re-reads shared includes) and remembered per
lm-eval install under $ORCHARD_HOME (else ~/.cache/orchard), so an unknown name fails in about a second.
lm-eval's TaskManager is still built afterwards, for the run, and has the last word.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sqlite3
import tempfile
from pathlib import Path


import click

CACHE_FILE = "results.sqlite"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model", "spiece.model")
_HUB_SMALL_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_TASK_NAMES_FILE = "lm-eval-task-names.json"


class Refused(click.ClickException):
    """Something the command names is not usable (exit 1); one line."""

    exit_code = 1


class BadUsage(click.ClickException):
    """The command line itself is wrong (exit 2); one line."""

    exit_code = 2


# --- 1. folders we will write ------------------------------------------------------------------------------------


def writable_folder(path: str | os.PathLike, flag: str) -> Path:
    """`path` is a folder or can become one, and this user can write there. Creates nothing."""
    p = probe = Path(path).expanduser()
    try:
        if p.exists():
            if not p.is_dir():
                raise Refused(f"{flag} {path}: a file is in the way (give a folder)")
            probe = p
        else:
            probe = p.parent
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not probe.is_dir():
                raise Refused(f"{flag} {path}: {probe} is a file, not a folder")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise Refused(f"{flag} {path}: cannot write in {probe} ({e.strerror or type(e).__name__}): choose a writable folder") from None
    return p


def writable_file(path: str | os.PathLike, flag: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise Refused(f"{flag} {path}: a folder is in the way (give a file name such as vectors.safetensors)")
    writable_folder(p.parent if str(p.parent) else ".", flag)
    return p


# --- 2. the result cache -----------------------------------------------------------------------------------------


def cache_problem(path: str | os.PathLike) -> str | None:
    """Why `path` (a results.sqlite) cannot be used as Orchard's result cache, or None (absent or fine).

    Opened read-only: nothing is created or changed here."""
    p = Path(path)
    if not p.exists():
        return None
    move = "move it away (Orchard never overwrites it) or pass --cache another folder"
    if not p.is_file():
        return f"{p} is not a file: {move}"
    try:
        db = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            columns = [(c[1], c[2].upper()) for c in db.execute("PRAGMA table_info(results)")]
        finally:
            db.close()
    except sqlite3.Error as e:
        return f"{p} is not an Orchard result cache ({e}): {move}"
    if not tables:
        return None  # an empty database: Orchard creates its table
    if "results" not in tables or columns != [("key", "BLOB"), ("value", "TEXT")]:
        found = ", ".join(sorted(tables)) or "none"
        return f"{p} is another program's database, not an Orchard result cache (tables: {found}): {move}"
    return None


def check_cache(folder: str | os.PathLike, flag: str) -> None:
    writable_folder(folder, flag)
    problem = cache_problem(Path(folder).expanduser() / CACHE_FILE)
    if problem:
        raise Refused(problem)


# --- 3. the model, 4. its tokenizer -------------------------------------------------------------------------------


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _local(folder: Path, adapter_path: str | None) -> None:
    """The loader's own folder check (worker.load.validate_local), as a pre-flight refusal."""
    from worker.load import ModelLoadError, validate_local

    try:
        validate_local(folder, adapter_path or None)
    except ModelLoadError as e:
        raise Refused(str(e)) from None


def _hub(model: str, revision: str | None) -> Path:
    """The repo's snapshot folder: offline, the cached one (weights included); online, its small files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f"@{revision}" if revision else ""
    offline = _offline()
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=_HUB_SMALL_FILES, local_files_only=offline))
    except LocalEntryNotFoundError:
        if offline:
            raise Refused(
                f"model {model}{at}: no such local folder, and not in the Hugging Face cache while HF_HUB_OFFLINE=1: "
                f"download it first (`hf download {model}`), or unset HF_HUB_OFFLINE"
            ) from None
        raise Refused(f"cannot reach the Hugging Face Hub to fetch {model}{at}: check the network, or download it first") from None
    except GatedRepoError:
        raise Refused(f"model {model} is gated on the Hugging Face Hub: accept its terms and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise Refused(f"no model {model} on the Hugging Face Hub (or it is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise Refused(f"model {model} has no revision {revision!r} on the Hugging Face Hub") from None
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Refused(f"cannot fetch {model}{at} from the Hugging Face Hub: {first}") from None


def check_model(model: str, revision: str | None = None, adapter_path: str | None = None) -> Path:
    """The folder holding the model's config and tokenizer (on this machine), every file check done."""
    from worker.load import is_local

    if is_local(model):
        folder = Path(model).expanduser().resolve()
        _local(folder, adapter_path)
        return folder
    folder = _hub(model, revision)
    if _offline():  # the workers will need the weights from the same cache
        if not list(folder.glob("model*.safetensors")):
            raise Refused(
                f"model {model}: the Hugging Face cache has its config and tokenizer but not its weights, and "
                f"HF_HUB_OFFLINE=1: download it (`hf download {model}`), or unset HF_HUB_OFFLINE"
            )
        _local(folder, adapter_path)
    elif adapter_path:
        _local_adapter_only(adapter_path)
    return folder


def _local_adapter_only(adapter_path: str) -> None:
    adapter = Path(adapter_path).expanduser()
    if not (adapter / "adapter_config.json").is_file():
        raise Refused(f"--model-args adapter_path={adapter_path}: no adapter_config.json there (not an mlx-lm LoRA adapter folder)")


def model_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"cannot read {folder / 'config.json'}: {e}") from None


def check_tokenizer(folder: Path, apply_chat_template: bool = False) -> None:
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if not any(n in names for n in _TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise Refused(f"no tokenizer in {folder} (tokenizer.json, tokenizer.model or vocab files): copy the model's tokenizer files there")
    from worker.files import FileProblem, check_tokenizer_files

    try:  # for a Hub model's snapshot; a local folder's were checked with it (worker.load.validate_local)
        check_tokenizer_files(folder)
    except FileProblem as e:
        raise Refused(str(e)) from None
    if not apply_chat_template:
        return
    if "chat_template.jinja" in names or "chat_template.json" in names:
        return
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text()) if "tokenizer_config.json" in names else {}
    except (OSError, ValueError):
        config = {}
    if not config.get("chat_template"):
        raise Refused(
            f"--apply-chat-template: the tokenizer in {folder} has no chat template (none in tokenizer_config.json, "
            "no chat_template.jinja): drop the flag, or use a chat/instruct model"
        )


# --- 5. tasks ------------------------------------------------------------------------------------------------------


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

    names: set[str] = set()
    for path in _yaml_files(root):
        cfg = load(path)
        names.update(_names_of(cfg) if cfg else ())
    return names


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
    root, key = _lm_eval_tasks()
    memo = _orchard_home() / _TASK_NAMES_FILE
    try:
        saved = json.loads(memo.read_text())
        if isinstance(saved, dict) and saved.get("key") == key:
            return set(saved["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    names = scan_task_names(root)
    try:  # a cache: never worth failing a run for
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".task-names.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "names": sorted(names)}, fh)
        os.replace(tmp, memo)
    except OSError:
        pass
    return names


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
    known = sorted(found | default_task_names())
    unknown = [n for n in names if not fnmatch.filter(known, n)]
    if unknown:
        raise _unknown(unknown)
    return names


def task_manager(names: list[str], include_path: str | None):
    """lm-eval's TaskManager (the expensive part: it indexes every task YAML), names checked against it."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    unknown = [t for t in names if not manager.match_tasks([t])]
    if unknown:
        raise _unknown(unknown)
    return manager


# --- 6. steering ------------------------------------------------------------------------------------------------


def check_steering(steer: str, config: dict) -> None:
    from driver.steering.spec import SteeringError, for_model

    try:
        for_model(steer, config)
    except (SteeringError, ValueError, OSError) as e:
        raise Refused((str(e).strip().splitlines() or [type(e).__name__])[0]) from None


# --- 7. the cluster ---------------------------------------------------------------------------------------------


def check_address_syntax(address: str | None) -> None:
    """auto | local | HOST:PORT | ray://...: exit 2 for --address (a settings error), 1 for RAY_ADDRESS."""
    from cluster.connect import AddressError, check_syntax, source_of

    value, source = source_of(address)
    try:
        check_syntax(value, source)
    except AddressError as e:
        raise (BadUsage if source == "--address" else Refused)(str(e)) from None


def check_address(address: str | None) -> None:
    """Syntax, then reachability and token authentication (exit 1); no `ray.init`."""
    from cluster.connect import ClusterError, resolve, source_of

    check_address_syntax(address)
    value, _ = source_of(address)
    if value == "local" or value.startswith("ray://"):
        return
    try:
        resolve(address)
    except ClusterError as e:
        raise Refused(str(e)) from None
