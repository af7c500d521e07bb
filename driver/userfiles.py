"""What every file a user writes for Orchard shares (steering specs, sweep files, pairs and prompt sets): one
pydantic error as a phrase in the user's words, and JSONL read line by line with one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def explain(err: dict, list_of: str = "a list") -> str:
    """One pydantic error (of the kinds every spec shares) as 'what is wrong, what to write instead'; the
    caller words missing and unknown fields and allowed values itself, knowing its models."""
    kind, value = err["type"], err.get("input")
    text = short(value)
    if kind.startswith("int_"):
        return f"must be an integer, not {text}"
    if kind == "finite_number":
        return f"must be a finite number, not {value}"
    if kind.startswith("float_"):
        if isinstance(value, str) and _is_number(value):  # PyYAML reads `1e3` as text
            return f"{text} is text, not a number (in YAML write 1000 or 1.0e+3, without quotes)"
        return f"must be a number, not {text}"
    if kind.startswith("bool_"):
        return f"must be true or false, not {text}"
    if kind in ("greater_than", "greater_than_equal"):
        return err["msg"].replace("Input should be", "must be") + f", not {text}"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    if kind in ("list_type", "tuple_type"):
        return f"must be {list_of}, not {text}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping of fields, not {text}"
    if kind.startswith("string_"):
        return f"must be a string, not {text}"
    return err["msg"]


def jsonl_lines(path: Path, fail: Callable[[str], Exception], missing: str, folder: str) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line; `fail(message)` is the caller's one-line error,
    `missing` / `folder` its message for a path that does not exist / is a folder."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail(missing) from None
    except IsADirectoryError:
        raise fail(folder) from None
    except UnicodeDecodeError as e:
        raise fail(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise fail(f"{path}: line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
    return lines
