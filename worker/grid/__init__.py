"""Grids of steering configurations on one loaded model: every (configuration, request) pair of a chunk.

Steering at hook point resid_pre.L or resid_post.L cannot change anything the decoder blocks below it compute.
A configuration's "split" s is the number of blocks it leaves alone (resid_pre.L: L, resid_post.L: L + 1, the
lowest of its interventions; none: all). For loglikelihood work the unsteered stream runs once per batch, and
each configuration branches off it at its split (`loglikelihood`):

    lower pass   (once, unsteered)      tokens -> blocks 0..s1-1 -> h  (captured; blocks >= s1 pass x through)
    upper pass   (per configuration of split s1, its hooks installed)
                                        blocks 0..s1-1 return h (resid_post.{s1-1} hooks run on it) -> blocks
                                        s1..n-1 -> final norm -> LM head at the scored positions only
    advance      (once, unsteered)      h -> blocks s1..s2-1 -> the state at the next split s2, and so on

so the unsteered blocks up to the highest split run once and each configuration runs only its own blocks. A
shared few-shot prefix (worker.score's families) is split the same way: its unsteered layers' KV caches are
computed once, each configuration's upper layers' caches once per configuration (under its steering, as an
independent steered run computes them). Generation (`generation`) shares prompts the same way through the
prefix store: configurations alike on prompt positions share each whole prompt's KV (and decode side by side,
a row per request and configuration), the others of one split its unsteered lower layers' KV and the state
entering block s. On a pipeline group every grid job is pipelined instead (`pipelined`).

The mechanism is generic over mlx-lm models because it touches only the decoder blocks, the way
worker.hooks does: for the duration of one forward a block's class is swapped for a subclass whose
`__call__` passes its input through, records its output, or returns the captured state (worker.hooks.blocks).
The model's own `__call__` (embeddings, position embeddings, embedding scaling, masks built from the caches' offsets) runs
unchanged, so gpt2's position embeddings or gemma's scaling are computed lazily and never evaluated above the
split. Whether this holds for a model is checked once per split with a probe equality test (with and
without a prefix KV cache), as `Head.for_model` does; architectures where it does not hold (a forward that
reads blocks' outputs elsewhere, blocks returning tuples, ...) run each configuration on its own: the same
numbers, just no sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..load import LoadedModel
from ..spec import Batching, Steering, SteeringError
from ..split import stages
from . import pipelined
from .generation import grid_generate
from .loglikelihood import GRID_BLOCK, grid_loglikelihood
from ..hooks.blocks import shares_lower
from .passes import split_point

__all__ = ["GRID_BLOCK", "KINDS", "distinct", "grid_generate", "grid_loglikelihood", "run_grid", "shares_lower", "split_point"]

KINDS = ("loglikelihood", "generate")


def distinct(steerings: Sequence[Steering]) -> tuple[list[Steering], list[int]]:
    """The distinct configurations (first occurrence order), and which one each given configuration is."""
    index: dict[str, int] = {}
    owner = [index.setdefault(s.key(), len(index)) for s in steerings]
    configs = [s for i, (s, o) in enumerate(zip(steerings, owner)) if o not in owner[:i]]
    return configs, owner


def run_grid(
    lm: LoadedModel, kind: str, steerings: Sequence[Steering], requests: Sequence[Any], batching: Batching | None = None
) -> list[list]:
    """Results per request per configuration ([request][configuration]); identical configurations run once."""
    if kind not in KINDS:
        raise ValueError(f"a grid runs {' or '.join(KINDS)} work, not {kind!r}")
    if any(s.conditional for s in steerings):  # its probes need every row's whole prompt, which a grid shares
        raise SteeringError("a grid of configurations cannot hold conditional steering yet: run each as its own job")
    configs, owner = distinct(steerings)
    batching = batching or Batching()
    if stages.pipelined(lm):  # a pipeline group: every kind runs (configuration, batch) micro-batches
        out = pipelined.run(lm, kind, configs, requests, batching)
    else:
        out = (grid_loglikelihood if kind == "loglikelihood" else grid_generate)(lm, configs, requests, batching)
    return out if len(configs) == len(owner) else [[r[o] for o in owner] for r in out]
