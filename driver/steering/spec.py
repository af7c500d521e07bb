"""The user-facing steering spec: a YAML/JSON file (or dict) of interventions -> `worker.spec.Steering`.

```yaml
interventions:
  - layer: 12                     # negative counts from the end
    vector: honesty.npy           # a 1-D float .npy, relative to this file's folder
    alpha: 4.0
  - layer: 10
    site: resid_pre               # resid_pre | resid_mid | resid_post (default) | attn_out | mlp_out | attn_head
  - layer: 3
    site: attn_head               # one head's output before the output projection: a head_dim vector
    head: 5                       # which head (0-based); only at attn_head
    vector: {file: vectors.safetensors}   # key defaults to "attn_head.3.5"
    op: clamp                     # add (default) | replace | ablate | clamp
    vector: {file: vectors.safetensors}   # key defaults to "resid_pre.10", as `driver vectors` writes it
    positions: continuation       # all (default) | prompt | continuation | last
    normalize: true
```

`load_steering` reads the spec and its vectors (never unpickling anything) and returns the `Steering` that
travels to workers plus a JSON-able record of what was loaded (file hashes, norms, safetensors metadata) for
the results JSON. `check` validates against a model's shape (`model_shape` reads it from config.json) and
resolves negative layers; `for_model` does both for one model, so a negative layer's default safetensors key
is that of the layer it resolves to, and values are checked in the dtype the model computes in. Every problem
is a one-line `SteeringError` naming the file, the field and the fix. `warn_once` prints the notes workers
attach to results (steering that swamps the residual stream) once per run. The file's schema and its
validation errors in the user's words are `driver.steering.schema`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.load import model_shape
from worker.spec import (FLOAT_MAX, HEAD_SITES, Intervention, Steering, SteeringError, head_problem, head_shape, site_missing,
                         overflow, steering_overflow)  # fmt: skip

from driver.steering.conditions import load_gate
from driver.steering.schema import InterventionSpec, SaeRef, SpecFile, VectorRef, spec_error, validate_spec
from driver.steering.userfiles import load_yaml, read_npy, yaml_problem

__all__ = ["SteeringError", "SteeringRun", "SpecFile", "load_steering", "for_model", "check", "model_shape", "warn_once"]

_PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin")
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_NO_DIRECTION_OPS = ("ablate", "clamp")  # they use v/|v|: a zero vector has no direction


# --- reading the spec file -----------------------------------------------------------------------


def _read_spec(path: Path) -> Any:
    """The parsed YAML/JSON of a spec file; errors say where the parser stopped."""
    import yaml

    where = str(path)
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        raise spec_error(where, "", f"a pickled steering file (lm-eval's .pt), which Orchard never unpickles: convert it with "
                                    f"`driver steer convert {path}` (torch.load with weights_only=True) to a spec and .safetensors")
    if path.suffix.lower() not in _SPEC_SUFFIXES:
        raise spec_error(where, "", f"not a steering spec: use a .yaml, .yml or .json file (or lm-eval's steered .csv), not '{path.suffix}'")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise spec_error(where, "", "no such file (check the path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise spec_error(where, "", f"cannot read the file ({type(e).__name__}: {e})") from None
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)  # JSON's own message for malformed JSON; the YAML reader below finds twice-given keys
        except json.JSONDecodeError as e:
            raise spec_error(where, "", f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise spec_error(where, "", yaml_problem(e)) from None


# --- reading vectors -----------------------------------------------------------------------------


def _file_sha256(path: Path, memo: dict[Path, str]) -> str:
    if path not in memo:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        memo[path] = digest.hexdigest()
    return memo[path]


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
    return [(0, int(p), "") if p.lstrip("-").isascii() and p.lstrip("-").isdigit() else (1, 0, p) for p in key.split(".")]


def _default_key(iv: InterventionSpec, n_layers: int | None, fail) -> str:
    """`{site}.{layer}` (`attn_head.{layer}.{head}`), a negative layer first resolved against the model (as
    `driver vectors` keys its output)."""
    if iv.layer >= 0:
        return f"{iv.site}.{iv.layer}" + (f".{iv.head}" if iv.head is not None else "")
    if n_layers is None:
        raise fail(
            f"layer {iv.layer} counts from the end and the model's layer count is not known here, so the "
            f"safetensors key cannot be guessed; give `key:` (e.g. {iv.site}.N) or write the layer non-negative",
            ".key",
        )
    return f"{iv.site}.{iv.layer + n_layers}" + (f".{iv.head}" if iv.head is not None else "")


def _same_head(key: str, iv: InterventionSpec, fail) -> None:
    """A key `attn_head.L.h` (as `driver vectors` writes them) names its head: another head's vector is refused."""
    parts = key.split(".")
    if iv.head is None or len(parts) != 3 or parts[0] not in HEAD_SITES or not (parts[2].isascii() and parts[2].isdigit()):
        return
    if int(parts[2]) != iv.head:
        fixed = ".".join([*parts[:2], str(iv.head)])
        raise fail(f"key '{key}' is the vector of head {parts[2]}, but this intervention steers head {iv.head}: "
                   f"give key '{fixed}', or head: {parts[2]}", ".key")  # fmt: skip


def _load_vector(
    iv: InterventionSpec, field: str, base: Path, where: str, memo: dict, n_layers: int | None = None, hidden: int | None = None
) -> tuple[np.ndarray, dict]:
    """The intervention's vector as float32, checked, and its record entry."""

    def fail(problem: str, sub: str = "") -> SteeringError:
        return spec_error(where, field + sub, problem)

    if isinstance(iv.vector, SaeRef):
        return _sae_vector(iv, (n_layers, hidden), base, fail)
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
        array = read_npy(path, fail)
    else:
        key = ref.key if ref.key is not None else _default_key(iv, n_layers, fail)
        _same_head(key, iv, fail)
        array, metadata = _read_safetensors(path, key, fail)
    vector = _checked(array, iv, fail)
    record = {
        "path": str(path),
        "key": key,
        "file_sha256": _file_sha256(path, memo),
        "sha256": hashlib.sha256(vector.tobytes()).hexdigest(),
        "norm": float(np.linalg.norm(vector.astype(np.float64))),
        "length": int(vector.size),
        "metadata": dict(metadata) if metadata else None,
    }
    return vector, record


def _sae_vector(iv: InterventionSpec, shape: tuple, base: Path, fail) -> tuple[np.ndarray, dict]:
    """An SAE feature's decoder direction (`driver.steering.saes`); its record carries clamp's b_dec shift.
    `shape`: the model's (layers, hidden size), either None when unknown."""
    from driver.steering.saes import feature_vector

    if iv.vector.about_b_dec and iv.op != "clamp":
        raise fail(f"about_b_dec applies to op clamp, not {iv.op}: remove it", ".about_b_dec")
    n_layers, hidden = shape
    layer = iv.layer % n_layers if n_layers and -n_layers <= iv.layer < n_layers else iv.layer if iv.layer >= 0 else None
    vector, record, _ = feature_vector(iv.vector, iv.site, layer, base, fail, iv.head)
    if hidden and iv.site != "attn_head" and vector.size != hidden:
        raise fail(f"the SAE at {record['path']} is {vector.size} wide (d_in) but the model's hidden size is {hidden}: "
                   "use an SAE trained on this model", ".sae")
    vector = _checked(vector, iv, fail)
    record.update(sha256=hashlib.sha256(vector.tobytes()).hexdigest(), norm=float(np.linalg.norm(vector.astype(np.float64))),
                  length=int(vector.size), file_sha256=None, metadata=None)  # the keys every vector's record has
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


def _in_range(iv: InterventionSpec, n_layers: int | None, fail) -> None:
    if n_layers is not None and not -n_layers <= iv.layer < n_layers:
        raise fail(
            f"{iv.layer} is out of range for a model with {n_layers} layers "
            f"(use 0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
        )


def _in_dtype(iv: InterventionSpec, vector: np.ndarray, dtype: str, fail) -> None:
    """alpha, the vector, its norm and alpha*v are finite in `dtype`, as the worker computes them."""
    along = iv.normalize or iv.op in _NO_DIRECTION_OPS  # only u = v/|v| enters the model (`worker.spec.unit`)
    for field, problem in ((".alpha", overflow("alpha", np.float64(iv.alpha), dtype)),
                           (".vector", None if along else overflow("the vector", vector.astype(np.float64), dtype))):  # fmt: skip
        if problem:
            raise fail(field, f"{problem}, the precision the model computes in: use smaller values")
    found = steering_overflow(iv.alpha, vector.astype(np.float64), iv.op, iv.normalize, dtype)
    if found:
        raise fail(f".{found[0]}", found[1])


def load_steering(
    source: str | os.PathLike | Mapping | SpecFile | Steering,
    base_dir: str | os.PathLike | None = None,
    *,
    n_layers: int | None = None,
    dtype: str = "float32",
    missing: Mapping[str, str] | None = None,
    hidden: int | None = None,
) -> SteeringRun:
    """Read a steering spec: a .yaml/.yml/.json file, a dict, a `SpecFile`, or a ready `Steering`.

    Vector paths are relative to `base_dir`, by default the spec file's folder (the cwd for a dict).
    `n_layers` (the model's) resolves a negative layer's default safetensors key; `dtype` is the precision
    the model computes in, in which alpha, the vectors and alpha*v must be finite; `missing`: {site: why} for
    the sites the model's blocks lack; `hidden`: its hidden size, which an SAE feature's width is checked against (`for_model` passes all four).
    The record: {source, source_sha256, spec (as written), vectors: [{path, key, file_sha256, sha256 (of the
    float32 bytes), norm, length, metadata}, one per intervention]}.
    """
    if isinstance(source, Steering):
        return _given_steering(source)
    memo: dict[Path, str] = {}
    if isinstance(source, (Mapping, SpecFile)):
        where, origin, folder = "steering spec (dict)", None, Path.cwd()
        spec = validate_spec(source, where)
    else:
        origin = Path(source).expanduser()
        where, folder = str(origin), origin.absolute().parent
        if origin.suffix.lower() == ".csv":  # lm-eval's steered CSV: its errors name the CSV's lines
            return _from_csv(origin, base_dir, n_layers=n_layers, dtype=dtype, missing=missing, hidden=hidden)
        spec = validate_spec(_read_spec(origin), where)
    base = Path(base_dir).expanduser().absolute() if base_dir is not None else folder
    interventions, vectors = [], []
    for i, iv in enumerate(spec.interventions):
        _in_range(iv, n_layers, lambda problem: spec_error(where, f"interventions[{i}].layer", problem))
        gap = site_missing(missing if missing is not None else {}, iv.site, iv.layer, n_layers)  # per layer: hybrids hold attention on some
        if gap:
            raise spec_error(where, f"interventions[{i}].site", gap)
        if head_problem(iv.site, iv.head):
            raise spec_error(where, f"interventions[{i}].head", head_problem(iv.site, iv.head))
        vector, entry = _load_vector(iv, f"interventions[{i}].vector", base, where, memo, n_layers, hidden)
        _in_dtype(iv, vector, dtype, lambda field, problem: spec_error(where, f"interventions[{i}]{field}", problem))
        fields = iv.model_dump(exclude={"vector", "condition"})
        fields["alpha"] = iv.alpha + (entry.get("b_dec_projection") or 0.0)  # clamp about an SAE's b_dec
        gate, conditions = load_gate(iv, f"interventions[{i}]", _load_vector, base, where, memo)
        entry = {**entry, "conditions": conditions} if gate else entry
        interventions.append(Intervention(**fields, vector=tuple(vector.tolist()), condition=gate))
        vectors.append(entry)
    record = {
        "source": str(origin.absolute()) if origin else None,
        "source_sha256": _file_sha256(origin, memo) if origin else None,
        "spec": spec.model_dump(mode="json", exclude_unset=True),
        "vectors": vectors,
    }
    return SteeringRun(Steering(interventions=tuple(interventions)), record)


def _from_csv(path: Path, base_dir, **kwargs) -> SteeringRun:
    """An lm-eval steered CSV (`driver.steering.lmeval_csv`) loaded as the spec of SAE features it names."""
    from driver.steering.lmeval_csv import in_rows, read_csv

    spec, lines, notes = read_csv(path)
    try:
        loaded = load_steering(spec, base_dir if base_dir is not None else path.absolute().parent, **kwargs)
    except SteeringError as e:
        raise SteeringError(in_rows(str(e).replace("steering spec (dict)", str(path)), lines)) from None
    record = {**loaded.record, "source": str(path.absolute()), "source_sha256": _file_sha256(path, {}), "format": "lm-eval steered csv",
              "csv_rows": [{"line": n, "description": d} for n, d in zip(lines, notes)]}
    return SteeringRun(loaded.steering, record)


def check(steering: Steering, n_layers: int | None, hidden_size: int | None,
          heads: tuple[int | None, int | None] = (None, None)) -> Steering:  # fmt: skip
    """Validate against a model's shape (`heads`: its attention heads and head_dim) and resolve negative layers;
    None skips that check (the worker repeats it)."""
    return steering.resolve(n_layers, hidden_size, heads)


def compute_dtype(config: dict, dtype: str | None = None) -> str:
    """The dtype a model's residual stream has: `dtype` when given (model_args), else its config's
    torch_dtype (mlx-lm keeps the weights' dtype), float32 when neither names one Orchard knows."""
    named = dtype or config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("torch_dtype")
    return named if named in FLOAT_MAX else "float32"


class _SitesLater(dict):
    """{site: why} of the sites this config's blocks lack, built on the first look-up: building the blocks imports
    mlx-lm, so transformers, so PyTorch where installed (seconds), which a file refused for its own text never needs."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config

    def get(self, key: str, default: str | None = None) -> str | None:
        if self.config is not None:
            from worker.hooks.skeleton import missing_sites  # the worker's hooks' own answer, from the blocks built without weights

            self.update(missing_sites(self.config))
            self.config = None
        return super().get(key, default)


def for_model(source: str | os.PathLike | Mapping | SpecFile | Steering, config: dict, dtype: str | None = None,
              base_dir: str | os.PathLike | None = None) -> SteeringRun:  # fmt: skip
    """`load_steering` and `check` for the model of this config.json: negative layers resolved (their default
    safetensors keys too), shapes checked, values finite in the dtype the model computes in."""
    n_layers, hidden = model_shape(config)
    loaded = load_steering(source, base_dir, n_layers=n_layers, dtype=compute_dtype(config, dtype), missing=_SitesLater(config),
                           hidden=hidden)
    try:
        return SteeringRun(check(loaded.steering, n_layers, hidden, head_shape(config)), loaded.record)
    except SteeringError as e:  # the model's shape refuses it: name the file, as every other refusal does
        if isinstance(source, Steering):
            raise
        where = str(Path(source).expanduser()) if isinstance(source, (str, os.PathLike)) else "steering spec (dict)"
        from driver.steering.lmeval_csv import said_at_rows

        raise spec_error(where, "", said_at_rows(where, str(e))) from None


_WARNED: set[str] = set()


def warn_once(results: Any) -> None:
    """Print, once per process, each note a worker attached to a job's results (`worker.jobs.Results.notes`)."""
    from tqdm import tqdm

    for note in getattr(results, "notes", ()):
        label = note.split(":", 1)[0]  # one warning per intervention, whatever ratio each chunk measured
        if label not in _WARNED:
            _WARNED.add(label)
            tqdm.write(f"warning: {note}", file=sys.stderr)  # on its own line, above a progress bar
