"""What `mlx` and `mlx-ray` are built from, before any worker starts: model_args in the worker's terms, the
model's small files (tokenizer, config.json, generation defaults), its steering and its identity."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.load import fingerprint, is_local, resolve
from worker.spec import NO_STEERING, Batching, ModelSpec, Steering

from driver.checks.model import check_vocabulary
from driver.checks.settings import MODEL_ARGS, RAY_ONLY, check_model_args, closest
from driver.steering.spec import for_model

_TOKENIZER_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _int_or_default(value: Any, default: int) -> int:
    if value is None or value == "auto" or str(value).startswith("auto"):
        return default
    return int(value)


def unknown_model_args(model: str, kwargs: dict, ray: bool) -> str:
    """The error for model_args no backend takes (`ray`: the `mlx-ray` ones are valid), with the closest valid one."""
    valid = [k for k in MODEL_ARGS if ray or k not in RAY_ONLY]
    first = sorted(kwargs)[0]
    return f"unknown model_args for {model}: {', '.join(sorted(kwargs))}{closest(first, valid)}"


def check_args(batch_size: int | str | None, **given: Any) -> None:
    """The model_args as given, checked in the user's words (one line); lm-eval's batch_size "auto" is the default."""
    if not str(batch_size).startswith("auto"):
        given["batch_size"] = batch_size
    check_model_args({k: v for k, v in given.items() if v is not None})


def model_spec(pretrained: str, adapter_path: str | None, revision: str | None, dtype: str | None,
               max_length: int | str | None, trust_remote_code: bool | str) -> ModelSpec:  # fmt: skip
    """The worker's ModelSpec of these model_args."""
    return ModelSpec(
        model=str(pretrained),
        adapter_path=adapter_path,
        revision=revision,
        dtype=dtype,
        max_length=int(max_length) if max_length else None,
        trust_remote_code=as_bool(trust_remote_code),
    )


def batching(batch_size: int | str, max_batch_tokens: int | str, prefix_reuse: bool | str, prefix_cache_mb: int | str = 1024) -> Batching:
    """The worker's Batching of these model_args."""
    return Batching(
        batch_size=_int_or_default(batch_size, 32),
        max_batch_tokens=int(max_batch_tokens),
        prefix_reuse=as_bool(prefix_reuse),
        prefix_cache_mb=int(float(prefix_cache_mb)),
    )


def tokenizer_folder(model: str, revision: str | None) -> Path:
    """Where the tokenizer lives: the model folder, or a tokenizer-only Hub snapshot (no weights)."""
    if is_local(model):
        return resolve(model)
    from mlx_lm.utils import _download

    return Path(_download(model, revision=revision, allow_patterns=_TOKENIZER_FILES))


def load_tokenizer(folder: Path, trust_remote_code: bool):
    """The model's HF tokenizer (the one lm-eval's hf backend uses)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    # Encoding a long few-shot prompt is not a mistake here (each request's window is cut, as lm-eval does):
    # mark transformers' "longer than the maximum" warning as already given.
    getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def model_config(model: str, revision: str | None = None) -> dict:
    """The model's config.json, read without loading weights (a Hub model: its small files only)."""
    return json.loads((tokenizer_folder(model, revision) / "config.json").read_text())


@dataclass(frozen=True)
class ModelFiles:
    """The model's small files as the head reads them: no weights."""

    folder: Path
    tokenizer: Any
    config: dict
    generation_defaults: dict  # generation_config.json, {} without one


def read_model_files(spec: ModelSpec) -> ModelFiles:
    """The tokenizer, config.json and generation defaults of `spec`'s model."""
    folder = tokenizer_folder(spec.model, spec.revision)
    tokenizer = load_tokenizer(folder, spec.trust_remote_code)
    config = json.loads((folder / "config.json").read_text())
    check_vocabulary(folder, tokenizer, config)
    gen_config = folder / "generation_config.json"
    return ModelFiles(folder, tokenizer, config, json.loads(gen_config.read_text()) if gen_config.exists() else {})


def model_steering(steer: str | dict | Steering | None, config: dict, dtype: str | None = None) -> tuple[Steering, dict | None]:
    """The steering active for every request of a model, checked against its config (in `dtype`, the model_args'
    dtype, else the config's) before any worker starts, and what the results record of it (None without steering)."""
    if steer is None or steer == "":
        return NO_STEERING, None
    loaded = for_model(steer, config, dtype)
    steering = loaded.steering
    return steering, {**loaded.record, "key": steering.key(), "resolved_layers": [i.layer for i in steering.interventions]}


def model_identity(spec: ModelSpec, folder: Path, max_length: int) -> dict:
    """What the results and the result cache record of the model: its name, files (fingerprints) and settings."""
    return {
        "model": spec.model,
        "revision": spec.revision,
        "adapter": fingerprint(Path(spec.adapter_path).expanduser()) if spec.adapter_path else None,
        "files": fingerprint(folder),
        "dtype": spec.dtype,
        "max_length": max_length,
    }
