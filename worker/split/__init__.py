"""Worker groups: one model split across the ranks of an `mx.distributed` ring (issue 17).

`check` and `layer_ranges` are pure (the driver uses them before anything loads); `ring` joins the ring;
`worker.load.load(spec, group=..., grouping=...)` loads this rank's share (`share`, `pipeline`). On a pipeline
group loglikelihood and generate jobs run pipelined (issue 26): `schedule` is the plan of steps, `stages` runs it
on a rank (`decode`: generation round the ring).
"""

from typing import Any

from .plan import SPLITS, answering_rank, check, has_shard, layer_ranges, peak_memory_gb, smallest_size

__all__ = ["SPLITS", "RingError", "answering_rank", "check", "free_address", "has_shard", "join", "layer_ranges", "peak_memory_gb", "smallest_size"]
_RING = ("RingError", "free_address", "join")


def __getattr__(name: str) -> Any:
    """The ring's names on first use: `ring` imports worker.load, which imports `plan` from this package."""
    if name in _RING:
        from . import ring

        return getattr(ring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
