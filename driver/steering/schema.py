"""The steering spec file's schema (pydantic models) and its errors as one-line `SteeringError`s in the user's words."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag, ValidationError
from pydantic import field_validator

from worker.spec import OPS, POSITIONS, SITES, SteeringError

from driver.steering.userfiles import explain, short


def spec_error(where: str, field: str, problem: str) -> SteeringError:
    text = f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
    return SteeringError(" ".join(text.split()))  # one line, whatever the parsers put in


# --- the file's schema --------------------------------------------------------------------------


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


class VectorRef(BaseModel):
    """`{file: vectors.safetensors, key: resid_post.3}`; without a key, `{site}.{layer}` of the intervention
    (`attn_head.{layer}.{head}` at attn_head)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    key: str | None = None

    @field_validator("file", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


class SaeRef(BaseModel):
    """`{sae: FOLDER, feature: N}`: the decoder direction of one SAE feature (`driver.steering.saes` reads the
    folder); `hookpoint` picks a folder of a sparsify run (default: the intervention's site, in lm-eval's names);
    `about_b_dec` makes clamp measure the projection from the SAE's b_dec, as lm-eval's steered does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sae: str
    feature: StrictInt = Field(ge=0)
    hookpoint: str | None = None
    about_b_dec: StrictBool = False

    @field_validator("sae", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


def _vector_form(v: Any) -> str | None:
    if isinstance(v, (str, os.PathLike)):
        return "path"
    if isinstance(v, SaeRef) or (isinstance(v, Mapping) and "sae" in v):
        return "sae"
    return "ref" if isinstance(v, (Mapping, VectorRef)) else None


VectorField = Annotated[
    Union[Annotated[str, Tag("path")], Annotated[VectorRef, Tag("ref")], Annotated[SaeRef, Tag("sae")]],
    Discriminator(_vector_form, custom_error_type="vector_form", custom_error_message="bad vector"),
]


class ConditionFields(BaseModel):
    """Where and how a condition reads its direction: what a steering spec's `condition:` and a sweep's share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vector: VectorField
    layers: tuple[StrictInt, ...] = Field(min_length=1)
    compare: Literal["greater", "smaller"] = "greater"
    pool: Literal["mean", "last"] = "mean"

    @field_validator("vector", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


class ConditionSpec(ConditionFields):
    """CAST's condition as written: steer a row only when its prompt's pooled input of `layers` passes
    (`worker.spec.Condition` says the rule); `vector` is written as an intervention's is."""

    threshold: float = Field(strict=True, allow_inf_nan=False)


class AnyOf(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    any: tuple[ConditionSpec, ...] = Field(min_length=1)


class AllOf(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    all: tuple[ConditionSpec, ...] = Field(min_length=1)


def _condition_form(v: Any) -> str:
    keys = v.keys() if isinstance(v, Mapping) else type(v).model_fields if isinstance(v, BaseModel) else ()
    return "any" if "any" in keys else "all" if "all" in keys else "one"


ConditionField = Annotated[
    Union[Annotated[ConditionSpec, Tag("one")], Annotated[AnyOf, Tag("any")], Annotated[AllOf, Tag("all")]],
    Discriminator(_condition_form),
]


class InterventionSpec(BaseModel):
    """One intervention as written; see `worker.spec.Intervention` for what each op does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: StrictInt
    site: Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head"] = "resid_post"
    op: Literal["add", "replace", "ablate", "clamp"] = "add"
    vector: VectorField
    head: StrictInt | None = Field(default=None, ge=0)  # attn_head only: which head (0-based)
    alpha: float = Field(default=1.0, strict=True, allow_inf_nan=False)
    positions: Literal["all", "prompt", "continuation", "last"] = "all"
    normalize: StrictBool = False
    condition: ConditionField | None = None  # CAST: steer only the rows whose prompt passes it

    @field_validator("vector", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


class SpecFile(BaseModel):
    """The whole file: `interventions:` in order; an empty list means the plain model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interventions: tuple[InterventionSpec, ...]


_ALLOWED = {"site": SITES, "op": OPS, "positions": POSITIONS, "compare": ("greater", "smaller"), "pool": ("mean", "last")}


# --- pydantic errors as one-liners ---------------------------------------------------------------


def _field_path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (i > 0 and loc[i - 1] in ("vector", "condition") and part in ("path", "ref", "sae", "one", "any", "all")):  # union tags
            out += f".{part}" if out else str(part)
    return out


def _unknown_field(loc: tuple) -> str:
    model = SpecFile if len(loc) == 1 else (SaeRef if "sae" in loc else VectorRef) if "vector" in loc else InterventionSpec
    model = ConditionSpec if "condition" in loc and "vector" not in loc and len(loc) > 3 else model
    allowed = list(model.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"unknown field ({hint}allowed: {', '.join(allowed)})"


def _explain(err: dict) -> str:
    """One pydantic error as 'what is wrong (what to write instead)'."""
    kind, loc, value = err["type"], err["loc"], err.get("input")
    name = loc[-1] if loc else ""
    if kind == "missing":
        if loc == ("interventions",):
            return "missing (write `interventions: []` for an unsteered run)"
        return "missing (this field is required)"
    if loc == ("interventions",) and value is None:  # YAML `interventions:` with nothing under it
        return "has no value: list the interventions under it, or write `interventions: []` for an unsteered run"
    if kind == "extra_forbidden":
        return _unknown_field(loc)
    if kind == "too_short" and name == "layers":
        return "is empty: name the layers whose input the condition reads, e.g. layers: [2]"
    if kind == "literal_error":
        return f"{short(value)} is not allowed (use one of: {', '.join(_ALLOWED.get(name, ()))})"
    if kind == "vector_form":
        return f"must be a path to a .npy file or {{file: ..., key: ...}} (an SAE feature: {{sae: FOLDER, feature: N}}), not {short(value)}"
    return explain(err, list_of="a list of interventions")


def validate_spec(data: Any, where: str) -> SpecFile:
    if isinstance(data, SpecFile):
        return data
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise spec_error(where, "", f"the spec is {kind}; it must be a mapping with an `interventions:` list")
    try:
        return SpecFile.model_validate(dict(data))
    except ValidationError as e:
        # a misspelt field also shows as the real one missing: name the misspelling, it carries the fix
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        more = f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
        raise spec_error(where, _field_path(errors[0]["loc"]), _explain(errors[0]) + more) from None
