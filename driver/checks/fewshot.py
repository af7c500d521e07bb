"""--num-fewshot against the examples each task has, checked once the tasks' documents are loaded (before Ray)."""

from __future__ import annotations

from driver.checks.errors import BadUsage, Refused


def available(task) -> int:
    """How many few-shot examples lm-eval can draw for one document of `task` (its sampler's pool; one fewer
    when the examples come from the split being evaluated, which leaves the document itself out)."""
    sampler = getattr(task, "sampler", None)
    if sampler is None:
        return 0
    pool = len(list(sampler.fewshot_docs()))
    same_split = task.fewshot_cfg.split == task.config.test_split
    return max(pool - 1, 0) if same_split else pool


def check_fewshot(manager, names: list[str], num_fewshot: int, dataset_hint: str) -> None:
    """One line naming the first task with fewer examples than asked for (tasks configured for 0 shots keep 0)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a refusal here is one line
    try:
        tasks = manager.load(names)["tasks"]
    except ConnectionError as e:  # `datasets` cannot fetch a task's data (offline, or the Hub unreachable)
        raise Refused(f"a task's dataset cannot be loaded: {e}: {dataset_hint}") from None
    finally:
        if shown:  # as they were (driver.lm.quiet turns them off for every command)
            datasets.enable_progress_bars()
    for name, task in sorted(tasks.items()):
        if task.get_config("num_fewshot") == 0:  # lm-eval never overrides a task written for zero shots
            continue
        have = available(task)
        if num_fewshot > have:
            raise BadUsage(
                f"--num-fewshot {num_fewshot}: task {name} has {have} few-shot example{'s' * (have != 1)}: "
                f"give --num-fewshot {have} or less"
            )
