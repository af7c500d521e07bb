"""What every file a user writes shares: pydantic errors in the user's words, YAML without repeated keys, JSONL.

Steering specs, sweep files, pairs and prompt sets all read through here: a pydantic error becomes a phrase, a
key given twice in YAML/JSON is refused naming its lines, and a JSONL file is read line by line with one-line errors.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml


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
    if kind == "greater_than_equal" and any(part in ("head", "heads") for part in err.get("loc", ())):
        from worker.spec import NEGATIVE_HEAD

        return f"{text}: {NEGATIVE_HEAD}: give a head >= 0"
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


def nonempty_unique(values: Any) -> Any:
    """A list a file gives (a grid's layers, a patch's sites ...) checked for what no validator's type says: empty,
    or a value listed twice. Words such as `all` pass through."""
    if isinstance(values, str) or values is None:
        return values
    if not values:
        raise ValueError("is empty: list at least one value")
    twice = [x for i, x in enumerate(values) if x in values[:i]]
    if twice:
        raise ValueError(f"{twice[0]!r} is listed twice")
    return values


def explain_field(err: dict, allowed: Sequence[str], loc: Sequence | None = None) -> str:
    """One pydantic error of a file's schema: a missing field, an unknown one (`allowed`: the fields where it
    occurred, the nearest suggested; `loc`: its location if not err's), a value not allowed; else `explain`."""
    kind = err["type"]
    if kind == "missing":
        return "missing (this field is required)"
    if kind == "extra_forbidden":
        near = difflib.get_close_matches(str((loc or err["loc"])[-1]), list(allowed), n=1)
        return f"unknown field ({'did you mean ' + repr(near[0]) + '? ' if near else ''}allowed: {', '.join(allowed)})"
    if kind == "literal_error":
        return f"{short(err.get('input'))} is not allowed ({err['msg'].replace('Input should be ', 'use ')})"
    return explain(err)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming a key twice is an error (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, tuple[int, Any, str]] = {}  # key -> its line, the key as read and as written
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges a mapping (its keys may be overridden here): the loader flattens it
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(None, None, _twice(seen[key], (line, key, key_node.value)), key_node.start_mark)
                seen.setdefault(key, (line, key, key_node.value))
        return super().construct_mapping(node, deep)


def _twice(first: tuple[int, Any, str], again: tuple[int, Any, str]) -> str:
    """Why two keys of one mapping clash: the same key twice, or two that Python reads as one (`1:` and `true:`)."""
    (a, key_a, text_a), (b, key_b, text_b) = first, again
    if type(key_a) is not type(key_b) and bool in (type(key_a), type(key_b)):
        return f"keys {text_a} (line {a}) and {text_b} (line {b}) are one key once read (true is 1, false is 0): keep one"
    where = f"line {b}" if a == b else f"lines {a} and {b}"
    return f"key {key_b!r} is given twice ({where}): keep one"


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, but a key given twice in one mapping raises a `yaml.YAMLError` naming it and its lines.
    JSON is YAML: a .json file reads the same way (and gets the same check)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one phrase: 'key 'alpha' is given twice (lines 3 and 4): keep one' or
    'malformed YAML at line L, column C: what the parser saw'."""
    problem = getattr(e, "problem", None) or str(e)
    if "is given twice" in problem or "are one key once read" in problem:
        return problem
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"malformed YAML{at}: {problem}".split())


def read_yaml_file(path: Path, kind: str, fail: Callable[[str], Exception]) -> Any:
    """A user's YAML (or JSON) file of `kind` ("sweep", "patch") read whole; every problem as `fail(one line)`."""
    from driver.checks.errors import one_line

    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise fail(f"{path}: not a {kind} file: use a .yaml, .yml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail(f"{path}: no such file (check the path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise fail(one_line(f"{path}: cannot read the file ({type(e).__name__}: {e})")) from None
    try:
        return load_yaml(text)  # JSON is YAML; a key given twice is refused, naming its lines
    except yaml.YAMLError as e:
        raise fail(one_line(f"{path}: {yaml_problem(e)}")) from None


def json_object(obj: Any, allowed: Sequence[str], at: str, fail: Callable[[str], Exception], expected: str) -> dict:
    """One JSONL line's object checked for its shape: a JSON object (`expected` says with what), no field outside
    `allowed`; the caller checks the fields' values."""
    if not isinstance(obj, dict):
        raise fail(f"{at}: expected a JSON object with {expected}, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise fail(f"{at}: unknown field {unknown[0]!r} (allowed: {', '.join(allowed)})")
    return obj


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


def read_npy(path: Path, fail) -> "np.ndarray":
    """A .npy file's array, never unpickled; `fail(problem)` makes the error to raise."""
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)  # never unpickle: a pickle can run code
    except ValueError as e:
        if "allow_pickle" in str(e):
            problem = what_it_is(path) or "holds pickled data or Python objects, not a plain array; save a float array with numpy.save"
            raise fail(f"{path} {problem}") from None
        raise fail(f"{path} is not a readable .npy file ({e})") from None
    except (OSError, EOFError) as e:
        raise fail(f"{path} is not a readable .npy file ({e})") from None
    if not isinstance(array, np.ndarray):  # np.load opens a zip (.npz) whatever its name
        raise fail(f"{path} is an .npz archive, not a .npy array; save one vector with numpy.save")
    return array


def what_it_is(path: Path) -> str | None:
    """What a file named .npy that numpy cannot read as an array really is, with the fix; None if unknown.
    np.load takes anything without the .npy magic for a pickle."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"\x93NUMPY"):
        return None  # a real .npy of Python objects
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return "is a safetensors file, not a .npy array: rename it to .safetensors (and give `key:` if needed)"
    if head.startswith(b"\x80"):
        return "is a pickle, which Orchard never loads (unpickling can run code); save a float array with numpy.save"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the 4096th byte
            return "is not a .npy array (no .npy header); save a float array with numpy.save"
    return "is a text file, not a .npy array; save a float array with numpy.save (numpy.loadtxt reads text)"
