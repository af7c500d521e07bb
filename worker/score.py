"""Scoring kernels: lm-eval loglikelihood over token ids, with HF-backend semantics. No Ray, no lm-eval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx


@dataclass
class Head:
    """Split of a model into body (tokens -> final hidden states) and head (hidden -> logits).

    Scoring needs logits only at the positions being scored; running the LM head on those rows alone
    saves a [tokens x vocab] matmul per forward. `split` is False when the model does more than
    `head(body(x))` (logit soft-capping, scaling...): then the full forward runs and rows are gathered.
    """

    body: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]
    split: bool

    @classmethod
    def for_model(cls, model: Any) -> "Head":
        full = cls(lambda x, cache=None: model(x, cache=cache), lambda h: h, False)
        inner = getattr(model, "model", None)
        if inner is None:
            return full
        if getattr(model, "lm_head", None) is not None and not getattr(getattr(model, "args", None), "tie_word_embeddings", False):
            head = model.lm_head
        else:
            emb = getattr(inner, "embed_tokens", None) or getattr(inner, "wte", None)
            if emb is None or not hasattr(emb, "as_linear"):
                return full
            head = emb.as_linear
        split = cls(lambda x, cache=None: inner(x, cache=cache), head, True)
        probe = mx.array([[1, 2, 3, 4]])
        try:
            same = mx.array_equal(split.head(split.body(probe)), model(probe)).item()
        except Exception:
            same = False
        return split if same else full
