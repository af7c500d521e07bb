"""Steering sweeps: a grid of steering configurations (vector × site × layer × op × positions × alpha),
each evaluated on lm-eval tasks and/or a prompt set, on workers that load the model once for the whole grid.

```yaml
model: {pretrained: ../stories260K, max_length: 256, batch_size: 16}
vectors:
  happy: {file: happy.safetensors}          # from `driver vectors`; the key for layer L is "{site}.{L}"
  other: {layers: {0: v0.npy, 3: v3.npy}}    # or one file per layer
grid:
  layers: all                               # or [1, 2, -1]
  alphas: [-8, -4, 4, 8]                    # alpha 0 (the baseline) is implied, computed once
  ops: [add]                                # add | replace | ablate | clamp
  positions: [all]                          # all | prompt | continuation | last
  sites: [resid_post]                       # resid_pre | resid_post
tasks: {names: [hellaswag], limit: 100, num_fewshot: 0}
prompts:
  - {file: prompts.jsonl, max_gen_toks: 32}   # {"prompt": ..., "targets": {"positive": " happy", "negative": " sad"}}
```

How a sweep runs (`run`): everything in the file is checked first (`load_sweep`: the schema, the model's
shape, every vector, the tasks, the prompt set), before any worker starts or any output is written. Then one
`mlx-ray` model is opened (the model loads once per worker) with its result cache under the output folder:

1. lm-eval runs once, unsteered (the baseline); the token-level requests it sends are recorded.
2. The executor's `run_grid` computes every (configuration, request) cell of those requests and of the prompt
   set's requests (target log-probabilities, generations) in one chunked dispatch per request kind, each cell
   cached as it arrives under the key a per-configuration `run` uses: a rerun computes only what is missing.
3. lm-eval runs once per configuration with that steering, its requests answered from step 2, for lm-eval's
   own metrics (driver.sweep.replay).
4. The unsteered model scores every configuration's generations (driver.sweep.fluency), through the same grid.

A configuration whose scores are non-finite is set aside (driver.sweep.grid) and recorded as failed cells
(driver.sweep.rows), never as numbers.

`driver.sweep.report` turns the rows into the output folder's tables, summary and plots.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from worker.spec import NO_STEERING, Intervention, Steering

from driver.sweep import fluency
from driver.sweep.grid import run_grids
from driver.sweep.replay import Recorder, lm_eval_per_config, swapped_executor
from driver.sweep.rows import PROMPT_HIGHER, Outcome, add_deltas, lm_eval_failure, lm_eval_rows, prompt_rows
from driver.sweep.targets import count_long, truncated, unequal_lengths
from driver.sweep.targets import score as target_score
from driver.steering.userfiles import explain, jsonl_lines, short

__all__ = ["SweepError", "SweepFile", "Sweep", "Config", "Prompt", "load_sweep", "run"]

_IDENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_DIRECTIONLESS = ("ablate", "clamp")  # ops that need a nonzero vector
_IDENTITY_AT_ZERO = ("add", "replace")  # ops for which alpha 0 is the unsteered model


class SweepError(ValueError):
    """A sweep file that cannot run; the message is one line naming the file, the field (or line) and the fix."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# --- the file's schema ---------------------------------------------------------------------------------------

_Frozen = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelSettings(BaseModel):
    """The model and its settings, as `driver run` takes them (`model: PATH` is short for `{pretrained: PATH}`)."""

    model_config = _Frozen

    pretrained: str
    max_length: StrictInt | None = Field(default=None, gt=1)
    batch_size: StrictInt = Field(default=32, ge=1)
    max_batch_tokens: StrictInt = Field(default=8192, ge=1)
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    revision: str | None = None
    adapter_path: str | None = None
    prefix_reuse: StrictBool = True
    max_gen_toks: StrictInt = Field(default=256, ge=1)
    trust_remote_code: StrictBool = False
    threads: StrictInt | None = Field(default=None, ge=1)


class VectorSource(BaseModel):
    """One steering direction per layer: a `driver vectors` .safetensors file (`key` is a template, by default
    "{site}.{layer}"), or `layers: {L: file}` with a .npy (or .safetensors) per layer."""

    model_config = _Frozen

    file: str | None = None
    key: str | None = None
    layers: dict[StrictInt, str] | None = None
    normalize: StrictBool = False

    @model_validator(mode="after")
    def _one_source(self) -> VectorSource:
        if (self.file is None) == (self.layers is None):
            raise ValueError("give exactly one of `file:` (a .safetensors from `driver vectors`) or `layers: {L: file}`")
        if self.layers is not None and not self.layers:
            raise ValueError("`layers:` is empty: map each layer to its vector file")
        if self.key is not None:
            try:
                self.key.format(site="resid_post", layer=0)
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"key {self.key!r}: use a template with {{site}} and {{layer}}, e.g. '{{site}}.{{layer}}'") from None
        return self


def _listify(v: Any) -> Any:
    return [v] if isinstance(v, (str, int, float)) and not isinstance(v, bool) else v


class Grid(BaseModel):
    """The configurations: every combination of vectors × sites × layers × ops × positions × alphas."""

    model_config = _Frozen

    layers: Union[Literal["all"], tuple[StrictInt, ...]]
    alphas: tuple[Annotated[float, Field(strict=True, allow_inf_nan=False)], ...]
    ops: tuple[Literal["add", "replace", "ablate", "clamp"], ...] = ("add",)
    positions: tuple[Literal["all", "prompt", "continuation", "last"], ...] = ("all",)
    sites: tuple[Literal["resid_pre", "resid_post"], ...] = ("resid_post",)
    vectors: tuple[str, ...] | None = None  # default: every vector of the file

    @field_validator("layers", "alphas", "ops", "positions", "sites", "vectors", mode="before")
    @classmethod
    def _scalar_is_a_list(cls, v: Any, info) -> Any:
        if v == "all" or (info.field_name == "layers" and isinstance(v, str)):
            return v
        return _listify(v)

    @field_validator("ops", "positions", "sites", "vectors", "layers", "alphas")
    @classmethod
    def _nonempty_unique(cls, v: Any) -> Any:
        if v == "all" or v is None:
            return v
        if not v:
            raise ValueError("is empty: list at least one value")
        seen = [x for i, x in enumerate(v) if x in v[:i]]
        if seen:
            raise ValueError(f"{seen[0]!r} is listed twice")
        return v


class Tasks(BaseModel):
    """lm-eval tasks, evaluated once per configuration (lm-eval's own metrics)."""

    model_config = _Frozen

    names: tuple[str, ...]
    limit: Annotated[float, Field(gt=0)] | None = None
    num_fewshot: StrictInt | None = Field(default=None, ge=0)
    include_path: str | None = None
    gen_kwargs: str | None = None
    apply_chat_template: StrictBool = False
    seed: StrictInt | None = None  # one seed for python, numpy, torch and few-shot sampling (lm-eval's defaults if unset)

    @field_validator("names", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @field_validator("names")
    @classmethod
    def _nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("is empty: name at least one lm-eval task")
        return v


class PromptSet(BaseModel):
    """A JSONL of {"prompt": ..., optional "targets": {name: continuation}}: generations per configuration and,
    where a prompt has targets, each target's log-probability (and positive − negative, the behaviour score)."""

    model_config = _Frozen

    file: str
    name: str | None = None  # default: the file's stem
    generate: StrictBool = True
    max_gen_toks: StrictInt = Field(default=64, ge=1)
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    seed: StrictInt = 0  # with temperature > 0: each (prompt, seed) draws the same sample on any worker
    until: tuple[str, ...] = ()
    # a target's summed log-prob (its whole probability), or its mean per token; unset: sum, with a warning
    # when a prompt's targets differ in token length
    target_score: Literal["sum", "mean"] | None = None

    @field_validator("until", mode="before")
    @classmethod
    def _until(cls, v: Any) -> Any:
        return _listify(v)


class SweepFile(BaseModel):
    """The whole sweep file."""

    model_config = _Frozen

    model: ModelSettings
    vectors: dict[str, VectorSource]
    grid: Grid
    tasks: Tasks | None = None
    prompts: tuple[PromptSet, ...] = ()

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> Any:
        return {"pretrained": v} if isinstance(v, (str, os.PathLike)) else v

    @field_validator("vectors", mode="before")
    @classmethod
    def _vectors(cls, v: Any) -> Any:
        if isinstance(v, (str, os.PathLike)):  # one file: named by its stem
            v = {Path(v).stem: v}
        if isinstance(v, Mapping):
            return {k: ({"file": os.fspath(s)} if isinstance(s, (str, os.PathLike)) else s) for k, s in v.items()}
        return v

    @field_validator("vectors")
    @classmethod
    def _vector_names(cls, v: dict) -> dict:
        if not v:
            raise ValueError("is empty: name at least one vector source")
        bad = [k for k in v if not _IDENT.match(k)]
        if bad:
            raise ValueError(f"name {bad[0]!r}: use letters, digits, '_' and '-'")
        return v

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if v is None:
            return ()
        if isinstance(v, (str, os.PathLike)):
            return [{"file": os.fspath(v)}]
        return [v] if isinstance(v, Mapping) else v

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> SweepFile:
        if self.tasks is None and not self.prompts:
            raise ValueError("nothing to evaluate: give `tasks:` (lm-eval tasks), `prompts:` (a prompt set), or both")
        return self


# --- pydantic errors as one line ---------------------------------------------------------------------------

_MODELS = {"": SweepFile, "model": ModelSettings, "grid": Grid, "tasks": Tasks, "prompts": PromptSet, "vectors": VectorSource}


def _is_tag(part: Any) -> bool:
    """Union members and validators that pydantic puts in an error's location."""
    return isinstance(part, str) and part.startswith(("function-", "literal[", "tuple[", "union["))


def _loc(loc: Sequence) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += f".{part}" if out else str(part)
    return out


def _explain(err: dict) -> str:
    kind, loc, value = err["type"], [p for p in err["loc"] if not _is_tag(p)], err.get("input")
    if kind == "missing":
        return "missing (this field is required)"
    if kind == "extra_forbidden":
        top = str(loc[0]) if len(loc) > 1 else ""
        model = _MODELS.get(top, SweepFile) if top != "vectors" or len(loc) > 2 else SweepFile
        allowed = list(model.model_fields)
        near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        return f"unknown field ({'did you mean ' + repr(near[0]) + '? ' if near else ''}allowed: {', '.join(allowed)})"
    if kind == "literal_error":
        return f"{short(value)} is not allowed ({err['msg'].replace('Input should be ', 'use ')})"
    return explain(err)


def _validate(data: Any, where: str) -> SweepFile:
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SweepError(f"{where}: the sweep file is {kind}; it must be a mapping with model, vectors, grid and tasks/prompts")
    try:
        return SweepFile.model_validate(dict(data))
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda err: (err["type"] != "extra_forbidden", err["type"] == "missing"))
        first = errors[0]
        if first["type"] == "literal_error" and first["loc"][:1] == ("grid",) and first["loc"][1:2] == ("layers",):
            first = {**first, "type": "value_error", "msg": f"{first['input']!r}: give a list of layers or 'all'"}
        more = f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
        path = _loc(first["loc"])
        raise SweepError(_one_line(f"{where}: {path + ': ' if path else ''}{_explain(first)}{more}")) from None


def _read_yaml(path: Path) -> Any:
    import yaml

    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise SweepError(f"{path}: not a sweep file: use a .yaml, .yml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SweepError(f"{path}: no such file (check the path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(_one_line(f"{path}: cannot read the file ({type(e).__name__}: {e})")) from None
    from driver.steering.userfiles import load_yaml, yaml_problem

    try:
        return load_yaml(text)  # JSON is YAML; a key given twice is refused, naming its lines
    except yaml.YAMLError as e:
        raise SweepError(_one_line(f"{path}: {yaml_problem(e)}")) from None


# --- the resolved sweep ---------------------------------------------------------------------------------------


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

    @property
    def fields(self) -> dict:
        return {"config": self.id, "vector": self.vector, "layer": self.layer, "site": self.site, "op": self.op,
                "positions": self.positions, "alpha": 0.0 if self.id == BASELINE else self.alpha}  # fmt: skip


BASELINE = "baseline"


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
    plan: Any = None  # cli.Plan for the lm-eval tasks, or None

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


def _load_vector(name: str, source: VectorSource, site: str, layer: int, directionless: bool, shape, base: Path, where: str):
    """The checked `Intervention` (alpha 1, op add) for one vector at one site and layer, and its record."""
    from driver.steering.spec import SteeringError, check, load_steering

    label = f"vectors.{name}"
    if source.layers is not None:
        file = source.layers.get(layer)
        if file is None:
            negative = {k % shape[0]: f for k, f in source.layers.items() if -shape[0] <= k < shape[0]}
            file = negative.get(layer)
        if file is None:
            listed = ", ".join(map(str, sorted(source.layers)))
            raise SweepError(f"{where}: {label}.layers: no vector for layer {layer} (it has layers {listed}); add one or drop the layer from grid.layers")
        label += f".layers.{layer}"
    else:
        file = source.file
    ref: dict = {"file": file}
    if file.lower().endswith(".safetensors"):
        ref["key"] = (source.key or "{site}.{layer}").format(site=site, layer=layer)
    elif source.key is not None and source.file is not None:
        raise SweepError(f"{where}: {label}.key: `key` applies only to .safetensors files; remove it")
    spec = {"interventions": [{"layer": layer, "site": site, "op": "ablate" if directionless else "add",
                               "vector": ref, "normalize": source.normalize}]}  # fmt: skip
    try:
        loaded = load_steering(spec, base_dir=base)
        steering = check(loaded.steering, *shape)
    except SteeringError as e:
        text = str(e)
        for prefix in ("steering spec (dict): interventions[0].vector", "steering spec (dict): interventions[0]", "steering spec (dict)"):
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        text = re.sub(r"^\.(file|key)", lambda m: "" if source.layers is not None else m.group(0), text)
        text = text.replace("interventions[0].", "")
        raise SweepError(_one_line(f"{where}: {label}{text} (layer {layer}, site {site})")) from None
    return steering.interventions[0].model_copy(update={"op": "add"}), loaded.record["vectors"][0]


def _fmt_alpha(alpha: float) -> str:
    return f"{alpha:+g}"


def _steering(iv: Intervention, where: str) -> Steering:
    """One configuration's steering, validated as the worker will (e.g. alpha·v finite in float32)."""
    try:
        return Steering(interventions=(iv,))
    except ValidationError as e:
        raise SweepError(_one_line(f"{where}: {e.errors()[0]['msg'].removeprefix('Value error, ')}")) from None


def _configs(spec: SweepFile, layers: list[int], shape, base: Path, where: str) -> list[Config]:
    g = spec.grid
    names = list(g.vectors) if g.vectors is not None else list(spec.vectors)
    unknown = [n for n in names if n not in spec.vectors]
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(spec.vectors), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SweepError(f"{where}: grid.vectors: no vector named {unknown[0]!r} ({hint}the file has: {', '.join(spec.vectors)})")
    directionless = any(op in _DIRECTIONLESS for op in g.ops)
    configs = [Config(BASELINE, NO_STEERING)]
    loaded: dict[tuple[str, str, int], tuple[Intervention, dict]] = {}
    for name, site, op, positions, layer in itertools.product(names, g.sites, g.ops, g.positions, layers):
        if (name, site, layer) not in loaded:  # each vector read and checked once, whatever the ops and positions
            loaded[(name, site, layer)] = _load_vector(name, spec.vectors[name], site, layer, directionless, shape, base, where)
        base_iv, vrecord = loaded[(name, site, layer)]
        if op == "ablate":
            alphas: list[float | None] = [None]  # ablate takes no alpha: one configuration
        else:
            alphas = [a for a in g.alphas if not (a == 0 and op in _IDENTITY_AT_ZERO)]  # alpha 0: the baseline
        for alpha in alphas:
            iv: Intervention = base_iv.model_copy(update={"op": op, "positions": positions, "alpha": 1.0 if alpha is None else float(alpha)})
            steering = _steering(iv, f"{where}: grid.alphas: {alpha:g} (vector {name}, layer {layer}, {site}, {op})")
            cid = f"{name}.{site}.L{layer}.{op}.{positions}" + ("" if alpha is None else f".a{_fmt_alpha(alpha)}")
            written = {"layer": layer, "site": site, "op": op, "positions": positions, "alpha": iv.alpha, "normalize": iv.normalize,
                       "vector": {"source": name, **{k: vrecord[k] for k in ("path", "key")}}}  # fmt: skip
            record = {"source": str(Path(where).absolute()), "sweep_config": cid, "spec": {"interventions": [written]},
                      "vectors": [vrecord], "key": steering.key(), "resolved_layers": [layer]}  # fmt: skip
            configs.append(Config(cid, steering, name, site, layer, op, positions, alpha, record))
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
            if not _IDENT.match(name):
                raise SweepError(f"{at}: target name {name!r}: use letters, digits, '_' and '-'")
            if not isinstance(target, str) or not target:
                raise SweepError(f"{at}: target {name!r} must be a non-empty string")
        prompts.append(Prompt(prompt, dict(targets), n))
    if not prompts:
        raise SweepError(f"{path}: no prompts (the file is empty): write one JSON object per line")
    return prompts


_MANAGERS: dict[str | None, Any] = {}


def _check_task_names(names: Sequence[str], include: str | None, where: str) -> None:
    from driver.checks.preflight import BadUsage, Refused, check_tasks

    for name in names:
        try:
            check_tasks(name, include)
        except (BadUsage, Refused):
            raise SweepError(
                f"{where}: tasks.names: unknown task {name!r} (list tasks with `lm_eval ls tasks`, or give tasks.include_path)"
            ) from None


def _plan(tasks: Tasks, base: Path, where: str, batch_size: int):
    include = None
    if tasks.include_path is not None:
        include = str((base / Path(tasks.include_path).expanduser()).resolve())
        if not Path(include).is_dir():
            raise SweepError(f"{where}: tasks.include_path: {include} is not a folder of task YAMLs")
    _check_task_names(tasks.names, include, where)  # as fast as `driver run`'s check, before lm-eval's index

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

    from driver.lm.mlx import model_config
    from driver.steering.spec import model_shape

    path = Path(path).expanduser()
    where = str(path)
    spec = _validate(_read_yaml(path), where)
    base = path.absolute().parent
    m = spec.model
    pretrained = _resolve_model(m.pretrained, base)
    try:
        config = model_config(pretrained, m.revision)
    except (OSError, ValueError, ModelLoadError) as e:
        raise SweepError(_one_line(f"{where}: model.pretrained: cannot read the model's config.json ({e})")) from None
    shape = model_shape(config)
    if shape[0] is None:
        raise SweepError(f"{where}: model.pretrained: the model's config.json does not give its number of layers")
    layers = _layers(spec.grid, shape[0], where)
    configs = _configs(spec, layers, shape, base, where)
    window = context_window(config, m.max_length)
    prompt_sets: dict[str, tuple[PromptSet, list[Prompt]]] = {}
    for i, ps in enumerate(spec.prompts):
        name = ps.name or Path(ps.file).stem
        if not _IDENT.match(name):
            raise SweepError(f"{where}: prompts[{i}].name: {name!r}: use letters, digits, '_' and '-'")
        if name in prompt_sets or (spec.tasks is not None and name in spec.tasks.names):
            raise SweepError(f"{where}: prompts[{i}].name: {name!r} is used twice; give each prompt set its own name")
        if ps.generate and ps.max_gen_toks >= window:
            raise SweepError(f"{where}: prompts[{i}].max_gen_toks: {ps.max_gen_toks} must be less than the context window ({window})")
        prompt_sets[name] = (ps, read_prompts(base / Path(ps.file).expanduser(), where))
    plan = _plan(spec.tasks, base, where, m.batch_size) if spec.tasks is not None else None
    args = {k: v for k, v in m.model_dump().items() if v is not None and k != "threads"}
    args["pretrained"] = pretrained
    if m.adapter_path is not None:
        args["adapter_path"] = str((base / Path(m.adapter_path).expanduser()).resolve())
    if m.threads is not None:
        args["threads"] = m.threads
    return Sweep(path, spec, args, shape[0], configs, prompt_sets, plan)


# --- running it -----------------------------------------------------------------------------------------------


def _encode_target(lm, context: str, continuation: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """lm-eval's tokenization of a (context, continuation) pair (TemplateLM.loglikelihood)."""
    ctx, cont = lm._encode_pair(context, continuation)
    return tuple(ctx), tuple(cont)


def _prompt_requests(lm, sweep: Sweep) -> tuple[list, list, list, list]:
    """The prompt sets' requests: (targets [(set, prompt index, target, tokens)], their token pairs, gens [(set,
    prompt index)], their generation requests), with one warning per set for unequal targets and truncation."""
    targets, pairs, gens, gen_requests = [], [], [], []
    for name, (ps, prompts) in sweep.prompt_sets.items():
        lengths, long_prompts, first = [], 0, len(pairs)
        for i, p in enumerate(prompts):
            lengths.append({})
            for t, continuation in p.targets.items():
                pairs.append(_encode_target(lm, p.text, continuation))
                targets.append((name, i, t, len(pairs[-1][1])))
                lengths[-1][t] = (continuation, len(pairs[-1][1]))
            if ps.generate:
                gen_kwargs = {"until": list(ps.until), "max_gen_toks": ps.max_gen_toks, "temperature": ps.temperature,
                              "do_sample": ps.temperature > 0}  # fmt: skip
                gens.append((name, i))
                gen_requests.append(lm.generation_request(p.text, gen_kwargs, ps.seed))
                long_prompts += len(gen_requests[-1].context) < len(lm.tok_encode(p.text))
        unequal_lengths(name, lengths, ps.target_score)
        truncated(name, count_long(pairs[first:], lm.max_length), long_prompts, len(prompts), lm.max_length)
    return targets, pairs, gens, gen_requests


def run(sweep: Sweep, *, workers: str = "all", address: str | None = None, output: Path, cache: str | None = None,
        threads: int | None = None, stage: bool = False, echo=print) -> Outcome:  # fmt: skip
    """Run a checked sweep on one `mlx-ray` model; returns the rows (nothing is written here but the cache
    and lm-eval's results JSON per configuration)."""
    from driver.lm.evaluation import evaluate, open_model

    start = time.monotonic()
    args = {**sweep.model_args, "workers": workers, "cache": cache or str(output / "cache"), "stage": stage}
    for name, value in (("address", address), ("threads", threads)):
        if value is not None:
            args[name] = value
    configs, steerings = sweep.configs, [c.steering for c in sweep.configs]
    lm = open_model(args)
    try:
        placed = lm.executor.info()["workers"]  # none yet when the cache holds this model's results
        echo(f"sweep: {len(configs) - 1} configuration{'s' * (len(configs) != 2)} + the baseline" + (f" on {placed} worker{'s' * (placed != 1)}" if placed else ""))
        # 1. lm-eval, unsteered: the baseline's metrics, and the requests every configuration sends
        calls: list = []
        results: dict[str, dict] = {}
        if sweep.plan is not None:
            recorder = Recorder(lm.executor)
            with swapped_executor(lm, recorder):
                results[BASELINE] = evaluate(lm, args, sweep.plan, str(output)).results
            calls = recorder.calls
        # 2. every (configuration, request) cell, one dispatch per request kind
        wanted: dict[str, list] = {"loglikelihood": [], "generate": []}
        for kind, requests in calls:
            wanted[kind].extend(requests)
        targets, target_pairs, gens, gen_requests = _prompt_requests(lm, sweep)
        wanted["loglikelihood"] += target_pairs
        wanted["generate"] += gen_requests
        answers, failed = run_grids(lm.executor, steerings, wanted, echo)  # a non-finite configuration is set aside
        # 3. lm-eval per configuration, answered from the grid
        if sweep.plan is not None:
            lm_eval_per_config(lm, args, sweep, calls, answers, results, output, echo, failed)
        # 4. the unsteered model's log-likelihood of every configuration's generations (their fluency)
        texts = _texts(sweep, configs, answers, gens, calls)
        scores = fluency.baseline_scores(lm.executor, lambda p, t: _encode_target(lm, p, t), [x for ts in texts for x in ts])
        info = lm.executor.info()
    finally:
        lm.executor.close()
    return _outcome(sweep, results, answers, targets, gens, calls, (texts, scores, failed), info, time.monotonic() - start)


def _texts(sweep, configs, answers, gens, calls) -> list[list[tuple[str, str]]]:
    """[configuration][generation] (prompt, generated text) of the prompt sets."""
    skip = sum(len(r) for k, r in calls if k == "generate")
    return [[(sweep.prompt_sets[s][1][i].text, answers["generate"][c][skip + j]) for j, (s, i) in enumerate(gens)]
            for c in range(len(configs))]  # fmt: skip


def _outcome(sweep, results, answers, targets, gens, calls, generated, info, seconds) -> Outcome:
    texts, scores, failed = generated
    rows, generations, better = [], [], {}
    n_task_ll = sum(len(r) for k, r in calls if k == "loglikelihood")
    for c, config in enumerate(sweep.configs):
        if sweep.plan is not None:
            why = (lm_eval_failure(answers["loglikelihood"][c][:n_task_ll]) if n_task_ll else None) or failed.get(c)
            found, hib = lm_eval_rows(results.get(config.id, results[BASELINE]), why)  # failed: the baseline's metrics
            better.update(hib)
            rows += [{**config.fields, "task": t, "metric": m, "value": v, "stderr": s, "n": n, "error": e} for t, m, v, s, n, e in found]
        for name, (ps, prompts) in sweep.prompt_sets.items():
            logprobs = {(i, t): target_score(float(answers["loglikelihood"][c][n_task_ll + j][0]), k, ps.target_score or "sum")
                        for j, (s, i, t, k) in enumerate(targets) if s == name}  # fmt: skip
            mine = [j for j, (s, _) in enumerate(gens) if s == name]
            found = prompt_rows(prompts, logprobs, ps.file) + (fluency.rows([texts[c][j] for j in mine], scores, failed.get(c)) if mine else [])
            for metric, value, stderr, n, error in found:
                rows.append({**config.fields, "task": name, "metric": metric, "value": value, "stderr": stderr, "n": n, "error": error})
                better[(name, metric)] = {**PROMPT_HIGHER, **fluency.METRICS}.get(metric, True)
            for j in mine:
                i = gens[j][1]
                generations.append({**config.fields, "prompt_set": name, "index": i, "line": prompts[i].line,
                                    "prompt": prompts[i].text, "text": texts[c][j][1],
                                    "fluency_logprob": scores.get(texts[c][j]),
                                    "repetition_rate": fluency.repetition_rate(texts[c][j][1]), "error": failed.get(c)})  # fmt: skip
    add_deltas(rows)
    fluency.mark(rows, generations)
    lm_eval_results = {k: {key: v for key, v in r.items() if key != "samples"} for k, r in results.items()}
    return Outcome(sweep, rows, generations, lm_eval_results, info, seconds, better)
