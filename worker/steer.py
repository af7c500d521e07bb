"""Steering: the residual-stream ops as hooks, and `steered(lm, steering)` around one job.

Each op edits the residual stream `x` ([batch, seq, hidden]) at the positions it selects and leaves every
other position, pads included, exactly as it was; it computes in `x`'s dtype. With u = v/|v|:

    add      x + alpha*v
    replace  x + alpha*(v - x)      (alpha 1 puts v there exactly)
    ablate   x - (x.u)u
    clamp    x + (alpha - x.u)u     (the component along u becomes alpha)

At `attn_head.L` (the heads' outputs side by side, [batch, seq, heads*head_dim]) an op with `head: h` runs
on that head's columns h*d:(h+1)*d only (`OnHead`); the other heads' columns stay exactly as they were.

Ops carry `.positions` so the scoring kernel knows when prompt and continuation must be told apart
(`HookManager.splits_prompt`). `worker.hooks` is the mechanism; this module only says what to do.

Under `steered(..., notes)` each op also looks, on its first forward, at what it is about to do (one host
sync per op per job; grids do not look): if what it writes, ‖α·v‖, is over SWAMPED times the residual's mean
norm at the positions it steers, or α·v is not finite in the residual's dtype, it keeps a one-line note that
`steered` hands to the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .hooks import POSITIONS, Capture, Hook, HookContext, Rows
from .hooks.condition import WhenFired, gated
from .load import model_shape
from .spec import HEAD_SITES, Steering, SteeringError, head_shape, unit

__all__ = ["OPS", "Ablate", "Add", "Clamp", "OnHead", "OnRows", "Replace", "SteeringError", "hidden_size", "hooks_for", "side_by_side", "steered"]

# ‖α·v‖ over this many times the residual norm swamps the stream: what differs between inputs is under a tenth
# of what the next block's norm layer sees. Measured on TinyStories-260K (add at layer 3, a random unit direction,
# 5 stories x 4 endings): the spread of an ending's log-likelihood across stories is 3.04 nats unsteered, 0.11
# at 10x, 0.011 at 100x and 0 at 1e30x (each document then gets the same four numbers), falling as 1/ratio.
SWAMPED = 10.0


def _at(positions: str, x: mx.array, ctx: HookContext, new: mx.array) -> mx.array:
    """`new` at the selected positions of each row, `x` everywhere else (pads included)."""
    return mx.where(ctx.rows.mask(positions, x.shape[0], x.shape[1])[..., None], new, x)


class _Op:
    """A vector (float32, kept once) applied at `positions`; cast to the residual's dtype on first use."""

    unit = False  # ops along a direction keep u = v/|v|

    def __init__(self, vector: Any, alpha: float = 1.0, positions: str = "all", label: str = "", look: bool = False) -> None:
        if positions not in POSITIONS:
            raise SteeringError(f"positions {positions!r} is unknown: choose one of {', '.join(POSITIONS)}")
        v = np.asarray(vector, dtype=np.float32)
        if v.ndim != 1 or v.size == 0:
            raise SteeringError(f"vector has shape {v.shape}: pass a non-empty 1-D vector")
        if self.unit:
            if not v.any():
                op = type(self).__name__.lower()
                raise SteeringError(f"vector is all zeros, but {op} needs a direction: pass a nonzero vector")
            v = unit(v)  # scaled first: 1e30 entries have a direction too
        self.vector = mx.array(v)
        self.alpha = float(alpha)
        self.positions = positions
        self._cast: dict[Any, mx.array] = {}
        self.label = label or repr(self)
        self.note: str | None = None
        self._looked = not look  # `look`: the first forward with steered positions is still to be looked at

    def written_norm(self) -> float:
        """‖what the op writes‖ on top of x: α·v (α·u for clamp); 0 for ablate, which only removes."""
        return abs(self.alpha) * float(np.linalg.norm(np.asarray(self.vector, dtype=np.float64)))

    def _look(self, x: mx.array, ctx: HookContext, v: mx.array) -> None:
        """Once: note α·v not finite in x's dtype, or ‖α·v‖ swamping the residual at the steered positions."""
        written = self.written_norm()
        if written == 0.0:
            self._looked = True
            return
        mask = ctx.rows.mask(self.positions, x.shape[0], x.shape[1]).astype(mx.float32)
        norms = mx.linalg.norm(x.astype(mx.float32), axis=-1)
        steered, total, finite = mx.sum(mask), mx.sum(norms * mask), mx.all(mx.isfinite(self.alpha * v))
        mx.eval(steered, total, finite)
        if steered.item() == 0:
            return  # e.g. a prompt-only forward of continuation steering: look at the next one
        self._looked = True
        ratio = written / max(total.item() / steered.item(), 1e-30)
        if not finite.item():
            dtype = str(x.dtype).rsplit(".", 1)[-1]
            self.note = f"{self.label}: α·v is inf in {dtype} (the residual's dtype), so every number downstream is NaN"
        elif ratio > SWAMPED:
            self.note = f"{self.label}: ‖α·v‖ is {ratio:.2g}× the residual norm there; the model no longer reads its input"

    def _v(self, x: mx.array, ctx: HookContext) -> mx.array:
        if x.shape[-1] != self.vector.shape[0]:
            raise SteeringError(
                f"{ctx.name}: the vector has {self.vector.shape[0]} values but the residual stream has "
                f"{x.shape[-1]}: pass a vector of length {x.shape[-1]}"
            )
        v = self._cast.get(x.dtype)
        if v is None:
            v = self._cast[x.dtype] = self.vector.astype(x.dtype)
        return v

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        v = self._v(x, ctx)
        if not self._looked:
            self._look(x, ctx, v)
        return _at(self.positions, x, ctx, self.edit(x, v))

    def edit(self, x: mx.array, v: mx.array) -> mx.array:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha}, positions={self.positions!r}, dim={self.vector.shape[0]})"


class Add(_Op):
    """x + alpha*v at the selected positions."""

    def edit(self, x: mx.array, v: mx.array) -> mx.array:
        return x + self.alpha * v


class Replace(_Op):
    """x + alpha*(v - x): alpha 1 replaces by v exactly, 0 < alpha < 1 interpolates."""

    def edit(self, x: mx.array, v: mx.array) -> mx.array:
        return mx.broadcast_to(v, x.shape) if self.alpha == 1.0 else x + self.alpha * (v - x)


class Ablate(_Op):
    """x - (x.u)u: remove the component along u = v/|v| (alpha is not used)."""

    unit = True

    def written_norm(self) -> float:
        return 0.0  # it only removes what x holds

    def edit(self, x: mx.array, u: mx.array) -> mx.array:
        return x - (x @ u[:, None]) * u


class Clamp(_Op):
    """x + (alpha - x.u)u: set the component along u = v/|v| to alpha."""

    unit = True

    def edit(self, x: mx.array, u: mx.array) -> mx.array:
        return x + (self.alpha - x @ u[:, None]) * u


OPS: dict[str, type[_Op]] = {"add": Add, "replace": Replace, "ablate": Ablate, "clamp": Clamp}


class OnHead:
    """`op` on head `head`'s columns of the heads' outputs [B, S, heads*d] (d: the op's vector length), the
    other columns untouched; `heads`, when known, is checked against the width the model hands over."""

    def __init__(self, op: _Op, head: int, heads: int | None = None) -> None:
        self.op, self.head, self.heads = op, head, heads
        self.positions = op.positions

    @property
    def note(self) -> str | None:
        return self.op.note

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        d, width = self.op.vector.shape[0], x.shape[-1]
        n = self.heads or width // d
        if width != n * d or self.head >= n:
            raise SteeringError(
                f"{ctx.name}: the attention hands its output projection {width} values per token, not heads x head_dim "
                f"= {n} x {d} with head {self.head} among them: this model's heads cannot be steered one by one"
            )
        lo, hi = self.head * d, (self.head + 1) * d
        return mx.concatenate([x[..., :lo], self.op(x[..., lo:hi], ctx), x[..., hi:]], axis=-1)

    def __repr__(self) -> str:
        return f"OnHead({self.op!r}, head={self.head})"


class OnRows:
    """`hook` on the rows that run under configuration `config` (Rows.configs), every other row untouched: the
    hooks of several configurations installed at once, for rows of each decoding side by side in one batch."""

    def __init__(self, hook: Hook, config: int) -> None:
        self.hook, self.config = hook, config
        self.positions = getattr(hook, "positions", "all")

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        if ctx.rows.configs is None:
            raise SteeringError(f"{ctx.name}: a forward of rows side by side without their configurations (Rows.configs)")
        return mx.where((ctx.rows.configs == self.config)[:, None, None], self.hook(x, ctx), x)

    def __repr__(self) -> str:
        return f"OnRows({self.hook!r}, config={self.config})"


def side_by_side(installs: Sequence[Sequence[tuple[str, Hook]]]) -> list[tuple[str, Hook]]:
    """Configuration k's (hook point, hook) pairs for the rows under k, for every k at once (each one's order kept)."""
    return [(point, OnRows(hook, k)) for k, install in enumerate(installs) for point, hook in install]


def hooks_for(steering: Steering | None, n_layers: int, hidden: int, look: bool = False,
              heads: tuple[int | None, int | None] = (None, None)) -> list[tuple[str, Hook]]:  # fmt: skip
    """(hook point, op) per intervention, in order; negative layers count from the end. `look`: each op notes,
    on its first forward, steering that swamps the residual stream or overflows its dtype (one sync each).
    `heads`: the model's (attention heads, head_dim), which attn_head interventions are checked against."""
    out: list[tuple[str, Hook]] = []
    resolved = steering.resolve(n_layers, hidden, heads).interventions if steering else ()
    for i, iv in enumerate(resolved):
        if iv.normalize and not any(iv.vector):
            raise SteeringError(f"interventions[{i}].vector: all zeros: pass a nonzero vector or normalize=false")
        head = f" head {iv.head}" if iv.head is not None else ""
        label = f"interventions[{i}] ({iv.op} at {iv.site} layer {iv.layer}{head})"
        try:
            op = OPS[iv.op](iv.array(), iv.alpha, iv.positions, label, look)
        except SteeringError as e:
            raise SteeringError(f"interventions[{i}].{e}") from None
        out.append((f"{iv.site}.{iv.layer}", OnHead(op, iv.head, heads[0]) if iv.site in HEAD_SITES else op))
    return gated(out, [iv.condition for iv in resolved])[0]  # conditional ones (CAST): worker.hooks.condition


def hidden_size(lm) -> int:
    """The residual stream's width: from the model's config, else read off a one-token forward."""
    width = model_shape(lm.config)[1]
    if width is not None:
        return width
    cap = Capture("last")
    with lm.hooks.installed([("resid_pre.0", cap)]), lm.hooks.forward(Rows()):
        lm.model(mx.array([[0]]))
    return int(cap.records[0].shape[-1])


@contextlib.contextmanager
def steered(lm, steering: Steering | None, notes: list[str] | None = None, fired: dict[int, bool] | None = None) -> Iterator[None]:
    """Install `steering`'s hooks on `lm` (a worker.load.LoadedModel) for the block; remove exactly them.

    No interventions install nothing: the model stays bitwise the plain one. The ops' notes (steering that
    swamps the residual stream or overflows its dtype) are appended to `notes` when the block ends, and
    `fired` gets, for conditional steering, {request index: whether any conditional intervention fired on it}.
    """
    if not steering:
        yield
        return
    heads = head_shape(lm.config)
    if getattr(lm.grouping, "split", None) == "tensor" and any(iv.site in HEAD_SITES for iv in steering.interventions):
        raise SteeringError("attn_head: a tensor-split group holds each head on one rank only: use --split pipeline")
    hooks = hooks_for(steering, lm.n_layers, hidden_size(lm), look=notes is not None, heads=heads)
    with lm.hooks.installed(hooks):
        yield
    if notes is not None:
        notes.extend(op.note for _, op in hooks if getattr(op, "note", None))
    if fired is not None:
        for gate in (op.gate for _, op in hooks if isinstance(op, WhenFired)):
            for i, flag in gate.by_request().items():
                fired[i] = fired.get(i, False) or flag
