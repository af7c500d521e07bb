"""Activation patching (issue 37): which layer, position and head carry a behaviour, over prompt pairs.

A request (`spec.PatchRequest`) is one (pair, cell); a chunk's requests of one pair share its clean and corrupt runs
(`pairs`), exact cells are rows of batches that start from the corrupt run's state below their layer (`exact`), and
attribution estimates every cell of a pair from one forward and one backward (`attribution`). `kernel.patch` runs a
chunk. `spec` is pure data (the driver imports it), so this package imports no MLX until `run` is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def run(lm: Any, requests: Sequence[Any], batching: Any = None) -> list[tuple[float, float, float]]:
    """(value, clean_ld, corrupt_ld) per request, in order: worker.patch.kernel.patch."""
    from .kernel import patch

    return patch(lm, requests, batching)
