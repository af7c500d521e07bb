"""A patch chunk's prompt pairs: the requests grouped by pair, and each pair's clean and corrupt runs (one forward
of two rows), which keep every activation the pair's cells read: the clean run's (what exact cells put in, what
attribution takes the difference to) and the corrupt run's (attribution's other end, and the state entering each
block that exact cells start from: worker.patch.exact)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx

from ..hooks import HookContext, Rows
from ..hooks.blocks import kv_cache
from .spec import PatchCell, PatchRequest
from .suffix import keep, runs_suffixes


def point(cell: PatchCell) -> str:
    """The hook point a cell patches (`attn_out.3`)."""
    return f"{cell.site}.{cell.layer}"


def split(cell: PatchCell) -> int:
    """How many blocks a cell leaves as the corrupt run computes them: resid_post.L patches block L's output (L + 1),
    every other site is in or before block L (L)."""
    return cell.layer + 1 if cell.site == "resid_post" else cell.layer


@dataclass
class Pair:
    """One prompt pair of a chunk and what its runs keep: per hook point, the clean and corrupt activations
    ([T, width] each, the model's dtype); the two logit differences once read."""

    clean: tuple[int, ...]
    corrupt: tuple[int, ...]
    correct: int
    wrong: int
    requests: list[int] = field(default_factory=list)  # indices of the chunk's requests on this pair
    clean_acts: dict[str, mx.array] = field(default_factory=dict)
    corrupt_acts: dict[str, mx.array] = field(default_factory=dict)
    clean_ld: float = 0.0
    corrupt_ld: float = 0.0
    corrupt_kv: list | None = None  # per layer, the corrupt run's (keys, values) (worker.patch.suffix); None: not kept

    @cached_property
    def first_difference(self) -> int:
        return first_difference(self.clean, self.corrupt)

    def points(self, requests: Sequence[PatchRequest]) -> set[str]:
        """The hook points this pair's runs keep: its cells' points, and the state entering each exact cell's split
        (resid_post of the block below it; none below block 0)."""
        cells = [requests[i].cell for i in self.requests if requests[i].cell is not None]
        kept = {point(c) for c in cells}
        return kept | {f"resid_post.{split(c) - 1}" for c in cells if c.method == "exact" and split(c) > 0}


def first_difference(clean: Sequence[int], corrupt: Sequence[int]) -> int:
    """The first position where the two prompts' tokens differ (their length where none does)."""
    return next((p for p, (a, b) in enumerate(zip(clean, corrupt)) if a != b), len(clean))


def unchanged(pair: Pair, cell: PatchCell) -> bool:
    """Whether patching `cell` puts in what is already there: a position before the prompts' first differing token,
    where causal attention makes the clean and corrupt activations equal at every site and layer. The patched run
    is then the corrupt run: its logit difference, no forward (what a per-cell loop spends a forward on)."""
    return cell.position is not None and cell.position < pair.first_difference


def pairs_of(requests: Sequence[PatchRequest], max_length: int) -> list[Pair]:
    """The chunk's distinct pairs in order of first appearance, each naming its requests."""
    found: dict[tuple, Pair] = {}
    for i, r in enumerate(requests):
        if len(r.clean) > max_length:
            raise ValueError(f"request {i}: its prompts have {len(r.clean)} tokens, past the model's max_length {max_length}")
        key = (r.clean, r.corrupt, r.correct, r.wrong)
        found.setdefault(key, Pair(*key)).requests.append(i)
    return list(found.values())


class Record:
    """Capture hook: the whole activation of every row, as it is (no copy, no cast), into `into` (the dict of the
    pair whose forward is being built; None: nothing kept)."""

    into: dict | None = None

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        if self.into is not None:
            self.into[ctx.name] = x
        return x


def recorders(pairs: Sequence[Pair], requests: Sequence[PatchRequest]) -> dict[str, Record]:
    """One Record per hook point any pair of the chunk keeps (each pair keeps them all: they are computed anyway)."""
    return {name: Record() for name in sorted(set().union(*(pair.points(requests) for pair in pairs)))}


def pair_body(lm, pair: Pair, records: dict[str, Record], kept: dict, cache: list | None = None) -> mx.array:
    """The lazy forward of the pair's two rows (clean, corrupt), its activations going into `kept` (its keys and
    values into `cache`, fresh, when given)."""
    for record in records.values():
        record.into = kept
    with lm.hooks.forward(Rows()):
        return lm.head.body(mx.array([pair.clean, pair.corrupt]), cache=cache)


def settle(pair: Pair, kept: dict, lds: Sequence[float] | None) -> None:
    """The pair's activations (rows 0 and 1 of what its forward kept) and lds (None: another rank reads them)."""
    pair.clean_acts = {name: a[0] for name, a in kept.items()}
    pair.corrupt_acts = {name: a[1] for name, a in kept.items()}
    if lds is not None:
        pair.clean_ld, pair.corrupt_ld = lds


def logit_diff(lm, hidden: mx.array, correct: Sequence[int], wrong: Sequence[int]) -> mx.array:
    """Per row, logit[correct] - logit[wrong] at the last position (float32, lazy) from the body's output."""
    logits = lm.head.head(hidden[:, -1, :]).astype(mx.float32)
    rows = mx.arange(logits.shape[0])
    return logits[rows, mx.array(list(correct))] - logits[rows, mx.array(list(wrong))]


def pair_lds(lm, pair: Pair, hidden: mx.array) -> mx.array:
    return logit_diff(lm, hidden, [pair.correct] * 2, [pair.wrong] * 2)


def run_pairs(lm, pairs: Sequence[Pair], requests: Sequence[PatchRequest]) -> None:
    """Each pair's clean and corrupt runs, one forward of two rows per pair: fills its activations and lds."""
    records, suffixes = recorders(pairs, requests), runs_suffixes(lm)  # probed before the records are installed
    with lm.hooks.installed(list(records.items())):
        for pair in pairs:
            kept: dict = {}
            cache = kv_cache(lm) if suffixes else None
            lds = pair_lds(lm, pair, pair_body(lm, pair, records, kept, cache))
            pair.corrupt_kv = keep(cache, 1)
            mx.eval(lds, list(kept.values()), pair.corrupt_kv or [])
            settle(pair, kept, lds.tolist())
