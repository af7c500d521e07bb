"""Conditional steering (CAST) in batches: each row decided on its own prompt, the decision kept for its continuation.

The rule is CAST's (Lee et al. 2024; IBM's activation-steering, leash_layer.py `_process_single_condition` and
`compute_similarity`, malleable_model.py's projector torch.ger(c, c) / c.c): at the input of a condition layer, on
the prompt's forward, h = the prompt's hidden states pooled (mean over its positions, or its last), then
sim = cos(h, tanh(P h)) with P h = c (c.h) / (c.c), and the condition passes when sim > threshold (`greater`) or
sim < threshold (`smaller`), at any of its layers. The library decides one row at a time with class-wide state;
here every row of a batch is decided on its own prompt positions (pads excluded), so rows never affect each other.

- `Probe` (a hook at resid_pre.L of a condition layer) decides on a forward that holds prompt positions.
- `WhenFired` runs an intervention's op on the rows whose gate passed and hands the other rows back untouched
  (bitwise: mx.where picks either the op's output or x). Within a prompt forward it reads the decisions the
  probes made lower in the same forward (condition layers never come after the steered layer: worker.spec);
  in decode forwards it reads them by row: the generation kernel then runs row b under "configuration" = its
  request index (Rows.configs), which keys the gate's table.
- `Gate.by_request()` says, after the job, which requests fired (one host sync): results carry it to the head.
- On a pipeline group the decisions travel with the hidden state from rank to rank (`relay`, `take`: worker.split.
  pipeline packs them beside it), so the rank owning the steered layer, and the answering rank, know them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..spec import Condition, Gate as GateSpec, SteeringError
from .manager import HookContext, Rows


def prompt_forward(rows: Rows, length: int, prefix: int = 0) -> bool:
    """Whether the forward holds prompt positions, read off host facts (a device read here would stall the kernels'
    pipelining, and every rank of a group must agree without asking): prompt forwards start at position 0, or right
    after the shared prefix they continue (worker.hooks.condition_share); every later forward is one decode step."""
    if rows.offset > 0 and length > 1 and rows.offset != prefix:
        raise SteeringError("conditional steering met a prompt forward after a shared prefix: run it with prefix_reuse off")
    return rows.offset == 0 or rows.offset == prefix


def pooled(x: mx.array, rows: Rows, pool: str, before: tuple[mx.array, int] | None = None) -> mx.array:
    """[B, hidden] float32: each row's prompt positions of this forward, averaged (`mean`) or its last one.
    `before`: (sum of the hidden states, their count) of a shared prefix this forward continues."""
    B, S = x.shape[0], x.shape[1]
    x = x.astype(mx.float32)
    if pool == "mean":
        m = rows.mask("prompt", B, S).astype(mx.float32)[..., None]
        total, n = mx.sum(x * m, axis=1), mx.sum(m, axis=1)
        if before is not None:
            total, n = total + before[0], n + before[1]
        return total / mx.maximum(n, 1.0)
    ends = rows.prompt_ends if rows.prompt_ends is not None else (rows.ends if rows.ends is not None else mx.full((B,), rows.offset + S))
    at = mx.clip(ends - 1 - rows.offset, 0, S - 1)
    return mx.take_along_axis(x, at[:, None, None], axis=1)[:, 0, :]


def similarity(h: mx.array, c: mx.array) -> mx.array:
    """CAST's cos(h, tanh(P h)) per row, P = c c^T / c.c (float32)."""
    projected = mx.tanh(c[None, :] * ((h @ c) / mx.sum(c * c))[:, None])
    return mx.sum(h * projected, axis=-1) / (mx.linalg.norm(h, axis=-1) * mx.linalg.norm(projected, axis=-1))


def passes(sim: mx.array, condition: Condition) -> mx.array:
    return sim > condition.threshold if condition.compare == "greater" else sim < condition.threshold


class Gate:
    """One intervention's conditions and, per row, whether they passed."""

    def __init__(self, spec: GateSpec) -> None:
        self.spec = spec
        self._rows: Rows | None = None  # the prompt forward whose decisions `_parts` hold
        self._parts: dict[int, mx.array] = {}  # condition index -> [B] bool, in that forward
        self._now: mx.array | None = None  # their combination, once the steered layer asked
        self._table = mx.zeros((0,), mx.bool_)  # the decision by request index, for decode forwards
        self._decided: list[tuple[Any, mx.array]] = []  # (request indices per row, fired [B]) per prompt forward
        self.forced: bool | None = None  # a shared prefix's pass: every row fired (True) or quiet (False)
        self.prefix: Any = None  # the shared prefix (condition_share.SharedPrefix) the forwards now run or continue

    def prompt(self, rows: Rows, length: int) -> bool:
        """Whether a forward of `length` positions over `rows` is one whose rows this gate decides."""
        return self.forced is None and prompt_forward(rows, length, self.prefix.length if self.prefix is not None else 0)

    def observe(self, k: int, fired: mx.array, rows: Rows) -> None:
        if self._rows is not rows:
            self._rows, self._parts, self._now = rows, {}, None
        self._parts[k] = self._parts[k] | fired if k in self._parts else fired

    def fired(self, ctx: HookContext) -> mx.array:
        rows = ctx.rows
        if self.forced is not None:
            return mx.array([self.forced])
        if self._rows is rows:
            if self._now is None:
                self._now = self._decide(rows)
            return self._now
        if rows.configs is None:
            raise SteeringError(f"{ctx.name}: a forward past the prompt whose rows are not named (Rows.configs): "
                                "the conditional steering cannot tell which row is which")  # fmt: skip
        return self._table[rows.configs]

    def current(self) -> mx.array:
        """[B] bool: the decision of the prompt forward now running (its probes have all run)."""
        if self._now is None:
            self._now = self._decide(self._rows)
        return self._now

    def parts(self, rows: Rows, batch: int) -> list[mx.array]:
        """Per condition, [B] bool: whether it passed at the layers run so far on this forward (False where none ran)."""
        seen = self._parts if self._rows is rows else {}
        return [seen.get(k, mx.zeros((batch,), mx.bool_)) for k in range(len(self.spec.conditions))]

    def _decide(self, rows: Rows) -> mx.array:
        parts = [self._parts.get(k) for k in range(len(self.spec.conditions))]
        if any(p is None for p in parts):
            raise SteeringError("a condition layer did not run before the steered layer on this forward")
        out = parts[0]
        for p in parts[1:]:
            out = out | p if self.spec.rule == "any" else out & p
        ids = rows.requests if rows.requests is not None else rows.configs
        if rows.configs is not None:
            n = int(mx.max(rows.configs).item()) + 1
            if self._table.shape[0] < n:
                self._table = mx.concatenate([self._table, mx.zeros((n - self._table.shape[0],), mx.bool_)])
            self._table[rows.configs] = out
        if ids is not None:
            self._decided.append((ids, out))
        return out

    def by_request(self) -> dict[int, bool]:
        """{request index: fired} for the rows decided so far (one host sync)."""
        mx.eval([f for _, f in self._decided])
        out: dict[int, bool] = {}
        for ids, fired in self._decided:
            ids = ids.tolist() if isinstance(ids, mx.array) else ids
            for row, flag in zip(ids, fired.tolist()):
                for i in row if isinstance(row, tuple) else (row,):
                    out[i] = out.get(i, False) or bool(flag)
        return out


class Probe:
    """Condition `k` of `gate`, read at the input of one of its layers on prompt forwards."""

    positions = "prompt"  # the kernels then keep each row's prompt apart from its continuation

    def __init__(self, gate: Gate, k: int) -> None:
        self.gate, self.k = gate, k
        self.condition = gate.spec.conditions[k]
        self.vector = mx.array(self.condition.vector, dtype=mx.float32)

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        shared = self.gate.prefix
        if self.gate.forced is not None:  # a shared prefix's pass (batch 1, every position real): its sum is kept
            if shared is not None:
                shared.keep(self, mx.sum(x.astype(mx.float32), axis=1))
            return x
        if self.gate.prompt(ctx.rows, x.shape[1]):
            before = (shared.summed(self), shared.length) if shared is not None else None
            sim = similarity(pooled(x, ctx.rows, self.condition.pool, before), self.vector)
            self.gate.observe(self.k, passes(sim, self.condition), ctx.rows)
        return x


class WhenFired:
    """`hook` on the rows whose gate passed; every other row exactly as it was."""

    def __init__(self, hook: Any, gate: Gate) -> None:
        self.hook, self.gate = hook, gate
        self.positions = getattr(hook, "positions", "all")

    @property
    def note(self) -> str | None:
        return getattr(self.hook, "note", None)

    def __call__(self, x: mx.array, ctx: HookContext) -> mx.array:
        fired = self.gate.fired(ctx)
        return mx.where(fired[:, None, None], self.hook(x, ctx), x)


def conditional_gates(hooks: Any) -> list[Gate]:
    """The gates of the conditional interventions installed on `hooks` (a HookManager), each once, in install order."""
    out: list[Gate] = []
    for fns in hooks._hooks.values():
        out += [f.gate for f in fns if isinstance(f, WhenFired) and f.gate not in out]
    return out


# --- decisions travelling with the hidden state between the ranks of a pipeline group (worker.split.pipeline) ---


def deciding(gates: list[Gate], rows: Rows, length: int) -> list[Gate]:
    """The gates deciding rows on this forward: what every rank of a group agrees travels with it (host facts only)."""
    return [g for g in gates if g.prompt(rows, length)]


def relay(gates: list[Gate], rows: Rows, batch: int) -> mx.array:
    """[B, conditions] float32: each condition of each gate deciding now, 1 where it passed at a layer run so far."""
    return mx.stack([p for g in gates for p in g.parts(rows, batch)], axis=-1).astype(mx.float32)


def take(gates: list[Gate], rows: Rows, relayed: mx.array) -> None:
    """The rank before's `relay` joins what this rank's probes will add (a condition passes at any of its layers)."""
    j = 0
    for gate in gates:
        for k in range(len(gate.spec.conditions)):
            gate.observe(k, relayed[:, j] > 0.5, rows)
            j += 1


def settle(gates: list[Gate]) -> None:
    """Each gate's decision of this forward, recorded (for the decode steps and `by_request`) on a rank that owns
    no steered layer of it: the answering rank, after its last layer (every condition layer has run by then)."""
    for gate in gates:
        gate.current()


def gated(hooks: list[tuple[str, Any]], specs: list[GateSpec | None]) -> tuple[list[tuple[str, Any]], list[Gate]]:
    """The (point, hook) pairs with each conditional one wrapped by its gate, the probes first (so a probe at the
    steered point reads the stream before any op there edits it), and the gates."""
    probes, out, gates = [], [], []
    for (point, hook), spec in zip(hooks, specs):
        if spec is None:
            out.append((point, hook))
            continue
        gate = Gate(spec)
        gates.append(gate)
        probes += [(f"resid_pre.{L}", Probe(gate, k)) for k, c in enumerate(spec.conditions) for L in c.layers]
        out.append((point, WhenFired(hook, gate)))
    return probes + out, gates
