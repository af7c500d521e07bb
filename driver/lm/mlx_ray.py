"""`mlx-ray`: the `mlx` lm-eval model with its compute sharded over Ray actors, one per `mlx` node (Mac).

    simple_evaluate(model="mlx-ray", model_args="pretrained=PATH,workers=4,address=auto,cache=DIR")

Tokenization stays on the driver (OrchardLM), so every worker scores the same token ids. Importing this
module starts nothing: Ray is joined when the model is built, or, when the result cache already holds this
model's results, at the first request it lacks (a fully cached rerun starts no worker).
"""

from __future__ import annotations

import click
from lm_eval.api.registry import register_model

from cluster import WorkerActor
from cluster.connect import describe
from cluster.executor import RayExecutor, Workers
from worker.load import is_local
from worker.spec import Batching, Grouping, ModelSpec

from driver.checks.model import check_heads_split
from driver.checks.settings import RAY_ONLY, check_model_args
from driver.lm.cache import Cache
from driver.lm.mlx import OrchardLM
from driver.lm.model_setup import model_config, tokenizer_folder
from driver.lm.progress import Progress
from driver.lm.quiet import meanwhile, phase, say
from driver.steering.spec import warn_once


def workers_text(n: int | str, size: int) -> str:
    """'4 workers', '2 groups of 2' or 'a worker per `mlx` node' (all) for the phase lines."""
    if n == "all":
        return "a worker per `mlx` node" if size == 1 else f"as many groups of {size} as the `mlx` nodes hold"
    n = int(n)
    return f"{n} worker{'s' * (n != 1)}" if size == 1 else f"{n} group{'s' * (n != 1)} of {size}"


class ToldWorkers(Workers):
    """cluster.executor.Workers that say on stderr what they are doing: Ray starting (or which cluster is
    joined), the model loading on how many workers, and the wait for it when lm-eval is ready first."""

    say = staticmethod(say)  # the staging report, silenced by --quiet as every phase line

    def start(self) -> None:
        asked = workers_text(self.requested, self.grouping.size)
        staging = f", staging {self.spec.model} on every node" if self.options["stage"] else ""
        with phase(f"{describe(self.options['address'])}: {asked}{staging}"):
            super().start()
        formed = workers_text(len(self.pool.workers), self.grouping.size)
        say(f"loading {self.spec.model} on {formed}{meanwhile()}")

    def ready(self) -> list[dict]:
        if self.held.connection is None:
            self.start()
        if self.facts is not None:
            return self.facts
        with phase(f"waiting for the workers to load {self.spec.model}", after=1.0):
            return super().ready()


class ToldExecutor(RayExecutor):
    """cluster.executor.RayExecutor whose facts name every worker (group), so a summary lists the idle and the
    lost ones too, not only those that computed something."""

    def info(self) -> dict:
        names, alive = self.workers.names, self.pool.alive
        return super().info() | {"names": list(names), "lost": [n for i, n in enumerate(names) if i not in alive]}


def ray_executor(
    spec: ModelSpec, batching: Batching, *, model_identity: dict, max_length: int, cache_dir: str | None = None,
    grouping: Grouping = Grouping(), **options,
) -> RayExecutor:  # fmt: skip
    """A cluster.executor.RayExecutor with this head's result cache (`cache_dir`, a folder, or none), progress bar
    and steering notes; `grouping`: the worker groups (resolved: no auto); `options` are cluster.executor.Workers'
    (workers, address, threads, files, ...)."""
    workers = ToldWorkers(spec, batching, grouping=grouping, **options)  # the worker count checked before the cache is opened
    cache = Cache(cache_dir) if cache_dir else None
    return ToldExecutor(
        workers, cache=cache, progress=Progress(unit="group" if grouping.size > 1 else "worker"), notes=warn_once,
        model_identity=model_identity, max_length=max_length,
    )


def model_grouping(spec: ModelSpec, size: int | str, split: str, address: str | None) -> Grouping:
    """The model_args' group_size and split as a Grouping, checked as the CLI's flags are (driver.checks.groups)."""
    if size == 1:
        return Grouping(split="pipeline" if split == "auto" else split)
    from driver.checks.groups import grouping, tell_chosen

    folder = tokenizer_folder(spec.model, spec.revision)
    try:
        found = grouping(size, split, config=model_config(spec.model, spec.revision), folder=folder, address=address)
    except click.ClickException as e:  # simple_evaluate's callers get a ValueError, as for every bad model_arg
        raise ValueError(e.format_message()) from None
    tell_chosen(size, split, found)
    return found


_NAMES = ("workers", "address", "cache")  # kept as given (a count or "all", a text): checked as text


@register_model("mlx-ray")
class MLXRayLM(OrchardLM):
    """`mlx` plus workers (a count of groups or "all"), address (auto | HOST:PORT | local), cache (a folder),
    threads, max_restarts, dashboard (embedded Ray only), group_size (nodes per copy of the model, or auto) and
    split (auto | pipeline | tensor)."""

    actor_cls: type = WorkerActor  # the actor class placed on each node

    def _init_extra(self, kwargs: dict) -> None:
        given = {k: kwargs.pop(k) for k in RAY_ONLY if k in kwargs}
        given = {k: v for k, v in given.items() if v not in (None, "")}
        # checked as the CLI's are: one line on a typo (lm-eval has already turned numbers and true/false into values)
        checked = check_model_args({k: str(v) if k in _NAMES else v for k, v in given.items()})
        ray = given | {k: v for k, v in checked.items() if k not in _NAMES}
        self.ray_args = {"workers": ray.get("workers", "all"), "address": ray.get("address"), "cache_dir": ray.get("cache"),
                         "dashboard": ray.get("dashboard", False), "stage": ray.get("stage", False)}  # fmt: skip
        self.ray_args |= {k: ray[k] for k in ("threads", "max_restarts") if k in ray}
        self.group_args = (ray.get("group_size", 1), ray.get("split", "auto"))
        super()._init_extra(kwargs)

    def make_executor(self, spec: ModelSpec, batching: Batching) -> RayExecutor:
        files = None
        if is_local(spec.model):  # the workers load the head's folder (or a staged copy): the same content
            files = {"weights": self.identity["files"]} | ({"adapter": self.identity["adapter"]} if self.identity["adapter"] else {})
        grouping = model_grouping(spec, *self.group_args, self.ray_args["address"])
        check_heads_split(self.steering, grouping)  # before Ray starts, as `driver run` does
        return ray_executor(
            spec, batching, model_identity=self.identity, max_length=self.max_length, actor_cls=self.actor_cls,
            files=files, grouping=grouping, **self.ray_args,
        )  # fmt: skip
