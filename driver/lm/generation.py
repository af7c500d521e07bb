"""lm-eval's generate_until requests as the worker's GenRequests: stop sequences, sampling defaults, a seed each."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from worker.generate import GenRequest, truncate


def request(lm: Any, context: str, gen_kwargs: dict, occurrence: int = 0, run_seed: int | None = None) -> GenRequest:
    """One request on `lm` (an OrchardLM: its tokenizer, max_gen_toks, generation defaults and context window);
    `occurrence`: how many equal requests came before it; `run_seed`: the run's seed for sampling (`request_seed`)."""
    kwargs = normalize_gen_kwargs(gen_kwargs, lm.max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=lm.tok_decode([lm.eot_token_id], False))
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    defaults = lm.generation_defaults
    do_sample = bool(kwargs.get("do_sample", False)) and temperature > 0
    gen_request = GenRequest(
        context=tuple(lm.tok_encode(context)),
        until=tuple(until),
        max_gen_toks=int(kwargs.pop("max_gen_toks")),
        do_sample=do_sample,
        temperature=temperature,
        # Unset sampling knobs fall back to the model's generation_config, as HF `generate` does.
        top_p=float(kwargs.get("top_p") or defaults.get("top_p") or 1.0),
        top_k=int(kwargs.get("top_k") or defaults.get("top_k", 50) or 0),
        seed=request_seed(context, gen_kwargs, occurrence, run_seed if do_sample else None),
    )
    return truncate(gen_request, lm.max_length)  # fails here, before any worker is busy


def request_seed(context: str, gen_kwargs: dict, occurrence: int, run_seed: int | None) -> int:
    """A per-request seed: the same request draws the same sample in any batch, on any worker; repeats of one
    request (lm-eval's `repeats`) draw different ones; another run seed (`--seed`: lm-eval's torch seed, which HF's
    sampling draws from) other ones. The seed is in the GenRequest, so in its result-cache key. Greedy requests
    get None here: their text does not depend on the run seed, so their cached rows serve every seed."""
    what = [context, gen_kwargs, occurrence] + ([] if run_seed is None else [run_seed])
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    return int.from_bytes(digest.digest()[:4], "little")


def occurrences(requests: Sequence[Any]) -> Iterator[tuple[str, dict, int]]:
    """Each request's (context, gen_kwargs) and how many equal requests came before it."""
    seen: Counter = Counter()
    for r in requests:
        context, gen_kwargs = r.args
        key = json.dumps([context, gen_kwargs], sort_keys=True, default=str)
        yield context, gen_kwargs, seen[key]
        seen[key] += 1
