"""`driver run`: one lm-eval evaluation of a model on tasks, its requests spread over Ray workers."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click

from worker.spec import Grouping

from driver.checks import settings
from driver.checks.cluster import check_address, check_address_syntax, check_workers
from driver.checks.fewshot import check_fewshot
from driver.checks.files import check_cache, writable_folder
from driver.checks.groups import for_command, tell_chosen
from driver.checks.model import (check_generation_room, check_heads_split, check_model, check_steering, check_tokenizer,
                                 model_config)
from driver.checks.datasets import check_datasets
from driver.checks.tasks import check_tasks, task_manager
from driver.cli.errors import resumable, usage_errors
from driver.lm.evaluation import DATASET_HINT, Plan, evaluate, open_model, parse_seeds, save
from driver.lm.quiet import phase, say

# model_args keys that have a flag of their own (a flag and a model_arg must never silently disagree)
RUN_FLAGS = {
    "pretrained": "--model", "batch_size": "--batch-size", "max_length": "--max-length", "workers": "--workers",
    "address": "--address", "cache": "--cache", "dashboard": "--dashboard", "threads": "--threads", "steer": "--steer",
    "stage": "--stage", "group_size": "--group-size", "split": "--split",
}  # fmt: skip
GROUP_HELP = "Nodes per worker group: each group holds one copy of the model split across its K nodes; auto: the fewest that hold it."
WORKERS_HELP = ("Workers (each a group of --group-size `mlx` nodes): a count, or all: one per `mlx` node of the cluster "
                "(groups: as many as its nodes hold); on the embedded Ray (no --address) all is 1.")
SPLIT_HELP = "How a group splits the model: pipeline (layer ranges per node), tensor (mlx-lm's shard: Thunderbolt/RDMA), auto (pipeline)."


@click.command()
@click.option("--model", "model", required=True, help="Local model folder or Hugging Face repo id (mlx-lm format).")
@click.option("--tasks", required=True, help="Comma-separated lm-eval task or group names, e.g. mmlu.")
@click.option("--workers", default="all", show_default=True, help=WORKERS_HELP)
@click.option(
    "--address",
    default=None,
    help="Ray cluster: auto (the one running here), HOST:PORT, or local (embedded). Default: $RAY_ADDRESS, else local.",
)
@click.option("--group-size", "--group_size", "group_size", default="1", show_default=True, help=GROUP_HELP)
@click.option("--split", "split", default="auto", show_default=True, help=SPLIT_HELP)
@click.option("--num-fewshot", "--num_fewshot", "num_fewshot", type=settings.WHOLE, default=None, help="Few-shot examples per question.")
@click.option("--limit", default=None, help="Documents per task: a count, or a fraction if < 1 (for testing).")
@click.option("--batch-size", "--batch_size", "batch_size", default="32", show_default=True, help="Rows per forward pass on a worker.")
@click.option("--max-length", "--max_length", "max_length", type=settings.WHOLE, default=None, help="Context window (default: the model's).")
@click.option(
    "--model-args", "--model_args", "model_args", default="", help="More model settings, e.g. dtype=float16,revision=main."
)
@click.option(
    "--output", "--output-path", "--output_path", "output_path", default="orchard-out", show_default=True,
    help="Folder for results JSON, samples and the run summary.",
)
@click.option("--log-samples", "--log_samples", "log_samples", is_flag=True, help="Also write every sample's inputs and outputs.")
@click.option("--include-path", "--include_path", "include_path", default=None, help="Extra folder of task YAMLs.")
@click.option("--gen-kwargs", "--gen_kwargs", "gen_kwargs", default=None, help="Generation settings, e.g. temperature=0,max_gen_toks=64.")
@click.option("--apply-chat-template", "--apply_chat_template", "apply_chat_template", is_flag=True, help="Wrap prompts in the model's chat template.")
@click.option("--seed", default="0,1234,1234,1234", show_default=True, help="Python,numpy,torch,fewshot seeds (or one for all).")
@click.option(
    "--cache",
    "cache",
    default=None,
    help="Result cache folder: a rerun reuses every finished request. Default: OUTPUT/cache.",
)
@click.option("--threads", type=settings.WHOLE, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--dashboard", is_flag=True, help="Start Ray's dashboard with the embedded Ray (off by default).")
@click.option("--steer", default=None, help="Steering spec (YAML/JSON): interventions active for every request.")
@click.option("--stage", is_flag=True, help="Copy the model to every node first (driver stage); workers load that copy.")
def run(
    model: str,
    tasks: str,
    workers: str,
    address: str | None,
    group_size: str,
    split: str,
    num_fewshot: int | None,
    limit: str | None,
    batch_size: str,
    max_length: int | None,
    model_args: str,
    output_path: str,
    log_samples: bool,
    include_path: str | None,
    gen_kwargs: str | None,
    apply_chat_template: bool,
    seed: str,
    cache: str | None,
    threads: int | None,
    dashboard: bool,
    steer: str | None,
    stage: bool,
) -> Any:
    """Evaluate MODEL on lm-eval TASKS with its requests spread over Ray workers.

    Prints lm-eval's table and writes lm-eval's results JSON (and samples) plus summary_*.json under OUTPUT.
    """
    start = time.monotonic()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with usage_errors():  # 0. every setting, in the user's words (exit 2)
        plan = Plan(
            seeds=parse_seeds(seed),
            limit=settings.limit(limit),
            num_fewshot=settings.num_fewshot(num_fewshot),
            batch_size=str(settings.batch_size(batch_size)),
            log_samples=log_samples,
            apply_chat_template=apply_chat_template,
            gen_kwargs=settings.gen_kwargs(gen_kwargs),
        )
        max_length, threads = settings.max_length(max_length), settings.threads(threads)
        extra = settings.model_args(model_args, flags=RUN_FLAGS)
        size, split = settings.group_size(group_size), settings.split(split)
    check_workers(workers, address, model, size if size != "auto" else 1)
    check_address_syntax(address)
    plan.names, grouping = _preflight(
        model, extra, output_path=output_path, cache=cache, apply_chat_template=apply_chat_template, tasks=tasks,
        include_path=include_path, steer=steer, address=address, group=(size, split, workers),
        generation=(max_length, plan.gen_kwargs),
    )  # fmt: skip
    args: dict[str, Any] = {
        **extra,
        "pretrained": model,
        "workers": workers,
        "batch_size": int(plan.batch_size),
        "cache": cache or str(Path(output_path) / "cache"),
        "dashboard": dashboard,
        "stage": stage,
        "group_size": grouping.size,
        "split": grouping.split,
    }
    args |= {name: value for name, value in (("address", address), ("max_length", max_length), ("threads", threads),
                                             ("steer", steer)) if value is not None}  # fmt: skip
    # The expensive part starts here: lm-eval indexes its task YAMLs (Python, seconds) while Ray starts (mostly
    # waiting on processes) and the workers load the model.
    indexing = in_background(task_manager, plan.names, include_path)
    if plan.num_fewshot:  # how many examples each task has is known once its documents load: still before Ray
        check_fewshot(indexing.result(), plan.names, plan.num_fewshot, DATASET_HINT)
    with resumable(args["cache"]):
        lm = open_model(args)
        tell_chosen(size, split, grouping)
        try:
            with phase("indexing lm-eval's tasks", after=1.0):  # said only when lm-eval is still at it
                plan.manager = indexing.result()
            done = evaluate(lm, args, plan, output_path)
        finally:
            lm.executor.close()
    save(done, output_path, time.monotonic() - start)
    tell_cached(done.info, grouping, args["cache"])
    return done


def tell_cached(info: dict, grouping: Grouping, cache: str | os.PathLike) -> None:
    """Groups asked for, every request answered from the result cache: no group formed, and the user should know
    (the cache is shared between groupings, as the numbers are)."""
    if grouping.size > 1 and not info["workers"]:
        say(f"every request was answered from the result cache {cache}: no group of {grouping.size} formed (the numbers "
            "do not depend on the grouping); give another --output (or --cache) to compute them on groups")


def in_background(fn, *args) -> Future:
    """fn(*args) on a daemon thread: a failure elsewhere meanwhile does not wait for it."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # raised by .result() in the caller's thread
            future.set_exception(e)

    threading.Thread(target=work, daemon=True, name="orchard-background").start()
    return future


def _preflight(model: str, extra: dict[str, Any], *, output_path: str, cache: str | None, apply_chat_template: bool,
               tasks: str, include_path: str | None, steer: str | None, address: str | None,
               group: tuple, generation: tuple = (None, None)) -> tuple[list[str], Grouping]:  # fmt: skip
    """The checks before lm-eval's task index, Ray or a model, in this order; the task names and the worker group.

    The output folder (writable, not inside a file), the result cache (a folder that can hold it; an existing
    `results.sqlite` must be an Orchard cache: never overwritten), the model (a local folder with config and
    weights whose safetensors headers fit their files and the config, or a Hub repo id that resolves: offline, it
    must be in the HF cache), its tokenizer (its files parse; the chat template with --apply-chat-template), the
    task names and the YAMLs of --include-path (a malformed YAML is named with its file and line), the steering
    spec against the model's shape, the cluster address (syntax, reachable, token authentication), the worker
    group (`group`: size, split, workers; driver.checks.groups).
    `--num-fewshot` is checked once the tasks' documents load (driver.checks.fewshot), still before Ray."""
    writable_folder(output_path, "--output")
    check_cache(cache or Path(output_path) / "cache", "--cache" if cache else "the result cache")
    folder = check_model(model, extra.get("revision"), extra.get("adapter_path"))
    check_tokenizer(folder, apply_chat_template)
    names = check_tasks(tasks, include_path)
    check_datasets(names, include_path)  # on disk, or the Hub reachable: else one line now, not retries after Ray
    check_generation_room(model_config(folder), generation[0], extra, generation[1], (names, include_path))  # max_length, gen_kwargs
    with phase(f"checking {steer} against {model}'s layers", after=1.0, transient=True) if steer else nullcontext():
        steering = check_steering(steer, model_config(folder), extra.get("dtype")) if steer else None  # mlx-lm: seconds
    check_address(address)
    grouping = for_command(*group, model=model, folder=folder, address=address)
    check_heads_split(steering, grouping)
    return names, grouping
