"""Where a grid configuration starts to change numbers, and its hooks (see worker.grid); the lower and upper passes
themselves run through worker.hooks.blocks."""

from __future__ import annotations

from collections.abc import Sequence

from ..hooks import Hook
from ..hooks.manager import splits_at_prompt
from ..load import LoadedModel
from ..spec import Steering, head_shape
from ..steer import hidden_size, hooks_for


# --- where a configuration starts to change numbers --------------------------------------------------


def _point_split(name: str) -> int:
    site, _, layer = name.rpartition(".")
    return int(layer) + 1 if site == "resid_post" else int(layer)  # the other sites are in or before block L


def split_point(steering: Steering | None, n_layers: int) -> int:
    """How many decoder blocks compute exactly what the plain model does under `steering`.

    resid_pre.L (and resid_mid.L, attn_out.L, mlp_out.L, inside block L) leave blocks 0..L-1 alone (L), resid_post.L
    blocks 0..L (L + 1); no intervention: n_layers. Negative layers count from the end.
    """
    out = n_layers
    for iv in steering.interventions if steering else ():
        layer = iv.layer + n_layers if iv.layer < 0 else iv.layer
        out = min(out, _point_split(f"{iv.site}.{layer}"))
    return out


def _installs(lm: LoadedModel, steerings: Sequence[Steering]) -> list[list[tuple[str, Hook]]]:
    """Each configuration's hooks, built (and checked against the model) once for the whole call."""
    hidden = hidden_size(lm) if any(steerings) else 0
    return [hooks_for(s, lm.n_layers, hidden, heads=head_shape(lm.config)) if s else [] for s in steerings]


def splits_prompt(installs: Sequence[list[tuple[str, Hook]]]) -> bool:
    """Whether any configuration's hooks treat prompt and continuation positions differently (rows then split there)."""
    return splits_at_prompt(op for install in installs for _, op in install)


def _split_of(install: list[tuple[str, Hook]], n_layers: int) -> int:
    return min((_point_split(name) for name, _ in install), default=n_layers)


