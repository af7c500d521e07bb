"""A patch run's heatmaps: per site, the mean `recovered` per layer x position (the tokens on the axis), or per
layer x head for attn_head; diverging colours centred on 0; exact and attribution side by side when both ran.
Each function returns the PNG's bytes."""

from __future__ import annotations

import io
from collections.abc import Sequence

from driver.patch.rows import of_metric

DPI = 80
METRIC = "recovered"


def _matrix(rows: Sequence[dict], layers: list[int], columns: list[int], column: str):
    import numpy as np

    m = np.full((len(layers), len(columns)), np.nan)
    for r in rows:
        if r["value"] is not None:
            m[layers.index(r["layer"]), columns.index(r[column])] = r["value"]
    return m


def _size(n_columns: int, n_layers: int, panels: int) -> tuple[float, float]:
    return (min(30.0, 1.2 + panels * (1.0 + 0.42 * n_columns)), min(20.0, 1.6 + 0.34 * n_layers))


def heatmap(rows: Sequence[dict], site: str, labels: Sequence[str] = ()) -> bytes:
    """One site's heatmap of mean `recovered`, a panel per method; `labels`: each position's token."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    mine = of_metric(rows, METRIC, site=site)
    methods = list(dict.fromkeys(r["method"] for r in mine))
    column = "head" if site == "attn_head" else "position"
    layers, columns = sorted({r["layer"] for r in mine}), sorted({r[column] for r in mine})
    matrices = [_matrix(of_metric(mine, METRIC, method=m), layers, columns, column) for m in methods]
    bound = max([float(np.nanmax(np.abs(m))) for m in matrices if np.isfinite(m).any()] + [1e-12])
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound)
    fig = plt.figure(figsize=_size(len(columns), len(layers), len(methods)), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(methods), squeeze=False)[0]
    for ax, method, m in zip(axes, methods, matrices):
        image = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu_r", norm=norm, aspect="auto", origin="lower")
        ticks = [labels[c] if column == "position" and c < len(labels) else str(c) for c in columns]
        ax.set_xticks(range(len(columns)), [f"{c}: {t}" if column == "position" else t for c, t in zip(columns, ticks)],
                      rotation=90 if column == "position" else 0, fontsize=7)  # fmt: skip
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=7)
        ax.set_xlabel("attention head" if column == "head" else "position: token (clean/corrupt)")
        ax.set_ylabel("layer")
        ax.set_title(method, fontsize=9)
        _annotate(ax, m, norm)
    fig.colorbar(image, ax=list(axes), shrink=0.9).set_label("recovered: (patched - corrupt) / (clean - corrupt)", fontsize=8)
    fig.suptitle(f"{site}: share of the clean-vs-corrupt logit difference recovered, mean over pairs", fontsize=9)
    return _png(fig)


def _annotate(ax, m, norm) -> None:
    """Each cell's value, where the panel is small enough to read it."""
    import numpy as np

    if m.size > 400:
        return
    for (i, j), v in np.ndenumerate(m):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if abs(norm(v) - 0.5) > 0.3 else "black")


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()
