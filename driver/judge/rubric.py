"""The judge's rubrics and ratings: AxBench's three 0–2 scales as template files (driver/judge/rubric/, or the
sweep file's `judge.rubric` folder), each generation's rubric prompt, and its rating read from the judge's
next-token probabilities of the digits "0", "1", "2" right after that prompt (normalized over the three):
the expected score Σ k·p_k. Pure functions: the requests go through the executor (driver.judge.rate)."""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["SCALES", "ANSWER", "DIGITS", "SHIPPED", "RubricError", "load_rubric", "judge_prompt", "digit_ids", "rating", "score"]

SCALES = ("concept", "instruction", "fluency")
FIELDS = {"concept": ("concept", "sentence"), "instruction": ("instruction", "sentence"), "fluency": ("sentence",)}
ANSWER = "Rating: [["  # the judge's reply so far: its next token is the rating's digit
DIGITS = ("0", "1", "2")
SHIPPED = Path(__file__).resolve().parent / "rubric"


class RubricError(ValueError):
    """A rubric folder or template that cannot rate: the message says which file and what to write."""


def _fields(template: str, path: Path) -> set[str]:
    """The {names} a template fills; positional or formatted fields are refused."""
    try:
        names = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise RubricError(f"{path}: {e} (write a literal brace as {{{{ or }}}})") from None
    bad = next((n for n, spec, conv in names if not n.isidentifier() or spec or conv), None)
    if bad is not None:
        raise RubricError(f"{path}: field {{{bad}}}: use plain names such as {{sentence}} (a literal brace: {{{{ or }}}})")
    return {n for n, _, _ in names}


def load_rubric(folder: Path | None = None) -> dict[str, str]:
    """{scale: template} from `folder` (default: the shipped AxBench templates): concept.txt ({concept},
    {sentence}), instruction.txt ({instruction}, {sentence}), fluency.txt ({sentence}); one final newline of a
    file is dropped."""
    folder = SHIPPED if folder is None else Path(folder)
    if not folder.is_dir():
        raise RubricError(f"{folder}: not a folder: give a folder holding concept.txt, instruction.txt and fluency.txt")
    out = {}
    for scale in SCALES:
        path = folder / f"{scale}.txt"
        try:
            text = path.read_text(encoding="utf-8").removesuffix("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise RubricError(f"{path}: cannot read it ({type(e).__name__}): each scale needs its template {scale}.txt") from None
        used, allowed = _fields(text, path), set(FIELDS[scale])
        if used - allowed or "sentence" not in used:
            unknown = sorted(used - allowed)
            what = f"unknown field {{{unknown[0]}}}" if unknown else "no {sentence} (the generated text to rate)"
            raise RubricError(f"{path}: {what}: the {scale} template takes {', '.join('{' + f + '}' for f in FIELDS[scale])}")
        out[scale] = text
    return out


def judge_prompt(tokenizer, template: str, *, concept: str, instruction: str, sentence: str) -> str:
    """The exact text the judge reads: the filled template as the user's turn of its chat template (where it has
    one), else the template and a blank line; then the start of its reply, ANSWER."""
    user = template.format(concept=concept, instruction=instruction, sentence=sentence)
    if getattr(tokenizer, "chat_template", None):
        turn = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        return turn + ANSWER
    return f"{user}\n\n{ANSWER}"


def digit_ids(tokenizer) -> list[int] | str:
    """The token ids of "0", "1", "2" (tokenizer.convert_tokens_to_ids), or why the judge cannot rate with them."""
    ids = [tokenizer.convert_tokens_to_ids(d) for d in DIGITS]
    unknown = getattr(tokenizer, "unk_token_id", None)
    missing = [d for d, i in zip(DIGITS, ids) if i is None or (unknown is not None and i == unknown)]
    if missing or len(set(ids)) != len(ids):
        return f"its vocabulary has no token {missing[0]!r}" if missing else "its digits 0, 1, 2 are not three tokens"
    return ids


def rating(logprobs: Sequence[float]) -> float | None:
    """The expected score Σ k·p_k, p_k = the digit k's probability normalized over the three (None: not finite)."""
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in logprobs):
        return None
    top = max(logprobs)
    weights = [math.exp(x - top) for x in logprobs]
    return sum(k * w for k, w in enumerate(weights)) / sum(weights)


def score(ratings: Mapping[str, float | None]) -> float | None:
    """AxBench's combined score: the harmonic mean of the three ratings, 0 when any is 0 (None when one is missing)."""
    values = [ratings.get(s) for s in SCALES]
    if any(v is None for v in values):
        return None
    if any(v == 0 for v in values):
        return 0.0
    return len(values) / sum(1 / v for v in values)
