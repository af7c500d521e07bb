"""The patch file (`driver patch FILE.yaml`): its schema as frozen pydantic models, read from YAML, every error as
one line naming the file, the field and the fix. Paths in it are relative to the file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from worker.patch.spec import PATCH_METHODS, PATCH_SITES

from driver.checks.errors import one_line
from driver.steering.userfiles import explain_field, nonempty_unique, read_yaml_file
from driver.sweep.schema import ModelSettings

__all__ = ["PatchError", "PatchFile", "read_patch_file"]


class PatchError(ValueError):
    """A patch file (or its pairs) that cannot run; the message is one line naming the file, the field or line, the fix."""


_Frozen = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class PatchFile(BaseModel):
    """The whole patch file: the model (as in a sweep file), the pairs, and the grid of cells."""

    model_config = _Frozen

    model: ModelSettings
    pairs: str  # a JSONL of {"clean", "corrupt", "correct", "wrong"} per line
    sites: tuple[Literal[PATCH_SITES], ...] = ("resid_pre",)
    layers: Union[Literal["all"], tuple[StrictInt, ...]] = "all"  # negative: from the end
    positions: Union[Literal["all", "last"], tuple[StrictInt, ...]] = "all"  # negative: from the end
    heads: Union[Literal["all"], tuple[Annotated[int, Field(strict=True, ge=0)], ...]] = "all"  # attn_head's heads
    method: tuple[Literal[PATCH_METHODS], ...] = ("exact",)

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> Any:
        return {"pretrained": v} if isinstance(v, (str, os.PathLike)) else v

    @field_validator("sites", "layers", "positions", "heads", "method", mode="before")
    @classmethod
    def _scalar_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, str) and v not in ("all", "last")) else v

    @field_validator("sites", "layers", "positions", "heads", "method")
    @classmethod
    def _nonempty_unique(cls, v: Any) -> Any:
        return nonempty_unique(v)


def _loc(loc: Sequence) -> str:
    parts = [p for p in loc if not (isinstance(p, str) and p.startswith(("function-", "literal[", "tuple[", "union[")))]
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def _explain(err: dict) -> str:
    loc = err["loc"]
    return explain_field(err, list((ModelSettings if loc[0] == "model" and len(loc) > 1 else PatchFile).model_fields))


def _validate(data: Any, where: str) -> PatchFile:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise PatchError(f"{where}: the patch file is {kind}; it must be a mapping with model, pairs and sites")
    try:
        return PatchFile.model_validate(data)
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda err: (err["type"] != "extra_forbidden", err["type"] == "missing",
                                                     err["type"] == "literal_error" and not isinstance(err.get("input"), str)))  # fmt: skip
        first, more = errors[0], f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
        path = _loc(first["loc"])
        raise PatchError(one_line(f"{where}: {path + ': ' if path else ''}{_explain(first)}{more}")) from None


def read_patch_file(path: Path) -> PatchFile:
    """The patch file at `path`, read and checked against the schema (not yet against its model or pairs)."""
    return _validate(read_yaml_file(path, "patch", PatchError), str(path))
