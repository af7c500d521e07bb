"""Worker groups as the scheduler sees them: one worker each (cluster.schedule.dispatch runs unchanged over them).

`GroupHandle.run.remote(...)` sends a chunk to every rank, in the same order on every rank, and returns the
answering rank's ref (the group's result: the last rank under pipeline, rank 0 under tensor); the other ranks'
refs are watched by the `GroupPool`. Any rank dying, its ring
breaking, or the group making no progress within the deadline loses the whole group: every rank is killed and
its placement group freed, and its chunks come back to the queue as a dead worker's do. A process keeps its
first ring for life, so the slot is then re-formed from fresh processes (cluster.groups.reform), up to
`max_restarts` times, while the other groups go on. While they do, it waits for free nodes as long as the run
lasts (a Mac that comes back is used); with no group left, that wait has its timeout. A slot that cannot be
re-formed stays lost, in one line.
A group's refs are never cancelled: cancelling one rank's task would desynchronise the ring.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from worker.split.plan import answering_rank

from ..actor import Pool
from ..connect import ClusterError
from ..failures import _actor_id, _actor_record, _death, node_label
from .reform import Recipe, Reform, free

DEADLINE = 600.0  # s a group may go without any rank answering while it holds chunks (a hung rank)


class _Run:
    """`handle.run.remote(...)`, as on an actor."""

    def __init__(self, handle: "GroupHandle") -> None:
        self.handle = handle

    def remote(self, *args: Any) -> Any:
        return self.handle.submit(*args)


class GroupHandle:
    """One group's ranks (rank 0 first), its placement group, and the other ranks' refs not landed yet; `answer`:
    the rank whose ref is the group's result (the pool sets it from the grouping)."""

    def __init__(self, ranks: Sequence[Any], index: int, placement: Any = None, answer: int = 0) -> None:
        self.ranks, self.index, self.placement, self.answer = list(ranks), index, placement, answer
        self.watching: list = []  # refs of the other ranks, in submission order
        self.answers: list = []  # the answering rank's refs not landed yet (the scheduler reads their values)
        self.since = 0.0  # when the group last made progress (or got work while idle)
        self.chunks = 0  # chunks these ranks finished
        self.run = _Run(self)

    @property
    def prefix_store(self) -> Any:
        """Rank 0's prefix store counters (`.remote()`): every rank of a group stores and evicts alike."""
        return self.ranks[0].prefix_store

    def submit(self, *args: Any) -> Any:
        refs = [r.run.remote(*args) for r in self.ranks]
        if not self.holding():
            self.since = time.monotonic()
        self.watching.extend(refs[: self.answer] + refs[self.answer + 1 :])
        self.answers.append(refs[self.answer])
        return refs[self.answer]

    def holding(self) -> bool:
        """Whether any rank still holds a chunk. An answer landed since counts as progress: a pipelined rank 0
        finishes its chunks before the last rank does, so only the answering rank's landing shows the whole
        group still works (a hung last rank must not hide behind rank 0's answers)."""
        if self.answers:
            import ray

            ready, self.answers = ray.wait(self.answers, num_returns=len(self.answers), timeout=0)
            if ready:
                self.since = time.monotonic()
        return bool(self.watching or self.answers)

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r, no_restart=True)

    def dead(self) -> bool:
        """Whether Ray counts any of its ranks dead."""
        return any(_actor_record(_actor_id(actor)).get("State") == "DEAD" for actor in self.ranks)

    def why(self, settle_s: float = 2.0, others_s: float = 0.0) -> str:
        """'rank R on NODE died (...)' for the rank that died first (waiting up to `settle_s` for Ray to notice a
        killed process), else that the group broke. A rank dying takes its ring peers down moments later, and
        Ray may record them first: among the ranks it counts dead (read again after `others_s`), the earliest end
        wins. No longer wait by default: the live ranks' rings print errors until the group is killed."""
        deadline, dead = time.monotonic() + settle_s, []
        while not dead:
            dead = self._dead()
            if not dead and time.monotonic() >= deadline:
                return "its ring broke"
            time.sleep(0.1 if not dead else others_s)
        r, record = min(self._dead() or dead, key=lambda d: (d[1].get("EndTime") or float("inf"), d[0]))
        address = record.get("Address") or {}
        return f"rank {r} on {node_label(address.get('NodeID'), address.get('IPAddress'))} {_death(record)[0]}"

    def _dead(self) -> list[tuple[int, dict]]:
        """(rank, Ray's actor record) of each rank Ray counts dead."""
        records = [(r, _actor_record(_actor_id(actor))) for r, actor in enumerate(self.ranks)]
        return [(r, record) for r, record in records if record.get("State") == "DEAD"]


def say(line: str) -> None:
    """One line on stderr, above the head's progress bar (tqdm's own write keeps the bar whole)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def ring_failure(error: BaseException) -> bool:
    """Whether a rank's error is its group breaking (a peer gone: MLX's ring says "[ring] ..."; or the rank died),
    not an error every rank would raise alike."""
    from ray.exceptions import RayActorError

    cause = getattr(error, "cause", None)
    return isinstance(error, RayActorError) or "[ring]" in str(error) or type(cause).__name__ == "RingError"


class GroupPool(Pool):
    """The groups of a run: which are alive; a lost group is killed whole and its slot re-formed (with `recipe`,
    up to `max_restarts` times per slot) or left lost."""

    def __init__(self, groups: Sequence[GroupHandle], deadline: float = DEADLINE, recipe: Recipe | None = None,
                 max_restarts: int = 0, tell: Callable[[Any], None] = lambda notes: None) -> None:  # fmt: skip
        """`tell(results)`: shows the steering notes ranks > 0 attach (the executor's notes callback)."""
        super().__init__(groups, revive=lambda group: None)
        self.deadline, self.recipe, self.max_restarts, self.tell = deadline, recipe, max_restarts, tell
        self.answer = answering_rank(recipe.grouping) if recipe is not None else 0
        for group in self.workers:
            group.answer = self.answer
        self.losses: list[tuple[int, str]] = []  # (slot, why it was lost [and why it was not re-formed]), in order
        self.tries = [0] * len(self.workers)  # re-formings started per slot (its restart budget spent)
        self.reformed = [0] * len(self.workers)  # re-formings that brought the slot back
        self.reforms: dict[int, Reform] = {}  # slot -> its re-forming under way
        self.facts: list[dict] = []  # per group (the executor's list): a re-formed group's replace the lost one's

    @property
    def reasons(self) -> list[str]:
        return [line for _, line in self.losses]

    def lose(self, w: int, reason: str | None = None) -> None:
        """Group w is gone: all its ranks killed, its units freed; its slot re-formed if it may be."""
        if w not in self.alive:
            return
        group = self.workers[w]
        why = reason or group.why()  # before the kill: name the rank that died first
        self.alive.discard(w)
        group.watching.clear()
        group.answers.clear()
        group.kill()
        if self.recipe is not None and group.placement is not None:
            free(self.recipe.placements, group.placement)
        self.losses.append((w, f"group g{group.index} lost: {why}"))
        if not self.alive:  # the slots waiting for nodes were patient while others worked: now their timeout counts
            for reform in self.reforms.values():
                if reform.step == "place":
                    reform.restart_clock()
        self._reform(w)

    def patient(self, reform: Reform) -> bool:
        """Whether a re-forming waits for its nodes without a timeout: while other groups work, a Mac that comes
        back is one to use (the run does not wait for it: it ends with the work)."""
        return reform.step == "place" and bool(self.alive)

    def _reform(self, w: int) -> None:
        if self.recipe is None:
            return
        if self.tries[w] >= self.max_restarts:
            return self._stays_lost(w, f"no restart left (max_restarts={self.max_restarts})")
        self.tries[w] += 1
        try:
            self.reforms[w] = Reform(self.recipe, w, self.tries[w])
        except Exception as e:  # Ray refused the placement group
            return self._stays_lost(w, f"{type(e).__name__}: {e}")
        self.reviving.update(dict.fromkeys(self.reforms[w].pending, w))
        say(f"{self.losses[-1][1]}; re-forming it from fresh processes (restart {self.tries[w]} of {self.max_restarts})")

    def _stays_lost(self, w: int, why: str) -> None:
        """One line: the slot's last loss and why it was not re-formed."""
        i = max(i for i, (slot, _) in enumerate(self.losses) if slot == w)
        self.losses[i] = (w, f"{self.losses[i][1]}; not re-formed: {why}")
        if self.alive or self.reforms.keys() - {w}:  # else the run ends here, in one line naming this loss (`gone`)
            say(f"{self.losses[i][1]}: the run goes on with the other groups")

    def back(self, ref: Any) -> None:
        """A ref of a slot's re-forming landed: its next step, or the slot alive again, or left lost."""
        w = self.reviving.pop(ref)
        reform = self.reforms[w]
        try:
            facts = reform.landed(ref)
            if facts is not None:
                self._differs(facts)
        except ClusterError as e:
            return self._give_up(w, str(e))
        self.reviving.update(dict.fromkeys(reform.pending, w))
        if facts is not None:
            self._rejoin(w, reform, facts)

    def _differs(self, facts: list[dict]) -> None:
        """ClusterError if the new ranks hold other versions or model files than the run's first group."""
        from ..actor import _other_files, held_files
        from ..facts import mismatch

        if not self.facts:
            return
        first, model = self.facts[0], self.recipe.spec.model
        problem = mismatch([*facts, first], who="ranks") or _other_files(held_files(facts[0]), held_files(first), facts[0]["hostname"], model)
        if problem:
            raise ClusterError(problem)

    def _rejoin(self, w: int, reform: Reform, facts: list[dict]) -> None:
        from .form import rank_row

        del self.reforms[w]
        self.workers[w] = GroupHandle(reform.ranks, w, reform.pg, self.answer)
        if self.facts:
            self.facts[w] = {**facts[0], "ranks": [rank_row(f) for f in facts]}
        self.alive.add(w)
        self.reformed[w] += 1
        hosts = "+".join(f["hostname"] for f in facts)
        say(f"group g{w} re-formed on {hosts} (restart {self.tries[w]} of {self.max_restarts}): it takes chunks again")

    def _give_up(self, w: int, why: str) -> None:
        reform = self.reforms.pop(w)
        for ref in reform.pending:
            self.reviving.pop(ref, None)
        reform.abandon()
        self._stays_lost(w, why)

    def stale(self, w: int) -> bool:
        """Whether a failed answer on slot w came from the ranks it had before it was re-formed (theirs fail
        within moments of the kill, long before fresh ranks load; this guards the rest): every rank is alive."""
        return bool(self.reformed[w]) and w in self.alive and not self.workers[w].dead()

    def lost(self, w: int) -> None:  # a result of the answering rank failed: its process died
        if not self.stale(w):
            self.lose(w)

    def watched(self) -> dict:
        return {ref: w for w in sorted(self.alive) for ref in self.workers[w].watching}

    def settle(self, ref: Any) -> None:
        """Another rank than the answering one answered: progress (its steering notes told); or it failed: the group
        is lost (an error that is not the ring's is raised, as the answering rank's would be)."""
        import ray

        w = self.watched()[ref]
        group = self.workers[w]
        group.watching.remove(ref)
        try:
            value = ray.get(ref)
        except Exception as e:
            self.lose(w)
            if not ring_failure(e):
                raise
            return
        group.since = time.monotonic()
        group.chunks += 1
        if isinstance(value, tuple) and value[1] is not None:
            self.tell(value[1])  # the notes of steering on a layer this rank owns

    def due(self) -> float | None:
        """Seconds until the next deadline: a group holding chunks, or a slot's re-forming step."""
        now = time.monotonic()
        waits = [self.workers[w].since + self.deadline - now for w in self.alive if self.workers[w].holding()]
        waits += [reform.deadline - now for reform in self.reforms.values() if not self.patient(reform)]
        return max(0.0, min(waits)) if waits else None

    def expire(self) -> None:
        now = time.monotonic()
        for w in sorted(self.alive):
            group = self.workers[w]
            if group.holding() and now - group.since >= self.deadline:
                self.lose(w, f"no rank answered within its {self.deadline:g} s deadline (a hung rank)")
        for w, reform in list(self.reforms.items()):
            if self.patient(reform):
                reform.restart_clock()
                continue
            why = reform.overdue()
            if why:
                self._give_up(w, why)

    def broken(self, w: int, error: BaseException) -> bool:
        if not ring_failure(error):
            return False
        if not self.stale(w):
            self.lose(w)
        return True

    def drop(self, ref: Any) -> None:
        """Never cancel a group's task (its ranks would leave the ring out of step): the copy just finishes."""

    def peaks(self, timeout: float = 5.0) -> dict[tuple[int, int], dict]:
        """{(group, rank): {peak_memory_gb, busy_s, wait_s, busy_fraction}} of the live groups' ranks, asked only when none holds work (a busy rank
        answers after its chunks); {} when they do not answer within `timeout` s."""
        import ray

        if not ray.is_initialized() or any(self.workers[w].holding() for w in self.alive):
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
