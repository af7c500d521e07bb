"""Worker groups as the scheduler sees them: one worker each (cluster.schedule.dispatch runs unchanged over them).

`GroupHandle.run.remote(...)` sends a chunk to every rank, in the same order on every rank, and returns rank 0's
ref (the group's result); the other ranks' refs are watched by the `GroupPool`. Any rank dying, its ring
breaking, or the group making no progress within the deadline loses the whole group: every rank is killed (a
process keeps its first ring for life, so there is no restart), and its chunks come back to the queue as a dead
worker's do. A group's refs are never cancelled: cancelling one rank's task would desynchronise the ring.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..actor import Pool
from ..failures import _actor_id, _actor_record, _death, node_label

DEADLINE = 600.0  # s a group may go without any rank answering while it holds chunks (a hung rank)


class _Run:
    """`handle.run.remote(...)`, as on an actor."""

    def __init__(self, handle: "GroupHandle") -> None:
        self.handle = handle

    def remote(self, *args: Any) -> Any:
        return self.handle.submit(*args)


class GroupHandle:
    """One group's ranks (rank 0 first), and the other ranks' refs not landed yet."""

    def __init__(self, ranks: Sequence[Any], index: int) -> None:
        self.ranks, self.index = list(ranks), index
        self.watching: list = []  # refs of ranks > 0, in submission order
        self.since = 0.0  # when the group last made progress (or got work while idle)
        self.run = _Run(self)

    def submit(self, *args: Any) -> Any:
        refs = [r.run.remote(*args) for r in self.ranks]
        if not self.watching:
            self.since = time.monotonic()
        self.watching.extend(refs[1:])
        return refs[0]

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r, no_restart=True)

    def why(self, settle_s: float = 2.0) -> str:
        """'rank R on NODE died (...)' for the first rank Ray reports dead (waiting up to `settle_s` for Ray to
        notice a killed process), else that the group broke."""
        deadline = time.monotonic() + settle_s
        while True:
            for r, actor in enumerate(self.ranks):
                record = _actor_record(_actor_id(actor))
                if record.get("State") == "DEAD":
                    address = record.get("Address") or {}
                    return f"rank {r} on {node_label(address.get('NodeID'), address.get('IPAddress'))} {_death(record)[0]}"
            if time.monotonic() >= deadline:
                return "its ring broke"
            time.sleep(0.1)


def ring_failure(error: BaseException) -> bool:
    """Whether a rank's error is its group breaking (a peer gone: MLX's ring says "[ring] ..."; or the rank died),
    not an error every rank would raise alike."""
    from ray.exceptions import RayActorError

    cause = getattr(error, "cause", None)
    return isinstance(error, RayActorError) or "[ring]" in str(error) or type(cause).__name__ == "RingError"


class GroupPool(Pool):
    """The groups of a run: which are alive; a lost group is killed whole and never comes back."""

    def __init__(self, groups: Sequence[GroupHandle], deadline: float = DEADLINE) -> None:
        super().__init__(groups, revive=lambda group: None)
        self.deadline = deadline
        self.reasons: list[str] = []  # why each lost group was lost, in order

    def lose(self, w: int, reason: str | None = None) -> None:
        """Group w is gone: all its ranks killed, never revived."""
        if w not in self.alive:
            return
        group = self.workers[w]
        why = reason or group.why()  # before the kill: name the rank that died first
        self.alive.discard(w)
        group.watching.clear()
        group.kill()
        self.reasons.append(f"group g{group.index} lost: {why}")

    def lost(self, w: int) -> None:  # a result of rank 0 failed: its process died
        self.lose(w)

    def watched(self) -> dict:
        return {ref: w for w in sorted(self.alive) for ref in self.workers[w].watching}

    def settle(self, ref: Any) -> None:
        """A rank > 0 answered: progress; or it failed: the group is lost (an error that is not the ring's is
        raised, as rank 0's would be)."""
        import ray

        w = self.watched()[ref]
        group = self.workers[w]
        group.watching.remove(ref)
        try:
            ray.get(ref)
        except Exception as e:
            self.lose(w)
            if not ring_failure(e):
                raise
            return
        group.since = time.monotonic()

    def due(self) -> float | None:
        waits = [self.workers[w].since + self.deadline - time.monotonic() for w in self.alive if self.workers[w].watching]
        return max(0.0, min(waits)) if waits else None

    def expire(self) -> None:
        now = time.monotonic()
        for w in sorted(self.alive):
            group = self.workers[w]
            if group.watching and now - group.since >= self.deadline:
                self.lose(w, f"no rank answered within its {self.deadline:g} s deadline (a hung rank)")

    def broken(self, w: int, error: BaseException) -> bool:
        if not ring_failure(error):
            return False
        self.lose(w)
        return True

    def drop(self, ref: Any) -> None:
        """Never cancel a group's task (its ranks would leave the ring out of step): the copy just finishes."""

    def peaks(self, timeout: float = 5.0) -> dict[tuple[int, int], float]:
        """{(group, rank): peak memory GB} of the live groups' ranks, asked only when none holds work (a busy rank
        answers after its chunks); {} when they do not answer within `timeout` s."""
        import ray

        if not ray.is_initialized() or any(self.workers[w].watching for w in self.alive):
            return {}
        asked = {(w, r): actor.peak_memory.remote() for w in sorted(self.alive) for r, actor in enumerate(self.workers[w].ranks)}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout)
        if len(ready) < len(asked):
            return {}
        try:
            return {key: value for key, value in zip(asked, ray.get(list(asked.values()))) if value is not None}
        except Exception:
            return {}

    def gone(self) -> str:
        return f"every worker group is lost ({'; '.join(self.reasons)})" if self.reasons else "every worker group is lost"
