"""One rank's share of a split model: split the lazily loaded model, then materialize only what this rank keeps.

worker.load.load(spec, group=..., grouping=...) loads lazily, calls `split_share`, then checks and wraps the
share as it does a whole model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..hooks import HookManager, instrument
from ..spec import Grouping
from . import pipeline
from .plan import check

if TYPE_CHECKING:
    import mlx.core as mx


class SplitError(ValueError):
    """A model this group cannot split so; one line naming the problem and the fix."""


def _materialize(model: Any) -> None:
    """Evaluate the kept weights one tensor at a time: a tensor split slices full tensors, so only one full tensor
    is ever in memory beside the share."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, weight in tree_flatten(model.parameters()):
        mx.eval(weight)


def _split(model: Any, group: "mx.distributed.Group", grouping: Grouping, n_layers: int, config: dict) -> tuple[int, int]:
    if grouping.split == "pipeline":
        return pipeline.split(model, group, config)
    model.shard(group)
    return 0, n_layers


def split_share(model: Any, config: dict, dtype: str | None, group: "mx.distributed.Group",
                grouping: Grouping | None) -> tuple[HookManager, Grouping, tuple[int, int]]:  # fmt: skip
    """Instrument (global layer indices), split, cast and materialize a lazily loaded model, in place; returns its
    hooks, the grouping and this rank's global [start, end) of blocks. SplitError before any weight is read."""
    import mlx.core as mx

    grouping = grouping or Grouping(size=group.size())
    if grouping.size != group.size():
        raise SplitError(f"grouping says {grouping.size} ranks but the ring has {group.size()}: form the ring "
                         "with one rank per node of the group")  # fmt: skip
    problem = check(config, grouping.size, grouping.split)
    if problem:
        raise SplitError(problem)
    hooks = instrument(model)  # before the split: every block keeps its global layer index
    layers = _split(model, group, grouping, hooks.n_layers, config)
    hooks.owned, hooks.group = range(*layers), group
    if dtype is not None and "quantization" not in config:
        model.set_dtype(getattr(mx, dtype))
    _materialize(model)
    return hooks, grouping, layers
