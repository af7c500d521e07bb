"""Settings as users type them (`--batch-size 0`, `--model-args dtpye=float16`, `--gen-kwargs max_gen_toks=-1`):
each checked in the user's words, one line naming the flag (or model_args key), the bad value and what is allowed.

Pure and light (no lm-eval, Ray or MLX): the CLI checks every setting here before anything expensive runs, and
`OrchardLM` checks its model_args with the same rules, so `simple_evaluate(model="mlx", ...)` says the same.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import click

DTYPES = ("float32", "float16", "bfloat16")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class SettingError(ValueError):
    """A bad setting, in one line: where it was given, the value, and what is allowed."""


def closest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest choice, or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _at(where: str, value: Any) -> str:
    """"--batch-size 0" for a flag, "--model-args dtype=float8" for a key (`where` ends with "=")."""
    return f"{where}{_show(value)}" if where.endswith("=") else f"{where} {_show(value)}"


# --- one value -----------------------------------------------------------------------------------------------

# Numbers as a user writes them: ASCII digits only. Python's int() and float() also read `1_0` as 10 and other
# scripts' digits (Arabic-Indic "٣" as 3): a typo or a pasted glyph must be refused, not read as another number.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def as_written(value: Any, pattern: re.Pattern = _DECIMAL) -> str | None:
    """`value`'s text (stripped) if it is a number written with ASCII digits (`pattern`: _INTEGER or _DECIMAL),
    else None; ints and floats (not bools) pass as they are."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    text = value.strip() if isinstance(value, str) else None
    return text if text is not None and pattern.fullmatch(text) else None


def integer(value: Any) -> int | None:
    """An integer written with ASCII digits and an optional sign, else None (the one rule for whole numbers)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = as_written(value, _INTEGER) if isinstance(value, str) else None
    return int(text) if text is not None else None


def whole(where: str, value: Any, minimum: int, what: str) -> int:
    """An integer >= minimum, from an int or its text; `what` says what the number is ("rows per forward")."""
    text = as_written(value)
    as_float = float(text) if text is not None else math.nan
    number = integer(value)
    if number is None and math.isfinite(as_float) and as_float == int(as_float):
        number = int(as_float)  # "2.0", "1e3"
    if number is None:
        raise SettingError(f"{_at(where, value)}: not a whole number: give an integer >= {minimum} ({what}) in ASCII digits")
    if number < minimum:
        raise SettingError(f"{_at(where, number)}: too small: give an integer >= {minimum} ({what})")
    return number


def number(where: str, value: Any, what: str, *, low: float = 0.0, high: float | None = None, low_open: bool = False) -> float:
    """A finite float in [low, high] ((low, high] when low_open)."""
    text = as_written(value)
    x = float(text) if text is not None else math.nan
    bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    if not math.isfinite(x) or (x <= low if low_open else x < low) or (high is not None and x > high):
        raise SettingError(f"{_at(where, value)}: {what}: give a number {bounds}")
    return x


def boolean(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise SettingError(f"{_at(where, value)}: not a boolean (give true or false)")


def choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SettingError(f"{_at(where, value)}: unknown value (choose one of {', '.join(choices)})")
    return value


def text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingError(f"{_at(where, value)}: give a non-empty text")
    return value


class WholeNumber(click.ParamType):
    """Click's type for an integer option, by `integer`'s rule (click.INT takes `1_0` and other scripts' digits)."""

    name = "integer"

    def __init__(self, low: int | None = None, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        n = integer(value)
        if n is None:
            self.fail(f"{value!r} is not a whole number: write it in ASCII digits, e.g. 4", param, ctx)
        if self.low is not None and n < self.low:
            self.fail(f"{n} is too small: give at least {self.low}", param, ctx)
        if self.high is not None and n > self.high:
            self.fail(f"{n} is too large: give at most {self.high}", param, ctx)
        return n


WHOLE = WholeNumber()


# --- the flags of `driver run` / `driver vectors` --------------------------------------------------------------


def batch_size(value: Any, where: str = "--batch-size") -> int:
    return whole(where, value, 1, "rows per forward pass")


def max_length(value: Any, where: str = "--max-length") -> int | None:
    if value is None:
        return None
    return whole(where, value, 2, "the context window in tokens; leave the flag out for the model's own")


def num_fewshot(value: int | None) -> int | None:
    return None if value is None else whole("--num-fewshot", value, 0, "few-shot examples per question")


def threads(value: Any, where: str = "--threads") -> int | None:
    return None if value is None else whole(where, value, 1, "BLAS/OpenMP threads per worker")


SPLITS = ("auto", "pipeline", "tensor")


def group_size(value: Any, where: str = "--group-size") -> int | str:
    """Nodes that hold one copy of the model together: a whole number >= 1, or auto (the fewest that hold it)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return whole(where, value, 1, "nodes per copy of the model, or auto")


def split(value: Any, where: str = "--split") -> str:
    """How a group splits its model: pipeline (layer ranges), tensor (mlx-lm's shard), or auto (pipeline)."""
    return choice(where, str(value).strip().lower() if isinstance(value, str) else value, SPLITS)


def limit(value: str | None) -> float | int | None:
    """lm-eval's --limit: a count of documents per task (a whole number >= 1) or a fraction in (0, 1)."""
    if value is None:
        return None
    allowed = "give a whole number of documents per task (>= 1), or a fraction between 0 and 1"
    text = as_written(value)
    if text is None:
        raise SettingError(f"--limit {value}: {allowed}, in ASCII digits")
    x = float(text)
    if not math.isfinite(x) or x <= 0:
        raise SettingError(f"--limit {value}: {allowed}")
    if x < 1:
        return x
    if x != int(x):
        raise SettingError(f"--limit {value}: not a whole number: {allowed}")
    return int(x)


# --- --model-args ----------------------------------------------------------------------------------------------

# key -> (check(where, value) -> value, what is allowed); `pretrained`... have flags of their own in the CLI.
_Check = Callable[[str, Any], Any]
MODEL_ARGS: dict[str, tuple[_Check, str]] = {
    "pretrained": (text, "a model folder or Hugging Face repo id"),
    "batch_size": (lambda w, v: whole(w, v, 1, "rows per forward pass"), "rows per forward pass"),
    "max_batch_tokens": (lambda w, v: whole(w, v, 1, "padded tokens per forward pass"), "padded tokens per forward"),
    "max_length": (lambda w, v: whole(w, v, 2, "the context window in tokens"), "the context window"),
    "adapter_path": (text, "an mlx-lm LoRA adapter folder"),
    "dtype": (lambda w, v: choice(w, v, DTYPES), " | ".join(DTYPES)),
    "revision": (text, "a Hub revision"),
    "prefix_reuse": (boolean, "true | false"),
    "prefix_cache_mb": (lambda w, v: whole(w, v, 0, "MiB of prefix KV each worker keeps; 0: none"), "MiB of prefix KV per worker"),
    "max_gen_toks": (lambda w, v: whole(w, v, 1, "tokens generated at most"), "tokens generated at most"),
    "trust_remote_code": (boolean, "true | false"),
    "steer": (text, "a steering spec file"),
    # mlx-ray
    "workers": (text, "a count or all"),
    "address": (text, "auto | local | HOST:PORT"),
    "cache": (text, "a result-cache folder"),
    "dashboard": (boolean, "true | false"),
    "stage": (boolean, "true | false"),
    "threads": (lambda w, v: whole(w, v, 1, "BLAS/OpenMP threads per worker"), "threads per worker"),
    "max_restarts": (lambda w, v: whole(w, v, 0, "restarts of a crashed worker"), "restarts of a crashed worker"),
    "group_size": (lambda w, v: group_size(v, w), "nodes per copy of the model, or auto"),
    "split": (lambda w, v: split(v, w), " | ".join(SPLITS)),
}
RAY_ONLY = ("workers", "address", "cache", "dashboard", "threads", "max_restarts", "stage", "group_size", "split")


def parse_pairs(text_: str | None, flag: str) -> dict[str, str]:
    """`k=v,k2=v2` -> {k: v} (raw text values), refusing pieces without `=`, empty keys and repeated keys."""
    pairs: dict[str, str] = {}
    for piece in (text_ or "").split(","):
        if not piece.strip():
            continue
        key, eq, value = piece.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SettingError(f"{flag} {piece.strip()!r}: expected key=value (comma-separated, e.g. dtype=float16,max_length=2048)")
        if key in pairs:
            raise SettingError(f"{flag}: {key} is given twice")
        pairs[key] = value.strip()
    return pairs


def check_model_args(args: dict[str, Any], where: str = "model_args", *, allowed: Iterable[str] | None = None,
                     flags: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Each key known (else the closest valid one is suggested) and each value in range; returns checked values.

    `allowed`: the keys this model takes (default: every key); `flags`: keys the CLI sets with a flag of their own
    (key -> flag), refused here so that a flag and a model_arg never silently disagree."""
    keys = list(allowed) if allowed is not None else list(MODEL_ARGS)
    flags = flags or {}
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in flags:
            raise SettingError(f"{where} {key}={_show(value)}: set it with {flags[key]} instead")
        if key not in keys:
            valid = [k for k in keys if k not in flags]
            raise SettingError(f"{where}: unknown key {key!r}{closest(key, valid)} (valid keys: {', '.join(sorted(valid))})")
        check, _ = MODEL_ARGS[key]
        out[key] = value if value is None else check(f"{where} {key}=", value)
    return out


def model_args(text_: str | None, *, flags: dict[str, str], allowed: Iterable[str] | None = None,
               where: str = "--model-args") -> dict[str, Any]:  # fmt: skip
    """The CLI's --model-args, parsed and checked (values converted: ints, booleans)."""
    raw = parse_pairs(text_, where)
    return check_model_args(raw, where, allowed=allowed, flags=flags)


# --- --gen-kwargs ----------------------------------------------------------------------------------------------

MAX_TOKENS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's aliases
GEN_KWARGS: dict[str, _Check] = {
    "until": lambda w, v: str(v),
    **{k: (lambda w, v: whole(w, v, 1, "tokens generated at most")) for k in MAX_TOKENS},
    "do_sample": boolean,
    "temperature": lambda w, v: number(w, v, "the sampling temperature", low=0.0),
    "top_p": lambda w, v: number(w, v, "nucleus sampling keeps this probability mass", low=0.0, high=1.0, low_open=True),
    "top_k": lambda w, v: whole(w, v, 0, "sample among this many top tokens, 0 for all"),
}


def gen_kwargs(text_: str | None) -> dict[str, Any] | None:
    """--gen-kwargs as lm-eval reads it, each key one this backend uses, each value in range (converted)."""
    raw = parse_pairs(text_, "--gen-kwargs")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in GEN_KWARGS:
            raise SettingError(
                f"--gen-kwargs: unknown key {key!r}{closest(key, GEN_KWARGS)} (valid keys: {', '.join(sorted(GEN_KWARGS))})"
            )
        out[key] = GEN_KWARGS[key](f"--gen-kwargs {key}=", value)
    lengths = {k: out[k] for k in MAX_TOKENS if k in out}
    if len(set(lengths.values())) > 1:  # lm-eval would keep one of them silently
        given = " and ".join(f"{k}={v}" for k, v in lengths.items())
        raise SettingError(f"--gen-kwargs {given}: these name the same limit (new tokens at most) with different values: give one")
    return out or None
