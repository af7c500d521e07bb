"""Loglikelihood requests in growing pieces, so workers start on the first while the head tokenizes the rest,
and which requests of a piece are checked against lm-eval's own tokenization."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

FIRST_PIECE, LARGEST_PIECE = 256, 8192  # requests: the first piece small, to start workers within a second


SPOT_CHECKS = 4  # requests per piece re-tokenized by lm-eval's own path


def spot_checks(lo: int, hi: int) -> list[int]:
    """Which requests of piece [lo, hi) to compare with lm-eval's path: its first, last and evenly between."""
    return sorted({lo + (hi - 1 - lo) * k // (SPOT_CHECKS - 1) for k in range(SPOT_CHECKS)}) if hi > lo else []


def pieces(contexts: Sequence[str]) -> Iterator[tuple[int, int]]:
    """[lo, hi) bounds of growing pieces of a request list, each ending where the context changes (so the answer
    choices of one question, which share their input, stay in one piece)."""
    lo, size, n = 0, FIRST_PIECE, len(contexts)
    while lo < n:
        hi = min(lo + size, n)
        while hi < n and contexts[hi] == contexts[hi - 1]:
            hi += 1
        yield lo, hi
        lo, size = hi, min(2 * size, LARGEST_PIECE)
