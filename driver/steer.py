"""The user-facing steering spec: a YAML/JSON file (or dict) of interventions -> `worker.spec.Steering`.

```yaml
interventions:
  - layer: 12                     # negative counts from the end
    vector: honesty.npy           # a 1-D float .npy, relative to this file's folder
    alpha: 4.0
  - layer: 10
    site: resid_pre               # resid_pre | resid_post (default)
    op: clamp                     # add (default) | replace | ablate | clamp
    vector: {file: vectors.safetensors}   # key defaults to "resid_pre.10", as `driver vectors` writes it
    positions: continuation       # all (default) | prompt | continuation | last
    normalize: true
```

`load_steering` reads the spec and its vectors (never unpickling anything) and returns the `Steering` that
travels to workers plus a JSON-able record of what was loaded (file hashes, norms, safetensors metadata) for
the results JSON. `check` validates against a model's shape (`model_shape` reads it from config.json) and
resolves negative layers. Every problem is a one-line `SteeringError` naming the file, the field and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag, ValidationError
from pydantic import field_validator

from worker.load import model_shape
from worker.spec import OPS, POSITIONS, SITES, Intervention, Steering, SteeringError

from .userfiles import explain, short

__all__ = ["SteeringError", "SteeringRun", "SpecFile", "load_steering", "check", "model_shape"]

_PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin")
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_NO_DIRECTION_OPS = ("ablate", "clamp")  # they use v/|v|: a zero vector has no direction




def _fail(where: str, field: str, problem: str) -> SteeringError:
    text = f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
    return SteeringError(" ".join(text.split()))  # one line, whatever the parsers put in


# --- the file's schema --------------------------------------------------------------------------


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


class VectorRef(BaseModel):
    """`{file: vectors.safetensors, key: resid_post.3}`; without a key, `{site}.{layer}` of the intervention."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    key: str | None = None

    @field_validator("file", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


def _vector_form(v: Any) -> str | None:
    if isinstance(v, (str, os.PathLike)):
        return "path"
    return "ref" if isinstance(v, (Mapping, VectorRef)) else None


VectorField = Annotated[
    Union[Annotated[str, Tag("path")], Annotated[VectorRef, Tag("ref")]],
    Discriminator(_vector_form, custom_error_type="vector_form", custom_error_message="bad vector"),
]


class InterventionSpec(BaseModel):
    """One intervention as written; see `worker.spec.Intervention` for what each op does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: StrictInt
    site: Literal["resid_pre", "resid_post"] = "resid_post"
    op: Literal["add", "replace", "ablate", "clamp"] = "add"
    vector: VectorField
    alpha: float = Field(default=1.0, strict=True, allow_inf_nan=False)
    positions: Literal["all", "prompt", "continuation", "last"] = "all"
    normalize: StrictBool = False

    @field_validator("vector", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return _fspath(v)


class SpecFile(BaseModel):
    """The whole file: `interventions:` in order; an empty list means the plain model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interventions: tuple[InterventionSpec, ...]

    @field_validator("interventions", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return () if v is None else v  # YAML `interventions:` with nothing under it


_ALLOWED = {"site": SITES, "op": OPS, "positions": POSITIONS}


# --- pydantic errors as one-liners ---------------------------------------------------------------


def _field_path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (i > 0 and loc[i - 1] == "vector" and part in ("path", "ref")):  # union tags
            out += f".{part}" if out else str(part)
    return out


def _unknown_field(loc: tuple) -> str:
    model = SpecFile if len(loc) == 1 else VectorRef if "vector" in loc else InterventionSpec
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
    if kind == "extra_forbidden":
        return _unknown_field(loc)
    if kind == "literal_error":
        return f"{short(value)} is not allowed (use one of: {', '.join(_ALLOWED.get(name, ()))})"
    if kind == "vector_form":
        return f"must be a path to a .npy file or {{file: ..., key: ...}}, not {short(value)}"
    return explain(err, list_of="a list of interventions")


def _validate(data: Any, where: str) -> SpecFile:
    if isinstance(data, SpecFile):
        return data
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise _fail(where, "", f"the spec is {kind}; it must be a mapping with an `interventions:` list")
    try:
        return SpecFile.model_validate(dict(data))
    except ValidationError as e:
        # a misspelt field also shows as the real one missing: name the misspelling, it carries the fix
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        more = f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
        raise _fail(where, _field_path(errors[0]["loc"]), _explain(errors[0]) + more) from None


# --- reading the spec file -----------------------------------------------------------------------


def _read_spec(path: Path) -> Any:
    """The parsed YAML/JSON of a spec file; errors say where the parser stopped."""
    import yaml

    where = str(path)
    if path.suffix.lower() not in _SPEC_SUFFIXES:
        raise _fail(where, "", f"not a steering spec: use a .yaml, .yml or .json file, not '{path.suffix}'")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(where, "", "no such file (check the path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(where, "", f"cannot read the file ({type(e).__name__}: {e})") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise _fail(where, "", f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise _fail(where, "", f"malformed YAML{at}: {problem}") from None


# --- reading vectors -----------------------------------------------------------------------------


def _file_sha256(path: Path, memo: dict[Path, str]) -> str:
    if path not in memo:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        memo[path] = digest.hexdigest()
    return memo[path]


def _read_npy(path: Path, fail) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)  # never unpickle: a pickle can run code
    except ValueError as e:
        if "allow_pickle" in str(e):
            problem = "holds pickled data or Python objects, not a plain array"
            raise fail(f"{path} {problem}; save a float array with numpy.save") from None
        raise fail(f"{path} is not a readable .npy file ({e})") from None
    except (OSError, EOFError) as e:
        raise fail(f"{path} is not a readable .npy file ({e})") from None
    if not isinstance(array, np.ndarray):  # np.load opens a zip (.npz) whatever its name
        raise fail(f"{path} is an .npz archive, not a .npy array; save one vector with numpy.save")
    return array


def _read_safetensors(path: Path, key: str, fail) -> tuple[np.ndarray, dict | None]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            keys = sorted(f.keys(), key=_natural)
            if key not in keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                raise fail(f"no tensor '{key}' in {path} (it has: {shown or 'no tensors'}); give `key:`", ".key")
            return f.get_tensor(key), f.metadata()
    except SteeringError:
        raise
    except Exception as e:  # safetensors raises its own error types (bad header, bfloat16 for numpy, ...)
        raise fail(f"{path} is not a readable .safetensors file of float tensors ({e})") from None


def _natural(key: str) -> list:
    """resid_post.2 before resid_post.10 (numbers and words never compared with each other)."""
    return [(0, int(p), "") if p.lstrip("-").isdigit() else (1, 0, p) for p in key.split(".")]


def _default_key(iv: InterventionSpec, fail) -> str:
    if iv.layer < 0:
        raise fail(
            f"layer {iv.layer} counts from the end, so the safetensors key cannot be guessed; "
            f"give `key:` (e.g. {iv.site}.N) or write the layer non-negative",
            ".key",
        )
    return f"{iv.site}.{iv.layer}"


def _load_vector(iv: InterventionSpec, field: str, base: Path, where: str, memo: dict) -> tuple[np.ndarray, dict]:
    """The intervention's vector as float32, checked, and its record entry."""

    def fail(problem: str, sub: str = "") -> SteeringError:
        return _fail(where, field + sub, problem)

    ref = iv.vector if isinstance(iv.vector, VectorRef) else VectorRef(file=iv.vector)
    sub = ".file" if isinstance(iv.vector, VectorRef) else ""
    path = Path(os.path.normpath(base / Path(ref.file).expanduser()))
    suffix = path.suffix.lower()
    if suffix in _PICKLE_SUFFIXES:
        problem = "is a pickle-based file, which Orchard never loads (unpickling can run code)"
        raise fail(f"{path.name} {problem}; save it as .npy or .safetensors", sub)
    if suffix not in (".npy", ".safetensors"):
        raise fail(f"{path.name}: unsupported vector file; save it as .npy or .safetensors", sub)
    if not path.is_file():
        raise fail(f"{path} does not exist (relative paths start from {base})", sub)
    if suffix == ".npy" and ref.key is not None:
        raise fail("`key` applies only to .safetensors files; remove it", ".key")
    key, metadata = None, None
    if suffix == ".npy":
        array = _read_npy(path, fail)
    else:
        key = ref.key if ref.key is not None else _default_key(iv, fail)
        array, metadata = _read_safetensors(path, key, fail)
    vector = _checked(array, iv, fail)
    record = {
        "path": str(path),
        "key": key,
        "file_sha256": _file_sha256(path, memo),
        "sha256": hashlib.sha256(vector.tobytes()).hexdigest(),
        "norm": float(np.linalg.norm(vector)),
        "length": int(vector.size),
        "metadata": dict(metadata) if metadata else None,
    }
    return vector, record


def _checked(array: np.ndarray, iv: InterventionSpec, fail) -> np.ndarray:
    """1-D, float, finite (as float32, the worker's precision) and with a direction when the op needs one."""
    if array.ndim != 1:
        raise fail(f"has shape {array.shape}; a steering vector must be 1-D (one value per hidden unit)")
    if not np.issubdtype(array.dtype, np.floating):
        raise fail(f"holds {array.dtype} values; save a float array (e.g. float32)")
    if array.size == 0:
        raise fail("is empty; save one value per hidden unit")
    with np.errstate(over="ignore"):
        vector = np.ascontiguousarray(array, dtype=np.float32)
    bad = int((~np.isfinite(vector)).sum())
    if bad:
        raise fail(f"holds {bad} NaN/inf value(s) (as float32); save finite values")
    if not vector.any() and (iv.normalize or iv.op in _NO_DIRECTION_OPS):
        why = "normalize" if iv.normalize else f"op {iv.op}"
        raise fail(f"is all zeros, so it has no direction for {why}; use a nonzero vector")
    return vector


# --- the public entry points ---------------------------------------------------------------------


@dataclass(frozen=True)
class SteeringRun:
    """What `load_steering` returns: the `Steering` for workers, and the JSON-able record for the results."""

    steering: Steering
    record: dict


def _given_steering(steering: Steering) -> SteeringRun:
    vectors = [
        {"path": None, "key": None, "file_sha256": None, "sha256": iv.vector_sha256(),
         "norm": float(np.linalg.norm(np.asarray(iv.vector, dtype=np.float32))), "length": len(iv.vector),
         "metadata": None}
        for iv in steering.interventions
    ]  # fmt: skip
    spec = {"interventions": [iv.model_dump(exclude={"vector"}) for iv in steering.interventions]}
    return SteeringRun(steering, {"source": None, "source_sha256": None, "spec": spec, "vectors": vectors})


def load_steering(
    source: str | os.PathLike | Mapping | SpecFile | Steering, base_dir: str | os.PathLike | None = None
) -> SteeringRun:
    """Read a steering spec: a .yaml/.yml/.json file, a dict, a `SpecFile`, or a ready `Steering`.

    Vector paths are relative to `base_dir`, by default the spec file's folder (the cwd for a dict).
    The record: {source, source_sha256, spec (as written), vectors: [{path, key, file_sha256, sha256 (of the
    float32 bytes), norm, length, metadata}, one per intervention]}.
    """
    if isinstance(source, Steering):
        return _given_steering(source)
    memo: dict[Path, str] = {}
    if isinstance(source, (Mapping, SpecFile)):
        where, origin, folder = "steering spec (dict)", None, Path.cwd()
        spec = _validate(source, where)
    else:
        origin = Path(source).expanduser()
        where, folder = str(origin), origin.absolute().parent
        spec = _validate(_read_spec(origin), where)
    base = Path(base_dir).expanduser().absolute() if base_dir is not None else folder
    interventions, vectors = [], []
    for i, iv in enumerate(spec.interventions):
        vector, entry = _load_vector(iv, f"interventions[{i}].vector", base, where, memo)
        fields = iv.model_dump(exclude={"vector"})
        interventions.append(Intervention(**fields, vector=tuple(vector.tolist())))
        vectors.append(entry)
    record = {
        "source": str(origin.absolute()) if origin else None,
        "source_sha256": _file_sha256(origin, memo) if origin else None,
        "spec": spec.model_dump(mode="json", exclude_unset=True),
        "vectors": vectors,
    }
    return SteeringRun(Steering(interventions=tuple(interventions)), record)


def check(steering: Steering, n_layers: int | None, hidden_size: int | None) -> Steering:
    """Validate against a model's shape and resolve negative layers; None skips that check (the worker repeats it)."""
    return steering.resolve(n_layers, hidden_size)
