"""What a task's YAML says that a run must fit, checked before Ray: its own data files hold rows (an empty one
is lm-eval's `StopIteration` once the model has loaded), and the tokens it generates at most (its
generation_kwargs' max_gen_toks, unless --gen-kwargs sets them) leave room for a prompt in the context window
(else every request fails after the model loaded)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from driver.checks.errors import BadUsage, Refused

SPLITS = ("test_split", "validation_split", "training_split", "fewshot_split")  # the splits a task reads
DEFAULT_GEN_TOKS = 256  # OrchardLM's max_gen_toks, as lm-eval's HF model's


def _data_files(cfg: dict) -> Iterator[tuple[str, Path]]:
    """(split, path) of each of the task's own data files (dataset_kwargs.data_files) that the task reads."""
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg.get("dataset_kwargs"), dict) else None
    if isinstance(files, (str, list)):
        files = {"data": files}
    if not isinstance(files, dict):
        return
    read = {cfg[k] for k in SPLITS if isinstance(cfg.get(k), str)}
    for split, paths in files.items():
        if read and split not in read:
            continue
        for path in [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else ():
            if isinstance(path, str) and "://" not in path and not any(c in path for c in "*?["):
                yield str(split), Path(path).expanduser()


def _rows(path: Path) -> bool:
    """Whether a data file holds a row: a non-blank line (past a CSV's header)."""
    with open(path, "rb") as f:
        lines = [line for line in (f.readline() for _ in range(2)) if line.strip()]
    return len(lines) > (1 if path.suffix.lower() in (".csv", ".tsv") else 0)


def check_task_files(configs: Iterable[tuple[str, dict]]) -> None:
    """Each task's own data files (of `configs`: (task, config), driver.checks.datasets.named_configs) hold rows."""
    for task, cfg in configs:
        for split, path in _data_files(cfg):
            if path.is_file() and not _rows(path):
                raise Refused(f"--tasks {task}: its {split} data file {path} holds no rows: fill it (or drop the task)")


def check_task_room(configs: Iterable[tuple[str, dict]], window: int, model_args: dict, gen_kwargs: dict | None) -> None:
    """Each generation task's max_gen_toks (its YAML's; --model-args max_gen_toks or 256 when it gives none) is
    less than the context window; --gen-kwargs' own limit replaces every task's (checked with the flags)."""
    from driver.checks.settings import MAX_TOKENS

    if any(k in (gen_kwargs or {}) for k in MAX_TOKENS):
        return
    default = int(model_args.get("max_gen_toks") or DEFAULT_GEN_TOKS)
    for task, cfg in configs:
        kwargs = cfg.get("generation_kwargs") if isinstance(cfg.get("generation_kwargs"), dict) else {}
        wanted = kwargs.get("max_gen_toks", default)
        if cfg.get("output_type") == "generate_until" and isinstance(wanted, int) and wanted >= window:
            said = "its max_gen_toks" if "max_gen_toks" in kwargs else "the default max_gen_toks"
            raise BadUsage(f"--tasks {task} generates up to {wanted} tokens ({said}), which must be less than the context "
                           f"window ({window} tokens) that also holds the prompt: give a larger --max-length, or "
                           f"--gen-kwargs max_gen_toks=N with N < {window}")  # fmt: skip
