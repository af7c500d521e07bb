"""The plan of a sweep: its file checked against the model, vectors, tasks and prompt sets, and every configuration."""

from __future__ import annotations

import difflib
import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from worker.spec import HEAD_SITES, NO_STEERING, Intervention, Steering, head_shape

from driver.steering.userfiles import jsonl_lines
from driver.sweep.rows import BASELINE
from driver.sweep.schema import NAME, Grid, PromptSet, SweepError, SweepFile, Tasks, VectorSource, one_line, read_sweep_file

__all__ = ["Config", "Prompt", "Sweep", "BASELINE", "load_sweep", "read_prompts"]

_DIRECTIONLESS = ("ablate", "clamp")  # ops that need a nonzero vector
_IDENTITY_AT_ZERO = ("add", "replace")  # ops for which alpha 0 is the unsteered model


@dataclass(frozen=True)
class Config:
    """One steering configuration of the grid (the baseline: every field None, no interventions)."""

    id: str
    steering: Steering
    vector: str | None = None
    site: str | None = None
    layer: int | None = None
    op: str | None = None
    positions: str | None = None
    alpha: float | None = None  # None: the baseline, or an op that takes no alpha (ablate)
    record: dict | None = None  # what goes into lm-eval's results JSON (config.orchard.steering)
    head: int | None = None  # the attention head, at a head site (attn_head)

    @property
    def fields(self) -> dict:
        return {"config": self.id, "vector": self.vector, "layer": self.layer, "site": self.site, "head": self.head,
                "op": self.op, "positions": self.positions, "alpha": 0.0 if self.id == BASELINE else self.alpha}  # fmt: skip


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

    @property
    def grid(self) -> list[Config]:
        return self.configs[1:]


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


@dataclass(frozen=True)
class _Model:
    """What the vectors are checked against: the model's config.json, its dtype setting, its layer count."""

    config: dict
    dtype: str | None
    n_layers: int


def _vector_file(name: str, source: VectorSource, layer: int, n_layers: int, where: str) -> tuple[str, str]:
    """(file, label) of a vector source at one layer: its file, or its `layers:` entry for that layer."""
    label = f"vectors.{name}"
    if source.layers is None:
        return source.file, label
    file = source.layers.get(layer)
    if file is None:
        negative = {k % n_layers: f for k, f in source.layers.items() if -n_layers <= k < n_layers}
        file = negative.get(layer)
    if file is None:
        listed = ", ".join(map(str, sorted(source.layers)))
        raise SweepError(f"{where}: {label}.layers: no vector for layer {layer} (it has layers {listed}); add one or drop the layer from grid.layers")
    return file, f"{label}.layers.{layer}"


def _vector_ref(name: str, source: VectorSource, at: tuple, n_layers: int, where: str) -> tuple[str, dict]:
    """(label, the spec's `vector:`) of a vector source at `at` = (site, layer, head)."""
    site, layer, head = at
    if source.sae is not None:  # one feature: the plan's expansion leaves one per source
        return f"vectors.{name}", {"sae": source.sae, "feature": source.features[0]}
    file, label = _vector_file(name, source, layer, n_layers, where)
    ref: dict = {"file": file}
    if file.lower().endswith(".safetensors"):
        default = "{site}.{layer}.{head}" if head is not None else "{site}.{layer}"  # as `driver vectors` keys them
        ref["key"] = (source.key or default).format(site=site, layer=layer, head=head)
    elif source.key is not None and source.file is not None:
        raise SweepError(f"{where}: {label}.key: `key` applies only to .safetensors files; remove it")
    return label, ref


def _load_vector(name: str, source: VectorSource, at: tuple, ops: Sequence[str], model: _Model, base: Path, where: str):
    """The checked `Intervention` (alpha 1, op add) for one vector at `at` = (site, layer, head), and its record;
    checked as `driver run` checks a spec (driver.steering.spec.for_model): shape, dtype, the sites the model has."""
    from driver.steering.spec import SteeringError, for_model

    site, layer, head = at
    label, ref = _vector_ref(name, source, at, model.n_layers, where)
    # checked as add writes it (in the model's dtype) when an op writes v itself, and for a direction (a zero
    # vector refused naming the op) when an op needs one: ablate, clamp
    directionless = next((op for op in ops if op in _DIRECTIONLESS), None)
    checked_as = "add" if directionless is None or any(op not in _DIRECTIONLESS for op in ops) else directionless
    iv = {"layer": layer, "site": site, "op": checked_as, "vector": ref, "normalize": source.normalize}
    spec = {"interventions": [iv if head is None else {**iv, "head": head}]}
    try:
        loaded = for_model(spec, model.config, model.dtype, base)
    except SteeringError as e:
        text = str(e).removeprefix("steering spec (dict): ")
        for prefix in ("interventions[0].vector", "interventions[0]"):
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        text = re.sub(r"^\.(file|key)", lambda m: "" if source.layers is not None else m.group(0), text)
        text = text.replace("interventions[0].", "")
        at_head = "" if head is None else f", head {head}"
        raise SweepError(one_line(f"{where}: {label}{text} (layer {layer}, site {site}{at_head})")) from None
    first = loaded.steering.interventions[0]
    if directionless and not any(first.vector):
        at_head = "" if head is None else f", head {head}"
        raise SweepError(f"{where}: {label}: is all zeros, so it has no direction for op {directionless}: use a nonzero "
                         f"vector (layer {layer}, site {site}{at_head})")  # fmt: skip
    return first.model_copy(update={"op": "add"}), loaded.record["vectors"][0]


def _fmt_alpha(alpha: float) -> str:
    return f"{alpha:+g}"


def _steering(iv: Intervention, where: str) -> Steering:
    """One configuration's steering, validated as the worker will (e.g. alpha·v finite in float32)."""
    try:
        return Steering(interventions=(iv,))
    except ValidationError as e:
        raise SweepError(one_line(f"{where}: {e.errors()[0]['msg'].removeprefix('Value error, ')}")) from None


def _vector_names(spec: SweepFile, where: str) -> list[str]:
    g = spec.grid
    names = list(g.vectors) if g.vectors is not None else list(spec.vectors)
    unknown = [n for n in names if n not in spec.vectors]
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(spec.vectors), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SweepError(f"{where}: grid.vectors: no vector named {unknown[0]!r} ({hint}the file has: {', '.join(spec.vectors)})")
    return [f"{n}-f{f}" if spec.vectors[n].sae is not None else n for n in names for f in (spec.vectors[n].features or (None,))]


def _source(spec: SweepFile, name: str) -> VectorSource:
    """The source of a vector name; NAME-fN is feature N of the SAE source NAME (the features axis)."""
    base, _, feature = name.rpartition("-f")
    if name not in spec.vectors and base in spec.vectors and spec.vectors[base].sae is not None:
        return spec.vectors[base].model_copy(update={"features": (int(feature),)})
    return spec.vectors[name]


def _config(name: str, at: tuple, op: str, positions: str, alpha: float | None, loaded: tuple, where: str) -> Config:
    """One configuration: the vector `name` at `at` = (site, layer, head), as `loaded` (its Intervention, record)."""
    (site, layer, head), (base_iv, vrecord) = at, loaded
    iv: Intervention = base_iv.model_copy(update={"op": op, "positions": positions, "alpha": 1.0 if alpha is None else float(alpha)})
    at_head = "" if head is None else f" head {head},"
    steering = _steering(iv, f"{where}: grid.alphas: {alpha:g} (vector {name}, layer {layer}, {site},{at_head} {op})")
    cid = f"{name}.{site}.L{layer}" + ("" if head is None else f".h{head}") + f".{op}.{positions}"
    cid += "" if alpha is None else f".a{_fmt_alpha(alpha)}"
    written = {"layer": layer, "site": site, **({} if head is None else {"head": head}), "op": op, "positions": positions,
               "alpha": iv.alpha, "normalize": iv.normalize,
               "vector": {"source": name, **{k: vrecord[k] for k in ("path", "key")}}}  # fmt: skip
    record = {"source": str(Path(where).absolute()), "sweep_config": cid, "spec": {"interventions": [written]},
              "vectors": [vrecord], "key": steering.key(), "resolved_layers": [layer]}  # fmt: skip
    return Config(cid, steering, name, site, layer, op, positions, alpha, record, head)


def _configs(spec: SweepFile, layers: list[int], heads: list[int], model: _Model, base: Path, where: str) -> list[Config]:
    """The baseline, then every configuration of the grid (heads innermost, at a head site only)."""
    g = spec.grid
    configs = [Config(BASELINE, NO_STEERING)]
    loaded: dict[tuple, tuple[Intervention, dict]] = {}
    for name, site, op, positions, layer in itertools.product(_vector_names(spec, where), g.sites, g.ops, g.positions, layers):
        for head in heads if site in HEAD_SITES else [None]:
            at = (site, layer, head)
            if (name, at) not in loaded:  # each vector read and checked once, whatever the ops and positions
                loaded[(name, at)] = _load_vector(name, _source(spec, name), at, g.ops, model, base, where)
            alphas = [None] if op == "ablate" else [a for a in g.alphas if not (a == 0 and op in _IDENTITY_AT_ZERO)]
            configs += [_config(name, at, op, positions, alpha, loaded[(name, at)], where) for alpha in alphas]
    if len(configs) == 1:
        raise SweepError(
            f"{where}: grid: empty (every alpha is 0, which is the baseline for ops {', '.join(_IDENTITY_AT_ZERO)}): "
            "list nonzero alphas"
        )
    return configs


def read_prompts(path: Path, where: str) -> list[Prompt]:
    """A prompt set: one {"prompt": str, optional "targets": {name: str}} per line; blank lines skipped."""
    prompts: list[Prompt] = []
    missing, folder = f"{where}: prompts: {path} does not exist", f"{where}: prompts: {path} is a folder, not a JSONL file"
    for n, obj in jsonl_lines(path, SweepError, missing, folder):
        at = f"{path}: line {n}"
        if not isinstance(obj, dict):
            raise SweepError(f"{at}: expected a JSON object with a \"prompt\", got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"prompt", "targets"})
        if unknown:
            raise SweepError(f"{at}: unknown field {unknown[0]!r} (allowed: prompt, targets)")
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


_MANAGERS: dict[str | None, Any] = {}


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

    from lm_eval.tasks import TaskManager

    from driver.lm.evaluation import Plan, parse_seeds

    if include not in _MANAGERS:  # indexing lm-eval's tasks takes seconds: once per process and folder
        _MANAGERS[include] = TaskManager(include_path=include)
    manager = _MANAGERS[include]
    unknown = [t for t in tasks.names if not manager.match_tasks([t])]
    if unknown:
        raise SweepError(
            f"{where}: tasks.names: unknown task {unknown[0]!r} (list tasks with `lm_eval ls tasks`, or give tasks.include_path)"
        )
    limit = tasks.limit if tasks.limit is None or tasks.limit < 1 else int(tasks.limit)
    seeds = parse_seeds(str(tasks.seed) if tasks.seed is not None else "0,1234,1234,1234")
    return Plan(
        seeds=seeds, limit=limit, num_fewshot=tasks.num_fewshot, batch_size=str(batch_size),
        apply_chat_template=tasks.apply_chat_template, gen_kwargs=tasks.gen_kwargs, manager=manager, names=list(tasks.names),
    )  # fmt: skip


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep file against its model, vectors, tasks and prompt sets; starts no worker."""
    from worker.load import ModelLoadError, context_window

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
    configs = _configs(spec, layers, heads, _Model(config, m.dtype, shape[0]), base, where)
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
    return Sweep(path, spec, args, shape[0], configs, prompt_sets, plan)
