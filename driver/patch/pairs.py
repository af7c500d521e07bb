"""A patch file's prompt pairs: read from JSONL, tokenized on the head as the model's tokenizer does by default,
and everything the head can refuse about them before any worker starts, one line naming the line."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.patch.schema import PatchError
from driver.steering.userfiles import json_object, jsonl_lines

FIELDS = ("clean", "corrupt", "correct", "wrong")


@dataclass(frozen=True)
class Pair:
    """One line of the pairs file, and its tokens (`tokenize`)."""

    clean: str
    corrupt: str
    correct: str
    wrong: str
    line: int
    clean_ids: tuple[int, ...] = ()
    corrupt_ids: tuple[int, ...] = ()
    correct_id: int = -1  # the first token of `correct` tokenized alone, without special tokens
    wrong_id: int = -1


def _pair(obj, at: str, line: int) -> Pair:
    json_object(obj, FIELDS, at, PatchError, ", ".join(FIELDS))
    for key in FIELDS:
        if key not in obj:
            raise PatchError(f"{at}: missing field {key!r}")
        if not isinstance(obj[key], str) or not obj[key]:
            raise PatchError(f"{at}: field {key!r} must be a non-empty string, not {obj[key]!r}")
    return Pair(obj["clean"], obj["corrupt"], obj["correct"], obj["wrong"], line)


def read_pairs(path: str | os.PathLike, where: str) -> list[Pair]:
    """One {"clean", "corrupt", "correct", "wrong"} object per line; blank lines skipped. `where`: the patch file."""
    path = Path(path)
    lines = jsonl_lines(path, PatchError, f"{where}: pairs: {path} does not exist", f"{where}: pairs: {path} is a folder, not a JSONL file")
    pairs = [_pair(obj, f"{path}: line {n}", n) for n, obj in lines]
    if not pairs:
        raise PatchError(f"{path}: no pairs (the file is empty): write one JSON object per line")
    return pairs


def _tokenized(pair: Pair, encode: Callable[..., list[int]], at: str, window: int) -> Pair:
    clean, corrupt = tuple(encode(pair.clean)), tuple(encode(pair.corrupt))
    if len(clean) != len(corrupt):
        raise PatchError(f"{at}: the clean prompt is {len(clean)} tokens and the corrupt one {len(corrupt)}: a pair must "
                         "tokenize to the same length (so positions line up); reword one side")  # fmt: skip
    if clean == corrupt:
        raise PatchError(f"{at}: the clean and corrupt prompts are the same tokens, so nothing differs to patch: make them differ")
    if len(clean) > window:
        raise PatchError(f"{at}: the prompts are {len(clean)} tokens, past the model's context of {window}: shorten them")
    answers = []
    for name in ("correct", "wrong"):
        ids = encode(getattr(pair, name), add_special_tokens=False)
        if not ids:
            raise PatchError(f"{at}: {name!r} {getattr(pair, name)!r} tokenizes to no token: give a word")
        answers.append(ids[0])
    if answers[0] == answers[1]:
        raise PatchError(f"{at}: 'correct' {pair.correct!r} and 'wrong' {pair.wrong!r} start with the same token (id "
                         f"{answers[0]}), so their logit difference is always 0: make their first tokens differ")  # fmt: skip
    return Pair(pair.clean, pair.corrupt, pair.correct, pair.wrong, pair.line, clean, corrupt, *answers)


def tokenize(pairs: Sequence[Pair], encode: Callable[..., list[int]], path: Path, window: int) -> list[Pair]:
    """Every pair with its tokens (the prompts as the tokenizer makes them by default, BOS included where it adds
    one), each refusal naming the file and line."""
    return [_tokenized(p, encode, f"{path}: line {p.line}", window) for p in pairs]


def same_length(pairs: Sequence[Pair], path: Path) -> int:
    """The one token length every pair has (a position names the same token slot in each); refused otherwise."""
    first = pairs[0]
    other = next((p for p in pairs if len(p.clean_ids) != len(first.clean_ids)), None)
    if other is not None:
        raise PatchError(f"{path}: line {other.line}: its prompts are {len(other.clean_ids)} tokens where line {first.line}'s "
                         f"are {len(first.clean_ids)}: patching by position needs every pair of one length (one template); "
                         "split the file by length, or patch only attn_head")  # fmt: skip
    return len(first.clean_ids)
