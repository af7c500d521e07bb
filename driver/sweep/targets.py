"""A prompt set's target scores (summed or per-token mean log-probs) and the one-line warnings about them.

The warnings: targets of unequal token length, prompts longer than the context window (left-truncated, as lm-eval does)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def score(logprob: float, n_tokens: int, how: str) -> float:
    """A target's score: its summed log-prob (`sum`), or that over its tokens (`mean`)."""
    return logprob / max(1, n_tokens) if how == "mean" else logprob


def unequal_lengths(name: str, per_prompt: Sequence[dict[str, tuple[str, int]]], how: str) -> None:
    """Say once, unless the prompt set chose its `target_score` (`how`), that a prompt's targets differ in token
    length (`per_prompt`: {target: (text, tokens)} per prompt): their summed log-probs are compared."""
    uneven = [p for p in per_prompt if len({n for _, n in p.values()}) > 1]
    if how is not None or not uneven:
        return
    example = ", ".join(f"{t} {text!r} {n} token{'s' if n != 1 else ''}" for t, (text, n) in uneven[0].items())
    warn(
        f"prompt set {name!r}: {len(uneven)} of {len(per_prompt)} prompts have targets of unequal token length (e.g. "
        f"{example}); their summed log-probs (whole-target probabilities) are compared: set `target_score: mean` on the "
        "prompt set for the per-token mean, or `target_score: sum` to keep the sum and silence this"
    )


def truncated(name: str, long_targets: int, long_prompts: int, n_prompts: int, window: int) -> None:
    """Say once how many of a prompt set's texts are longer than the context window (their starts are cut)."""
    parts = [f"{n} {what}" for n, what in ((long_targets, "target requests"), (long_prompts, "generation prompts")) if n]
    if parts:
        warn(
            f"prompt set {name!r} ({n_prompts} prompts): {' and '.join(parts)} are longer than the context window "
            f"({window} tokens) and are left-truncated: shorten the prompts or raise model.max_length"
        )


def count_long(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], window: int) -> int:
    """Scoring requests the model sees cut: (context + continuation)[-(window + 1):] drops their start."""
    return sum(1 for ctx, cont in pairs if len(ctx) + len(cont) > window + 1)
