"""The sweep file's `judge:` and `prompting:` blocks (driver.sweep.schema takes them into SweepFile)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

__all__ = ["PROMPT", "Judge", "check_prompting", "check_seeds", "sample_seeds"]

PROMPT = "prompt"  # a prompting baseline's op (driver.judge.prompting): never chosen as "best", no alpha

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class Judge(BaseModel):
    """A second model rating every generation: `model` (a folder, relative to the sweep file, or a Hub id), the
    `concept` the steering should bring out, and optionally a `rubric` folder replacing the shipped templates."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str
    concept: str
    rubric: str | None = None

    @field_validator("model", "concept")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty: give a model folder or Hub id, and the concept in words (e.g. joy, happiness)")
        return v


def check_prompting(v: Any) -> Any:
    """`prompting: {NAME: TEXT}`: names as a vector's, texts non-empty."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("must be a mapping of names to texts, e.g. {happy: \"Write a happy story.\"}")
    for name, text in v.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"name {name!r}: use letters, digits, '_' and '-'")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name}: the text to put before every prompt must be a non-empty string")
    return v


def check_seeds(prompt_set: Any, seed_given: bool) -> Any:
    """A prompt set's `seeds: [..]`: distinct, for sampled generations, instead of `seed:`; the set, checked."""
    seeds = prompt_set.seeds
    if seeds is None:
        return prompt_set
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError("seeds: list distinct seeds, at least one (e.g. [0, 1, 2])")
    if seed_given:
        raise ValueError("give `seed: S` (one sample per prompt) or `seeds: [..]` (one per seed), not both")
    if not prompt_set.generate or prompt_set.temperature <= 0:
        raise ValueError("seeds: each seed draws another sample only when sampling: set temperature > 0 (and generate: true)")
    return prompt_set


def sample_seeds(prompt_set: Any) -> tuple[int | None, ...]:
    """The seed of each text generated per prompt: `seeds`, else `seed`; (None,) when greedy (one text, no seed)."""
    if prompt_set.temperature <= 0:
        return (None,)
    return prompt_set.seeds or (prompt_set.seed,)
