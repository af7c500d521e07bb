"""The plan of a sweep: its file checked against the model, vectors, tasks and prompt sets, and every configuration
(driver.sweep.configs)."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.spec import HEAD_SITES, head_shape

from driver.judge.schema import PROMPT
from driver.steering.userfiles import json_object, jsonl_lines
from driver.sweep.configs import BASELINE, Config, Model, TopAt, choose_top, grid_configs, grid_vectors, nonempty
from driver.sweep.schema import NAME, Grid, PromptSet, SweepError, SweepFile, Tasks, one_line, read_sweep_file

__all__ = ["Config", "Prompt", "Sweep", "BASELINE", "load_sweep", "read_prompts", "choose_top"]


@dataclass(frozen=True)
class Prompt:
    text: str
    targets: dict[str, str]
    line: int


@dataclass
class Sweep:
    """A checked sweep: the file, the model's arguments, every configuration, the prompt sets, the lm-eval plan."""

    path: Path
    spec: SweepFile
    model_args: dict
    n_layers: int
    configs: list[Config]  # the baseline first
    prompt_sets: dict[str, tuple[PromptSet, list[Prompt]]] = field(default_factory=dict)
    plan: Any = None  # driver.lm.evaluation.Plan for the lm-eval tasks, or None
    tops: list[TopAt] = field(default_factory=list)  # `top: K` sources, each place checked; ranked once workers run
    expand: Callable[[dict], list[Config]] | None = None  # the configurations, given {(vector, site, layer): features}
    top_features: list[dict] = field(default_factory=list)  # what choose_top chose (run.json, summary.md)
    judge: Any = None  # driver.judge.rate.JudgePlan: the file's judge, checked; or None

    @property
    def grid(self) -> list[Config]:
        """The steering configurations (the prompting baselines, op "prompt", come after them in `configs`)."""
        return [c for c in self.configs[1:] if c.op != PROMPT]

    @property
    def prompting(self) -> list[Config]:
        return [c for c in self.configs if c.op == PROMPT]


def _resolve_model(pretrained: str, base: Path) -> str:
    near = base / Path(pretrained).expanduser()
    return str(near.resolve()) if not Path(pretrained).is_absolute() and near.exists() else pretrained


def _layers(grid: Grid, n_layers: int, where: str) -> list[int]:
    if grid.layers == "all":
        return list(range(n_layers))
    out = []
    for layer in grid.layers:
        if not -n_layers <= layer < n_layers:
            raise SweepError(
                f"{where}: grid.layers: {layer} is out of range for a model with {n_layers} layers "
                f"(use 0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
            )
        resolved = layer % n_layers
        if resolved in out:
            raise SweepError(f"{where}: grid.layers: {layer} is layer {resolved}, which is already listed")
        out.append(resolved)
    return out


def _heads(grid: Grid, n_heads: int | None, where: str) -> list[int]:
    """The heads a head site is steered at (grid.heads: 'all' is every head of the model's config)."""
    if grid.heads is None:
        return []
    if n_heads is None:
        raise SweepError(f"{where}: grid.heads: the model's config.json does not give its number of attention heads; "
                         "steer a site without heads")  # fmt: skip
    if grid.heads == "all":
        return list(range(n_heads))
    bad = [h for h in grid.heads if h >= n_heads]
    if bad:
        raise SweepError(f"{where}: grid.heads: {bad[0]} is out of range for a model with {n_heads} attention heads "
                         f"(use 0..{n_heads - 1}, or all)")  # fmt: skip
    return list(grid.heads)


def _tops(spec: SweepFile, layers: list[int], model: Model, base: Path, where: str) -> list[TopAt]:
    """Each `top: K` source at each place of the grid: its SAE's encoder and its prompts, checked before any worker."""
    from driver.steering.encoders import ranking_encoder
    from driver.steering.saes import SaeError

    out, read = [], {}
    for name in grid_vectors(spec, where):
        source, label = spec.vectors[name], f"{where}: vectors.{name}"
        if source.prompts is None:
            continue
        file = base / Path(source.prompts).expanduser()
        try:
            read[file] = read[file] if file in read else read_prompts(file, label)
        except SweepError as e:  # the file's own problems name the file (and line): say which source reads it
            raise SweepError(str(e) if str(e).startswith(label) else f"{label}.prompts: {e}") from None
        for site, layer in itertools.product(spec.grid.sites, layers):
            if site in HEAD_SITES:
                raise SweepError(f"{label}.top: ranks features on a whole site's activations, not on {site}'s heads: list "
                                 "the features to sweep (features: [..])")  # fmt: skip
            try:
                encoder = ranking_encoder(base / Path(source.sae).expanduser(), site, layer, model.hidden)
            except SaeError as e:
                raise SweepError(one_line(f"{label}.sae: {e} (layer {layer}, site {site})")) from None
            if source.top is not None and source.top > encoder.d_sae:
                raise SweepError(f"{label}.top: {source.top} is past the SAE's {encoder.d_sae} features (use 1..{encoder.d_sae}, "
                                 f"or list them: features: [..]) (layer {layer}, site {site})")  # fmt: skip
            out.append(TopAt(name, site, layer, encoder, source.top, str(file), read[file]))
    return out


def read_prompts(path: Path, where: str) -> list[Prompt]:
    """A prompt set: one {"prompt": str, optional "targets": {name: str}} per line; blank lines skipped."""
    prompts: list[Prompt] = []
    missing, folder = f"{where}: prompts: {path} does not exist", f"{where}: prompts: {path} is a folder, not a JSONL file"
    for n, obj in jsonl_lines(path, SweepError, missing, folder):
        at = f"{path}: line {n}"
        json_object(obj, ("prompt", "targets"), at, SweepError, 'a "prompt"')
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise SweepError(f"{at}: \"prompt\" must be a non-empty string")
        targets = obj.get("targets", {})
        if not isinstance(targets, dict):
            raise SweepError(f"{at}: \"targets\" must be an object such as {{\"positive\": \" happy\", \"negative\": \" sad\"}}")
        for name, target in targets.items():
            if not NAME.match(name):
                raise SweepError(f"{at}: target name {name!r}: use letters, digits, '_' and '-'")
            if not isinstance(target, str) or not target:
                raise SweepError(f"{at}: target {name!r} must be a non-empty string")
        prompts.append(Prompt(prompt, dict(targets), n))
    if not prompts:
        raise SweepError(f"{path}: no prompts (the file is empty): write one JSON object per line")
    return prompts


_MANAGERS: dict[tuple, Any] = {}


def _check_task_names(names: Sequence[str], include: str | None, where: str) -> None:
    from driver.checks.errors import BadUsage, Refused
    from driver.checks.tasks import check_tasks

    for name in names:
        try:
            check_tasks(name, include)
        except (BadUsage, Refused):
            raise SweepError(
                f"{where}: tasks.names: unknown task {name!r} (list tasks with `lm_eval ls tasks`, or give tasks.include_path)"
            ) from None


def _check_datasets(names: Sequence[str], include: str | None, where: str) -> None:
    """Each task's dataset on disk or the Hub reachable (driver.checks.datasets), before lm-eval retries it."""
    from driver.checks.datasets import check_datasets
    from driver.checks.errors import Refused

    try:
        check_datasets(list(names), include)
    except Refused as e:
        raise SweepError(f"{where}: tasks.names: {str(e).removeprefix('--tasks: ')}") from None


def _plan(tasks: Tasks, base: Path, where: str, batch_size: int):
    include = None
    if tasks.include_path is not None:
        include = str((base / Path(tasks.include_path).expanduser()).resolve())
        if not Path(include).is_dir():
            raise SweepError(f"{where}: tasks.include_path: {include} is not a folder of task YAMLs")
    _check_task_names(tasks.names, include, where)  # as fast as `driver run`'s check, before lm-eval's index
    _check_datasets(tasks.names, include, where)

    from driver.checks.errors import BadUsage
    from driver.checks.tasks import task_manager
    from driver.lm.evaluation import Plan, parse_seeds

    key = (include, tuple(tasks.names))
    if key not in _MANAGERS:  # lm-eval indexes only the named tasks' folders (driver.checks.tasks): once per process
        try:
            _MANAGERS[key] = task_manager(list(tasks.names), include)
        except BadUsage as e:
            said = e.format_message().split(":")[0]  # "unknown task NAME"
            raise SweepError(f"{where}: tasks.names: {said} (list tasks with `lm_eval ls tasks`, or give tasks.include_path)") from None
    manager = _MANAGERS[key]
    limit = tasks.limit if tasks.limit is None or tasks.limit < 1 else int(tasks.limit)
    seeds = parse_seeds(str(tasks.seed) if tasks.seed is not None else "0,1234,1234,1234")
    return Plan(
        seeds=seeds, limit=limit, num_fewshot=tasks.num_fewshot, batch_size=str(batch_size), log_samples=True,  # per-document values
        apply_chat_template=tasks.apply_chat_template, gen_kwargs=tasks.gen_kwargs, manager=manager, names=list(tasks.names),
    )  # fmt: skip


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep file against its model, vectors, tasks and prompt sets; starts no worker."""
    from worker.load import ModelLoadError, context_window

    from driver.judge import prompting  # (driver.judge's modules read driver.sweep's)
    from driver.judge.rate import check_judge

    from driver.lm.model_setup import model_config
    from driver.steering.spec import model_shape

    path = Path(path).expanduser()
    where = str(path)
    spec = read_sweep_file(path)
    base = path.absolute().parent
    m = spec.model
    pretrained = _resolve_model(m.pretrained, base)
    try:
        config = model_config(pretrained, m.revision)
    except (OSError, ValueError, ModelLoadError) as e:
        raise SweepError(one_line(f"{where}: model.pretrained: cannot read the model's config.json ({e})")) from None
    shape = model_shape(config)
    if shape[0] is None:
        raise SweepError(f"{where}: model.pretrained: the model's config.json does not give its number of layers")
    layers = _layers(spec.grid, shape[0], where)
    heads = _heads(spec.grid, head_shape(config)[0], where)
    nonempty(spec.grid, where)
    c = spec.condition
    condition = None if c is None else {**c.model_dump(mode="json"), "threshold": spec.grid.thresholds[0]}
    model = Model(config, m.dtype, shape[0], shape[1], condition)
    grid = functools.partial(grid_configs, spec, layers, heads, model, base, where, loaded={})  # each vector read once
    expand = lambda chosen: grid(chosen) + prompting.configs(spec.prompting)  # noqa: E731 (the baselines last)
    configs = expand({})
    tops = _tops(spec, layers, model, base, where)
    window = context_window(config, m.max_length)
    prompt_sets: dict[str, tuple[PromptSet, list[Prompt]]] = {}
    for i, ps in enumerate(spec.prompts):
        name = ps.name or Path(ps.file).stem
        if not NAME.match(name):
            raise SweepError(f"{where}: prompts[{i}].name: {name!r}: use letters, digits, '_' and '-'")
        if name in prompt_sets or (spec.tasks is not None and name in spec.tasks.names):
            raise SweepError(f"{where}: prompts[{i}].name: {name!r} is used twice; give each prompt set its own name")
        if ps.generate and ps.max_gen_toks >= window:
            raise SweepError(f"{where}: prompts[{i}].max_gen_toks: {ps.max_gen_toks} must be less than the context window ({window})")
        prompt_sets[name] = (ps, read_prompts(base / Path(ps.file).expanduser(), where))
    plan = _plan(spec.tasks, base, where, m.batch_size) if spec.tasks is not None else None
    args = {k: v for k, v in m.model_dump().items() if v is not None and k not in ("threads", "group_size", "split")}
    args["pretrained"] = pretrained
    if m.adapter_path is not None:
        args["adapter_path"] = str((base / Path(m.adapter_path).expanduser()).resolve())
    if m.threads is not None:
        args["threads"] = m.threads
    return Sweep(path, spec, args, shape[0], configs, prompt_sets, plan, tops, expand, judge=check_judge(spec, base, where))
