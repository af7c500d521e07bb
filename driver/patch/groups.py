"""The worker groups a patch run asks for (flags, else the file's model.group_size / model.split), resolved and
checked before any worker starts: driver.checks.groups as for a sweep, then what patch jobs cannot run on
(worker.patch.spec.group_problem: pipeline groups, attn_head cells on a tensor split)."""

from __future__ import annotations

from worker.patch.spec import group_problem
from worker.spec import Grouping

from driver.checks.cluster import check_workers
from driver.checks.errors import BadUsage, Refused
from driver.checks.groups import chosen_lines, for_command
from driver.patch.plan import Patch


def resolve(patch: Patch, flags: tuple = (None, None), workers: str = "all", address: str | None = None) -> tuple[Grouping, list[str]]:
    """(the grouping, what auto chose). `flags`: --group-size and --split as given (None: the file's). A problem
    with a flag's value is BadUsage (exit 2); with the file's alone, Refused naming the file (exit 1)."""
    from driver.lm.model_setup import tokenizer_folder

    model, args = patch.spec.model, patch.model_args
    size, split = (flag if flag is not None else given for flag, given in zip(flags, (model.group_size, model.split)))
    folder = tokenizer_folder(args["pretrained"], args.get("revision"))
    try:
        found = for_command(size, split, workers, model=args["pretrained"], folder=folder, address=address)
        problem = group_problem(found, patch.cells)
        if problem:
            raise BadUsage(problem)
    except BadUsage as e:
        if any(flag is not None for flag in flags):
            raise  # a flag's value: the command line (exit 2)
        said = e.format_message().replace("--split ", "split: ").replace("--group-size ", "group_size: ")
        raise Refused(f"{patch.path}: model: {said} (group_size {size}, split {split})") from None
    if found.size > 1:
        check_workers(workers, address, args["pretrained"], found.size)
    return found, chosen_lines(size, split, found)
