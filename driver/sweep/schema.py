"""The sweep file: its schema (pydantic models), its errors as one line in the user's words, reading its YAML."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from worker.spec import HEAD_SITES, SITES

from driver.checks import settings
from driver.checks.errors import one_line
from driver.evidence.selection import Select
from driver.judge.schema import Judge, check_prompting, check_seeds
from driver.steering.schema import ConditionFields
from driver.steering.userfiles import explain_field, nonempty_unique, read_yaml_file, short

__all__ = ["SweepError", "SweepFile", "ModelSettings", "VectorSource", "Grid", "Tasks", "PromptSet", "Condition", "read_sweep_file",
           "one_line", "NAME"]  # fmt: skip

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # a vector, target or prompt set name


class SweepError(ValueError):
    """A sweep file that cannot run; the message is one line naming the file, the field (or line) and the fix."""


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
    prefix_cache_mb: StrictInt = Field(default=1024, ge=0)  # MiB of prefix KV each worker keeps across chunks
    max_gen_toks: StrictInt = Field(default=256, ge=1)
    trust_remote_code: StrictBool = False
    threads: StrictInt | None = Field(default=None, ge=1)
    group_size: StrictInt | str = 1  # nodes per copy of the model, or auto (driver.checks.groups)
    split: str = "auto"  # auto | pipeline | tensor

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, v: Any) -> Any:
        return _setting(settings.group_size, v)

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return _setting(settings.split, v)


def _setting(check, value: Any) -> Any:
    """A value checked as its flag is (driver.checks.settings), said without the flag's name."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"must be a whole number or a word such as auto, not {short(value)}")
    try:
        return check(value, "")
    except settings.SettingError as e:  # " VALUE: what is wrong (what is allowed)"
        raise ValueError(f"{str(e).partition(': ')[2]}, not {short(value)}") from None


class VectorSource(BaseModel):
    """One steering direction per layer (and head): a `driver vectors` .safetensors file (`key` is a template, by
    default "{site}.{layer}", "{site}.{layer}.{head}" at a head site), or `layers: {L: file}` with a .npy (or
    .safetensors) per layer; a .npy at a head site is that head_dim vector for every head."""

    model_config = _Frozen

    file: str | None = None
    key: str | None = None
    layers: dict[StrictInt, str] | None = None
    normalize: StrictBool = False
    sae: str | None = None  # an SAE folder (driver.steering.saes): one vector per feature of `features`, named NAME-fN
    features: tuple[Annotated[int, Field(strict=True, ge=0)], ...] | None = None
    top: StrictInt | None = Field(default=None, ge=1)  # or the `top` features most active on `prompts` (the SAE's encoder)
    prompts: str | None = None  # a JSONL of {"prompt": ...} lines: `top` ranks on them; each feature's activation measured on them

    @model_validator(mode="after")
    def _one_source(self) -> VectorSource:
        if sum(x is not None for x in (self.file, self.layers, self.sae)) != 1:
            raise ValueError("give exactly one of `file:` (a .safetensors from `driver vectors`), `layers: {L: file}` or "
                             "`sae: FOLDER` with `features: [..]` or `top: K`")  # fmt: skip
        if (self.sae is None) != ((self.features is None) == (self.top is None)):
            raise ValueError("`sae:` takes either `features: [..]` (the features to sweep, e.g. [12, 40]) or `top: K` with "
                             "`prompts: FILE` (the K features most active on those prompts)")  # fmt: skip
        if self.top is not None and self.prompts is None:
            raise ValueError("`top:` needs `prompts: FILE`, the JSONL of prompts its features are ranked on")
        if self.prompts is not None and self.sae is None:
            raise ValueError("`prompts:` goes with `sae:`: the prompts an SAE's features are ranked and measured on")
        if self.features is not None and (not self.features or len(set(self.features)) != len(self.features)):
            raise ValueError("`features:` must list distinct feature indices, at least one")
        if self.layers is not None and not self.layers:
            raise ValueError("`layers:` is empty: map each layer to its vector file")
        if self.key is not None:
            try:
                self.key.format(site="resid_post", layer=0, head=0)
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"key {self.key!r}: use a template with {{site}}, {{layer}} (and {{head}} at a head site), "
                                 "e.g. '{site}.{layer}' or 'attn_head.{layer}.{head}'") from None
        return self


def _listify(v: Any) -> Any:
    return [v] if isinstance(v, (str, int, float)) and not isinstance(v, bool) else v


class Grid(BaseModel):
    """The configurations: every combination of vectors × sites × layers × ops × positions × alphas, and heads
    (`all` or a list) for a head site (attn_head)."""

    model_config = _Frozen

    layers: Union[Literal["all"], tuple[StrictInt, ...]]
    alphas: tuple[Annotated[float, Field(strict=True, allow_inf_nan=False)], ...]
    ops: tuple[Literal["add", "replace", "ablate", "clamp"], ...] = ("add",)
    positions: tuple[Literal["all", "prompt", "continuation", "last"], ...] = ("all",)
    sites: tuple[Literal[SITES], ...] = ("resid_post",)  # every site worker.spec knows
    heads: Union[Literal["all"], tuple[Annotated[int, Field(strict=True, ge=0)], ...], None] = None  # head sites only
    vectors: tuple[str, ...] | None = None  # default: every vector of the file
    thresholds: tuple[Annotated[float, Field(strict=True, allow_inf_nan=False)], ...] | None = None  # with `condition:`

    @field_validator("layers", "alphas", "ops", "positions", "sites", "heads", "vectors", "thresholds", mode="before")
    @classmethod
    def _scalar_is_a_list(cls, v: Any, info) -> Any:
        if v == "all" or (info.field_name in ("layers", "heads") and isinstance(v, str)):
            return v
        return _listify(v)

    @model_validator(mode="after")
    def _heads_with_head_sites(self) -> Grid:
        steer_heads = [s for s in self.sites if s in HEAD_SITES]
        if self.heads is not None and not steer_heads:
            raise ValueError(f"heads: site{'s' * (len(self.sites) > 1)} {', '.join(self.sites)} "
                             f"{'have' if len(self.sites) > 1 else 'has'} no heads: add {' or '.join(HEAD_SITES)} to "
                             "grid.sites, or remove grid.heads")  # fmt: skip
        if self.heads is None and steer_heads:
            raise ValueError(f"sites: {steer_heads[0]} steers one attention head at a time: give grid.heads "
                             "(all, or a list such as [0, 5])")  # fmt: skip
        return self

    @field_validator("ops", "positions", "sites", "heads", "vectors", "layers", "alphas", "thresholds")
    @classmethod
    def _nonempty_unique(cls, v: Any) -> Any:
        return nonempty_unique(v)


class Tasks(BaseModel):
    """lm-eval tasks, evaluated once per configuration (lm-eval's own metrics)."""

    model_config = _Frozen

    names: tuple[str, ...]
    limit: Annotated[float, Field(gt=0, strict=True)] | None = None
    num_fewshot: StrictInt | None = Field(default=None, ge=0)
    include_path: str | None = None
    gen_kwargs: str | None = None
    apply_chat_template: StrictBool = False
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**32)  # one seed for python, numpy, torch and few-shot sampling (lm-eval's defaults if unset)

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: float | None) -> float | int | None:
        """As `driver run --limit` reads it: a whole number of documents, or a fraction below 1."""
        if v is not None and v >= 1 and v != int(v):
            raise ValueError(f"{v:g} is not a whole number: give a whole number of documents per task (>= 1), or a fraction between 0 and 1")
        return v if v is None or v < 1 else int(v)

    @field_validator("gen_kwargs")
    @classmethod
    def _gen_kwargs(cls, v: str | None) -> str | None:
        """Checked as `driver run --gen-kwargs` is (known keys, values in range, no two max-token aliases that
        disagree); lm-eval gets the text as written."""
        try:
            settings.gen_kwargs(v)
        except settings.SettingError as e:
            raise ValueError(str(e).removeprefix("--gen-kwargs").lstrip(": ")) from None
        return v

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
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)] = 0.0  # strict: `true` is not 1.0
    seed: StrictInt = 0  # with temperature > 0: each (prompt, seed) draws the same sample on any worker
    seeds: tuple[StrictInt, ...] | None = None  # with temperature > 0: a sample per prompt and seed (driver.judge.schema)
    until: tuple[str, ...] = ()
    # a target's summed log-prob (its whole probability), or its mean per token; unset: sum, with a warning
    # when a prompt's targets differ in token length
    target_score: Literal["sum", "mean"] | None = None

    @field_validator("until", mode="before")
    @classmethod
    def _until(cls, v: Any) -> Any:
        return _listify(v)

    @model_validator(mode="after")
    def _seeds(self) -> PromptSet:
        return check_seeds(self, "seed" in self.model_fields_set)


class Condition(ConditionFields):
    """CAST's condition on every configuration, as a steering spec's `condition:` (driver.steering.schema.ConditionSpec)
    but for its threshold: grid.thresholds is an axis of the grid."""

    model_config = _Frozen

    @model_validator(mode="before")
    @classmethod
    def _threshold_is_an_axis(cls, v: Any) -> Any:
        if isinstance(v, Mapping) and "threshold" in v:
            raise ValueError("a sweep takes its thresholds as an axis: list them in grid.thresholds, e.g. [0.1, 0.2]")
        return v


class SweepFile(BaseModel):
    """The whole sweep file."""

    model_config = _Frozen

    model: ModelSettings
    vectors: dict[str, VectorSource]
    grid: Grid
    tasks: Tasks | None = None
    prompts: tuple[PromptSet, ...] = ()
    condition: Condition | None = None  # conditional steering (CAST) of every configuration, at each of grid.thresholds
    select: Select | None = None  # choose the best on one part of the samples, report it on the other
    prompting: Annotated[dict[str, str], BeforeValidator(check_prompting)] = {}  # NAME -> text before every prompt (driver.judge)
    judge: Judge | None = None  # a second model rating every generation (driver.judge.rate)

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
        bad = [k for k in v if not NAME.match(k)]
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
        if (self.condition is None) != (self.grid.thresholds is None):
            raise ValueError("`condition:` and grid.thresholds go together: the CAST condition, and the thresholds to sweep it at"
                             if self.condition is None else "condition: give grid.thresholds, the thresholds to sweep it at, e.g. [0.1, 0.2]")
        return self


# --- pydantic errors as one line ---------------------------------------------------------------------------

_MODELS = {"": SweepFile, "model": ModelSettings, "grid": Grid, "tasks": Tasks, "prompts": PromptSet, "vectors": VectorSource,
           "condition": Condition, "select": Select, "judge": Judge}


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
    loc = [p for p in err["loc"] if not _is_tag(p)]
    top = str(loc[0]) if len(loc) > 1 else ""
    model = _MODELS.get(top, SweepFile) if top != "vectors" or len(loc) > 2 else SweepFile
    return explain_field(err, list(model.model_fields), loc)


def _validate(data: Any, where: str) -> SweepFile:
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SweepError(f"{where}: the sweep file is {kind}; it must be a mapping with model, vectors, grid and tasks/prompts")
    try:
        return SweepFile.model_validate(dict(data))
    except ValidationError as e:
        # a list's own problem (heads[0] negative) before "not 'all'" (the union's other member)
        errors = sorted(e.errors(), key=lambda err: (err["type"] != "extra_forbidden", err["type"] == "missing",
                                                     err["type"] == "literal_error" and isinstance(err.get("input"), list)))
        first = errors[0]
        if first["type"] == "literal_error" and first["loc"][:1] == ("grid",) and first["loc"][1:2] in (("layers",), ("heads",)):
            what = first["loc"][1]
            first = {**first, "type": "value_error", "msg": f"{first['input']!r}: give a list of {what} or 'all'"}
        more = f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
        path = _loc(first["loc"])
        raise SweepError(one_line(f"{where}: {path + ': ' if path else ''}{_explain(first)}{more}")) from None


def read_sweep_file(path: Path) -> SweepFile:
    """The sweep file at `path`, read and checked against the schema (not yet against its model or files)."""
    return _validate(_read_yaml(path), str(path))


def _read_yaml(path: Path) -> Any:
    return read_yaml_file(path, "sweep", SweepError)
