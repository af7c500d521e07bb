"""What a patch job's requests are (issue 37): one (prompt pair, cell) each, plain frozen data.

The driver resolves every name first (layers non-negative, positions from 0 with the BOS, token ids of the
answers), so a request here is exactly what the worker computes; the contract is briefs' patch_contract.md.
Each request's result is (value, clean_ld, corrupt_ld): ld = logit[correct] - logit[wrong] at the last position;
value = the patched ld (exact), corrupt_ld + grad . (clean - corrupt) (attribution), corrupt_ld (no cell).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..spec import site_missing

PATCH_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head")
PATCH_METHODS = ("exact", "attribution")


class PatchCell(BaseModel):
    """One cell of the grid: a site at one layer, at one position (every site but attn_head) or one head."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site: Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head"]
    layer: int = Field(ge=0, description="0-based (the driver resolves `all` and negatives)")
    position: int | None = Field(default=None, ge=0, description="token index from 0, BOS included; None for attn_head")
    head: int | None = Field(default=None, ge=0, description="attn_head only")
    method: Literal["exact", "attribution"] = "exact"

    @model_validator(mode="after")
    def _position_or_head(self) -> "PatchCell":
        if self.site == "attn_head" and (self.head is None or self.position is not None):
            raise ValueError("an attn_head cell names a head and no position (a head is patched at every position)")
        if self.site != "attn_head" and (self.position is None or self.head is not None):
            raise ValueError(f"a {self.site} cell names a position and no head")
        return self


class PatchRequest(BaseModel):
    """One (pair, cell): the unit the executor chunks and caches. `cell` None: just the pair's two lds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clean: tuple[int, ...] = Field(min_length=1)
    corrupt: tuple[int, ...] = Field(min_length=1)
    correct: int = Field(ge=0)
    wrong: int = Field(ge=0)
    cell: PatchCell | None = None

    @model_validator(mode="after")
    def _same_length(self) -> "PatchRequest":
        if len(self.clean) != len(self.corrupt):
            raise ValueError(f"clean has {len(self.clean)} tokens and corrupt {len(self.corrupt)}: a pair must tokenize to the same length")
        if self.cell is not None and self.cell.position is not None and self.cell.position >= len(self.clean):
            raise ValueError(f"position {self.cell.position} is past the pair's {len(self.clean)} tokens")
        return self


def group_problem(grouping, cells) -> str | None:
    """Why a worker group (worker.spec.Grouping; None: one worker) cannot run these cells, in one line; None if it
    can. Pure: the driver asks it before Ray starts, the worker again before it computes."""
    if grouping is None or grouping.size < 2 or grouping.split == "pipeline":
        return None
    if any(c is not None and c.site == "attn_head" for c in cells):
        return "attn_head cells cannot run on a tensor-split group (each head lives on one rank only): use no --group-size"
    return None


def cell_problem(cell: PatchCell, n_layers: int, heads: int | None, missing: dict[str, str]) -> str | None:
    """Why `cell` does not fit a model of `n_layers` blocks and `heads` attention heads whose hooks lack `missing`
    (worker.spec.site_missing's table); None if it fits. Pure: the driver asks it with the skeleton's table."""
    if cell.layer >= n_layers:
        return f"layer {cell.layer} is out of range for a model with {n_layers} layers (use 0..{n_layers - 1})"
    if cell.head is not None and heads is not None and cell.head >= heads:
        return f"head {cell.head} is out of range for a model with {heads} attention heads (use 0..{heads - 1})"
    return site_missing(missing, cell.site, cell.layer)
