"""Choosing each next token and ending each row, with lm-eval HF-backend semantics: HF's logit warpers
(temperature, top-k, top-p), per-request seeded draws that do not depend on the batch, stop strings checked
on decoded text as lm-eval's stopping criteria do, and lm-eval's cut of the returned text. Plain functions over
logits and token ids; worker.generate runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

NON_FINITE = "the model's next-token scores are NaN or infinite"


def finite_flag(logits: mx.array) -> mx.array:
    """A lazy flag: the logits' sum is finite, so every logit is, in one pass (an isfinite mask over rows x
    vocabulary took 16 ms a step for 160 rows here, the sum 4 ms); `check_finite` re-checks a false one exactly."""
    return mx.isfinite(logits.sum())


def check_finite(finite: mx.array, logits: mx.array) -> None:
    """Never a token drawn from NaN/inf scores (argmax would pick token 0 and call it text); a sum that only
    overflowed is not refused."""
    if not finite.item() and not mx.isfinite(logits).all().item():
        raise ValueError(f"{NON_FINITE}: check the model's weights and the steering")


def sample_keys(r: Any) -> mx.array:
    """A request's random keys, one per new token."""
    # One key per step derived from the request's own seed alone, so the draw at step t does not depend on
    # which other rows share the batch.
    return mx.random.split(mx.random.key(r.seed & 0xFFFFFFFFFFFFFFFF), max(2, r.max_gen_toks))


def warp_logits(logits: mx.array, reqs: Sequence[Any]) -> mx.array:
    """HF's warpers in HF's order: temperature, top-k, top-p (TopPLogitsWarper, keeps at least one)."""
    neg_inf = mx.array(-float("inf"), mx.float32)
    logits = logits / mx.array([r.temperature if not r.greedy else 1.0 for r in reqs])[:, None]
    V = logits.shape[-1]
    top_k = [min(r.top_k, V) if r.top_k > 0 else V for r in reqs]
    if any(k < V for k in top_k):
        # Remove everything below each row's k-th largest logit (ties kept, like HF).
        desc = -mx.sort(-logits, axis=-1)
        kth = mx.take_along_axis(desc, mx.array(top_k)[:, None] - 1, axis=-1)
        logits = mx.where(logits < kth, neg_inf, logits)
    top_p = mx.array([r.top_p for r in reqs], mx.float32)[:, None]
    if any(r.top_p < 1.0 for r in reqs):
        order = mx.argsort(logits, axis=-1)  # ascending, as HF sorts
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        cum = mx.cumsum(mx.softmax(sorted_logits, axis=-1), axis=-1)
        remove = (cum <= 1 - top_p) & (mx.arange(V)[None, :] < V - 1) & (top_p < 1.0)
        # Scatter the sorted-order decision back to vocabulary order.
        remove = mx.take_along_axis(remove, mx.argsort(order, axis=-1), axis=-1)
        logits = mx.where(remove, neg_inf, logits)
    return logits


def next_tokens(logits: mx.array, reqs: Sequence[Any], keys: Sequence[Any], step: int) -> mx.array:
    """Each row's next token: argmax for greedy requests, else a draw with the row's key for this step."""
    greedy = mx.argmax(logits, axis=-1)
    if all(r.greedy for r in reqs):
        return greedy
    # Gumbel-max: argmax(logits + G) is a draw from softmax(logits); each row draws with its own key.
    V = logits.shape[-1]
    noise = mx.stack([mx.random.gumbel((V,), key=k[step]) if k is not None else mx.zeros((V,)) for k in keys])
    sampled = mx.argmax(warp_logits(logits, reqs) + noise, axis=-1)
    return mx.where(mx.array([r.greedy for r in reqs]), greedy, sampled)


def lookback(until: Sequence[str]) -> int:
    """How many of a row's newest tokens `stopped` decodes."""
    # Tokens to re-decode per step: a stop string completed by the newest token lies in the last len(stop)
    # characters, which come from at most 4 tokens each (byte tokens); the slack absorbs the window's
    # first characters, which may decode differently on their own (half a UTF-8 char, a dropped space).
    return 4 * max((len(t) for t in until), default=0) + 16


def stopped(tokenizer: Any, ids: list[int], until: Sequence[str], window: int) -> bool:
    """The newest of `ids` completes one of the stop strings `until` (the last `window` tokens decoded: `lookback`)."""
    # Special tokens are kept, as in lm-eval's MultiTokenEOSCriteria, so a stop string like "<|im_end|>"
    # ends generation even when it is not an EOS id; the returned text is decoded without them.
    text = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(term and term in text for term in until)


def stop_at(text: str, until: Sequence[str]) -> str:
    """lm-eval's postprocess_generated_text: cut at each non-empty stop string in turn."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text
