"""Chunking and merging: pure functions, no cluster."""

from __future__ import annotations

import math
import random

import pytest

from cluster.schedule import PER_WORKER, Merge, cut


def _check_partition(chunks, n):
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(n))  # every request in exactly one chunk


def test_families_stay_whole_and_longest_come_first():
    rng = random.Random(0)
    costs = [rng.randint(5, 60) for _ in range(200)]
    families = [list(range(i, min(i + 4, 200))) for i in range(0, 200, 4)]
    chunks = cut(costs, families, workers=4, max_tokens=400, min_tokens=50)
    _check_partition(chunks, 200)
    where = {i: n for n, c in enumerate(chunks) for i in c}
    for f in families:  # each family fits max_tokens: never split, even where the shrinking budget is smaller
        assert len({where[i] for i in f}) == 1
    longest = [max(costs[i] for i in c) for c in chunks]
    assert longest == sorted(longest, reverse=True)


def test_budget_bounds_and_shrinks_toward_the_end():
    costs = [10] * 1000
    chunks = cut(costs, [[i] for i in range(1000)], workers=2, max_tokens=300, min_tokens=20)
    _check_partition(chunks, 1000)
    sizes = [sum(costs[i] for i in c) for c in chunks]
    assert max(sizes) <= 300 and min(sizes[:-1]) >= 20
    assert sizes[0] > sizes[-2]  # guided: later chunks are smaller
    assert sizes == sorted(sizes, reverse=True)


def test_each_budget_is_a_share_of_the_tokens_not_yet_cut():
    # The documented rule, spelled out for equal costs: a chunk takes ceil(left / (PER_WORKER * workers)) tokens,
    # within [min_tokens, max_tokens], in whole requests; the first budget is computed before anything is cut.
    costs = [10] * 1000
    chunks = cut(costs, [[i] for i in range(1000)], workers=2, max_tokens=300, min_tokens=20)
    expected, left = [], sum(costs)
    while left:
        budget = max(20, min(300, math.ceil(left / (PER_WORKER * 2))))
        size = min(left, budget // 10 * 10)
        expected.append(size)
        left -= size
    assert [sum(costs[i] for i in c) for c in chunks] == expected
    assert [i for c in chunks for i in c] == list(range(1000))  # equal costs: the order given


def test_a_streamed_piece_keeps_full_budgets_when_more_tokens_come_after_it():
    costs = [10] * 100
    alone = cut(costs, [[i] for i in range(100)], workers=2, max_tokens=300, min_tokens=20)
    streamed = cut(costs, [[i] for i in range(100)], workers=2, max_tokens=300, min_tokens=20, after=100_000)
    assert [len(c) for c in streamed] == [30, 30, 30, 10]  # max budget to the end: the queue goes on after it
    assert len(alone) > len(streamed) and len(alone[-1]) == 2  # alone, its chunks shrink toward its end
    first = cut(costs, [[i] for i in range(100)], workers=8, max_tokens=10**6, min_tokens=1, after=50_000)[0]
    assert len(first) == math.ceil((1000 + 50_000) / (PER_WORKER * 8)) // 10  # the budget counts tokens to come


def test_a_family_over_budget_is_split_in_order():
    costs = [10] * 30
    chunks = cut(costs, [list(range(30))], workers=1, max_tokens=100, min_tokens=100)
    assert cut(costs, [list(range(30))], workers=1, max_tokens=300, min_tokens=10) == [list(range(30))]
    assert chunks == [list(range(i, i + 10)) for i in range(0, 30, 10)]


def test_more_workers_mean_more_chunks():
    costs = [10] * 400
    families = [[i] for i in range(400)]
    one = cut(costs, families, workers=1, max_tokens=10_000, min_tokens=10)
    four = cut(costs, families, workers=4, max_tokens=10_000, min_tokens=10)
    assert len(four) > len(one) >= 8


def test_merge_places_by_index_and_refuses_duplicates_and_gaps():
    m = Merge(5)
    assert m.count == 0 and m.missing() == [0, 1, 2, 3, 4]
    m.add([3, 1], ["d", "b"])
    assert m.count == 2 and list(m.filled) == [0, 1, 0, 1, 0]
    m.add([0, 2], ["a", "c"])
    assert m.count == 4 and m.missing() == [4]
    with pytest.raises(AssertionError, match=r"^1 requests never arrived \(first: \[4\]\)$"):
        m.result()
    with pytest.raises(AssertionError, match="arrived twice"):
        m.add([1], ["again"])
    with pytest.raises(AssertionError, match="1 results for 2 requests"):
        m.add([4, 5], ["e"])
    m.add([4], ["e"])
    assert m.count == 5
    assert m.result() == ["a", "b", "c", "d", "e"]
    assert m.missing() == []
    with pytest.raises(AssertionError, match=r"^7 requests never arrived \(first: \[0, 1, 2, 3, 4\]\)$"):
        Merge(7).result()


# --- dispatch, on a simulated cluster ----------------------------------------------------------------
# A deterministic stand-in for the three Ray calls dispatch makes (wait, get, cancel) and for its clock: each
# worker runs its chunks one after the other at its own speed (seconds per unit of cost), may die at a given
# time (its unfinished chunks then fail, as Ray's RayActorError) and may come back at another.


class RayActorError(Exception):
    pass


class Ref:
    seq = 0

    def __init__(self, at, value=None, error=None):
        Ref.seq += 1
        self.at, self.value, self.error, self.seq = at, value, error, Ref.seq


class SimRay:
    def __init__(self):
        self.now = 0.0
        self.cancelled: list[Ref] = []
        self.waits = 0

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits += 1
        ordered = sorted(refs, key=lambda r: (r.at, r.seq))
        last = ordered[num_returns - 1]  # the one that completes the wait
        if timeout is not None and last.at > self.now + timeout:
            self.now += timeout
            ready = [r for r in ordered if r.at <= self.now]
            return ready, [r for r in refs if r not in ready]
        assert last.at != math.inf, "dispatch waits forever"
        self.now = max(self.now, last.at)
        return ordered[:num_returns], [r for r in refs if r not in ordered[:num_returns]]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def cancel(self, ref):
        self.cancelled.append(ref)


class SimWorker:
    def __init__(self, sim, name, speed, dies_at=math.inf, back_at=None):
        self.sim, self.name, self.speed, self.dies_at, self.back_at = sim, name, speed, dies_at, back_at
        self.free_at = 0.0
        self.runs: list[tuple[int, float, float]] = []  # (chunk, start, end) of each chunk it ran to the end
        self.pending: list[Ref] = []
        self.max_held = 0

    def alive(self, t):
        return t < self.dies_at or (self.back_at is not None and t >= self.back_at)

    def submit(self, chunk, cost):
        now = self.sim.now
        self.pending = [r for r in self.pending if r.at > now]
        self.max_held = max(self.max_held, len(self.pending) + 1)
        start = max(now, self.free_at)
        end = start + cost * self.speed
        if not self.alive(now) or (start < self.dies_at <= end):
            ref = Ref(max(now, min(end, self.dies_at)), error=RayActorError(self.name))
        else:
            ref = Ref(end, value=chunk)
            self.runs.append((chunk, start, end))
            self.free_at = end
        self.pending.append(ref)
        return ref

    def revive(self):
        if self.back_at is None:  # gone for good: Ray says so after a while
            return Ref(max(self.sim.now, self.dies_at) + 1.0, error=RayActorError(self.name))
        self.free_at = self.back_at
        return Ref(self.back_at, value={"restarted": True})


@pytest.fixture
def sim(monkeypatch):
    import sys
    import types

    import cluster.schedule

    sim = SimRay()
    fake = types.ModuleType("ray")
    fake.wait, fake.get, fake.cancel = sim.wait, sim.get, sim.cancel
    exceptions = types.ModuleType("ray.exceptions")
    exceptions.RayActorError = RayActorError
    fake.exceptions = exceptions
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.exceptions", exceptions)
    monkeypatch.setattr(cluster.schedule, "time", types.SimpleNamespace(monotonic=lambda: sim.now))
    return sim


def run_sim(sim, workers, costs, **kw):
    from cluster import Pool
    from cluster.schedule import dispatch

    pool = Pool(workers, revive=lambda w: w.revive())
    got: list[tuple[int, int, object]] = []
    dispatch(
        costs, pool,
        lambda worker, c: worker.submit(c, costs[c]), lambda w, c, value: got.append((w, c, value)), **kw,
    )  # fmt: skip
    return pool, got


def test_dispatch_runs_every_chunk_once_and_a_fast_worker_takes_more(sim):
    fast, slow = SimWorker(sim, "fast", 1.0), SimWorker(sim, "slow", 3.0)
    costs = [1.0] * 24
    pool, got = run_sim(sim, [fast, slow], costs)
    assert sorted(c for _, c, _ in got) == list(range(24)) and all(v == c for _, c, v in got)
    assert all(workers == [0] or workers == [1] for workers in ([w for w, c2, _ in got if c2 == c] for c in range(24)))
    by_worker = [sum(1 for w, _, _ in got if w == i) for i in range(2)]
    assert by_worker[0] >= 2 * by_worker[1] > 0, by_worker
    assert fast.max_held == slow.max_held == 2  # one running, one queued behind it
    # chunks are handed out in order: each worker's first two are the first four
    assert sorted(c for c, _, _ in fast.runs[:2] + slow.runs[:2]) == [0, 1, 2, 3]
    assert pool.alive == {0, 1} and not pool.reviving
    assert sim.now <= 24 / (1 + 1 / 3) + 3  # close to the ideal makespan (18 s)


def test_dispatch_depth_one_and_three(sim):
    a, b = SimWorker(sim, "a", 1.0), SimWorker(sim, "b", 1.0)
    run_sim(sim, [a, b], [1.0] * 12, depth=1)
    assert a.max_held == b.max_held == 1
    c, d = SimWorker(sim, "c", 1.0), SimWorker(sim, "d", 1.0)
    run_sim(sim, [c, d], [1.0] * 12, depth=3)
    assert c.max_held == d.max_held == 3


def test_dispatch_backs_up_a_stalled_worker_and_cancels_the_copy_left_behind(sim):
    fast, stalled = SimWorker(sim, "fast", 1.0), SimWorker(sim, "stalled", 1000.0)
    pool, got = run_sim(sim, [fast, stalled], [1.0] * 10)
    assert sorted(c for _, c, _ in got) == list(range(10))
    assert all(w == 0 for w, _, _ in got)  # every result came from the fast worker
    assert sim.now < 20  # nobody waited for the stalled worker's 1000 s chunks
    # the stalled worker held chunks 1 and 3; the fast one ran copies of both, the one expected last (3) first
    assert [c for c, _, _ in stalled.runs] == [1, 3]
    assert [c for c, _, _ in fast.runs][-2:] == [3, 1]
    assert sorted(r.value for r in sim.cancelled) == [1, 3]  # the stalled copies, no longer needed
    assert pool.alive == {0, 1}


def test_dispatch_gives_a_lost_workers_chunks_to_the_others(sim):
    dies = SimWorker(sim, "dies", 1.0, dies_at=2.5)
    a, b = SimWorker(sim, "a", 1.0), SimWorker(sim, "b", 1.0)
    pool, got = run_sim(sim, [dies, a, b], [1.0] * 15)
    assert sorted(c for _, c, _ in got) == list(range(15))
    assert [c for w, c, _ in got if w == 0] == [0, 3]  # finished before the death: delivered, not run again
    assert sum(1 for w, _, _ in got if w != 0) == 13
    assert pool.alive == {1, 2} and not pool.reviving  # Ray was asked to bring it back, and said it is gone


def test_dispatch_takes_back_a_revived_worker(sim):
    flaky = SimWorker(sim, "flaky", 1.0, dies_at=1.5, back_at=4.0)
    steady = SimWorker(sim, "steady", 1.0)
    pool, got = run_sim(sim, [flaky, steady], [1.0] * 16)
    assert sorted(c for _, c, _ in got) == list(range(16))
    assert pool.alive == {0, 1} and not pool.reviving
    assert any(start >= 4.0 for _, start, _ in flaky.runs)  # it worked again once back
    assert sum(1 for w, _, _ in got if w == 0) >= 5


def test_dispatch_when_every_worker_is_lost(sim):
    from cluster.schedule import WorkersLost

    a, b = SimWorker(sim, "a", 1.0, dies_at=2.5), SimWorker(sim, "b", 1.0, dies_at=3.5)
    got: list = []
    with pytest.raises(WorkersLost, match=r"^every worker is lost$"):
        from cluster import Pool
        from cluster.schedule import dispatch

        pool = Pool([a, b], revive=lambda w: w.revive())
        dispatch([1.0] * 10, pool, lambda w, c: w.submit(c, 1.0), lambda w, c, v: got.append(c))
    # a's chunks 0 and 2 and b's 1 and 3 finished; 4 and 6 died with a, and b died in 7 after finishing 5
    assert sorted(got) == [0, 1, 2, 3, 5] and pool.alive == set()


def test_dispatch_gives_up_when_no_worker_comes_back_in_time(sim):
    from cluster import Pool
    from cluster.schedule import WorkersLost, dispatch

    late = SimWorker(sim, "late", 1.0, dies_at=1.5, back_at=100.0)
    pool = Pool([late], revive=lambda w: w.revive())
    with pytest.raises(WorkersLost, match=r"^every worker is lost and none came back within 30 s$"):
        dispatch([1.0] * 6, pool, lambda w, c: w.submit(c, 1.0), lambda w, c, v: None, revive_timeout=30)
    assert sim.now == pytest.approx(1.5 + 30)
    gone = SimWorker(sim, "gone", 1.0, dies_at=sim.now + 0.5, back_at=sim.now + 1e6)
    with pytest.raises(WorkersLost, match=r"none came back within 600 s$"):  # the default: ten minutes
        dispatch([1.0, 1.0], Pool([gone], revive=lambda w: w.revive()), lambda w, c: w.submit(c, 1.0), lambda *a: None)
    late2 = SimWorker(sim, "late2", 1.0, dies_at=sim.now + 1.5, back_at=sim.now + 20.0)
    start = sim.now
    pool, got = run_sim(sim, [late2], [1.0] * 6, revive_timeout=30)
    assert sorted(c for _, c, _ in got) == list(range(6)) and sim.now > start + 20  # waited for it, and it finished


# Exact traces of small runs: which worker got which chunk when (`w<c@t`) and whose copy of a chunk arrived
# first (`c>w@t`), times from the start. They pin the scheduling policy (backup choice by expected finish,
# speed estimates, depth, requeueing, revived workers, the revive timeout) decision by decision; each was
# picked because a one-token change in dispatch alters it. If the policy changes on purpose, re-derive them.
# (start clock, seconds per cost unit per worker, chunk costs, depth, per worker (dies at, back at), revive timeout)
TRACES = {
    "dies-and-returns": (
        (0.0, [1, 3, 5], [1, 3, 2, 0.5, 0.5, 2, 2, 3], 2, [None, None, (0.5, 4)], 30.0),
        "0<0@0 1<1@0 2<2@0 0<3@0 1<4@0 2<5@0 0>0@1 0<5@1 3>0@1.5 0<2@1.5 5>0@3.5 0<6@3.5 2<7@4 2>0@5.5 6>0@7.5 "
        "0<4@7.5 4>0@8 0<7@8 1>1@9 7>0@11", (0, 1, 2), 1),
    "uneven-depth-1": (
        (1000.0, [3, 0.3, 2], [2, 2, 1, 2, 1, 3, 0.5], 1, [None, None, None], 2.0),
        "0<0@0 1<1@0 2<2@0 1>1@0.6 1<3@0.6 3>1@1.2 1<4@1.2 4>1@1.5 1<5@1.5 2>2@2 2<6@2 5>1@2.4 1<0@2.4 6>2@3 0>1@3",
        (0, 1, 2), 1),
    "very-fast-and-a-death": (
        (0.0, [50, 2], [0.2, 0.5, 3, 0.5, 0.5, 0.5, 3, 2], 2, [None, (3, 4)], 600.0),
        "0<0@0 1<1@0 0<2@0 1<3@0 1>1@1 1<4@1 3>1@2 1<5@2 1<5@4 1<4@4 5>1@5 1<6@5 4>1@6 1<7@6 0>0@10 6>1@12 7>1@16 "
        "1<2@16 2>1@22", (0, 1), 1),
    "twins": (
        (1000.0, [5, 5], [0.5, 2, 2, 0.5, 2, 2, 0.5, 0.5], 1, [None, None], 30.0),
        "0<0@0 1<1@0 0>0@2.5 0<2@2.5 1>1@10 1<3@10 2>0@12.5 0<4@12.5 3>1@12.5 1<5@12.5 4>0@22.5 0<6@22.5 5>1@22.5 "
        "1<7@22.5 6>0@25 7>1@25", (0, 1), 0),
    "first-second": (
        (0.0, [5, 0.3, 0.3], [0.2, 1, 1, 1], 1, [(3, 4), None, None], 2.0),
        "0<0@0 1<1@0 2<2@0 1>1@0.3 1<3@0.3 2>2@0.3 2<0@0.3 0>2@0.36 3>1@0.6", (0, 1, 2), 1),
    "ties": (
        (1000.0, [50, 0.3, 5], [3, 0.5, 3, 3, 3], 1, [(3, 4), None, None], 30.0),
        "0<0@0 1<1@0 2<2@0 1>1@0.15 1<3@0.15 3>1@1.05 1<4@1.05 4>1@1.95 1<0@1.95 0>1@2.85 1<2@2.85 2>1@3.75",
        (1, 2), 1),
    "late-return": (
        (1000.0, [5, 1, 1], [3, 2, 3, 1, 2, 2, 1, 0.2], 1, [(1.5, 8), None, None], 2.0),
        "0<0@0 1<1@0 2<2@0 1>1@2 1<0@2 2>2@3 2<3@3 3>2@4 2<4@4 0>1@5 1<5@5 4>2@6 2<6@6 5>1@7 1<7@7 6>2@7 7>1@7.2",
        (1, 2), 0),
    "died-early": (
        (0.0, [1, 0.3], [0.5, 2, 0.5, 2, 3, 0.2, 2, 3, 2], 1, [(0.5, 4), None], 30.0),
        "0<0@0 1<1@0 1>1@0.6 1<0@0.6 0>1@0.75 1<2@0.75 2>1@0.9 1<3@0.9 3>1@1.5 1<4@1.5 4>1@2.4 1<5@2.4 5>1@2.46 "
        "1<6@2.46 6>1@3.06 1<7@3.06 7>1@3.96 1<8@3.96 0<8@4 8>1@4.56", (0, 1), 1),
    "two-speeds": (
        (1000.0, [1, 2], [1, 0.2, 3, 2, 0.5, 0.2, 2], 2, [None, None], 30.0),
        "0<0@0 1<1@0 0<2@0 1<3@0 1>1@0.4 1<4@0.4 0>0@1 0<5@1 2>0@4 0<6@4 5>0@4.2 3>1@4.4 4>1@5.4 6>0@6.2", (0, 1), 0),
    "busy-no-backup": (
        (0.0, [5, 50, 5], [1, 0.2, 0.2, 1], 2, [None, None, None], 30.0),
        "0<0@0 1<1@0 2<2@0 0<3@0 2>2@1 2<3@1 0>0@5 3>2@6 2<1@6 1>2@7", (0, 1, 2), 2),
    "long-chunk-short-timeout": (
        (0.0, [5, 3], [3, 0.2, 2], 1, [None, (3, 4)], 2.0),
        "0<0@0 1<1@0 1>1@0.6 1<2@0.6 1<2@4 2>1@10 1<0@10 0>0@15", (0, 1), 1),
    "all-within-the-first-second": (  # a clock that starts at 0: every expected finish is below 1 s
        (0.0, [1, 0.3], [0.2, 1, 0.5], 2, [None, (3, None)], 600.0),
        "0<0@0 1<1@0 0<2@0 0>0@0.2 1>1@0.3 1<2@0.3 2>1@0.45", (0, 1), 1),
    "backup-dies": (
        (1000.0, [0.3, 1], [0.2, 1, 0.2, 2], 2, [(0.5, 8), None], 600.0),
        "0<0@0 1<1@0 0<2@0 1<3@0 0>0@0.06 2>0@0.12 0<3@0.12 1>1@1 3>1@3", (1,), 0),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRACES))
def test_dispatch_decisions_are_exactly_these(sim, name):
    from cluster import Pool
    from cluster.schedule import dispatch

    (start, speeds, costs, depth, deaths, revive_timeout), expected, alive, cancelled = TRACES[name]
    sim.now = start
    workers = [
        SimWorker(sim, f"w{i}", s, dies_at=start + d[0] if d else math.inf, back_at=start + d[1] if d and d[1] else None)
        for i, (s, d) in enumerate(zip(speeds, deaths))
    ]
    trace: list[str] = []

    def submit(worker, c):
        trace.append(f"{worker.name[1:]}<{c}@{sim.now - start:.6g}")
        return worker.submit(c, costs[c])

    pool = Pool(workers, revive=lambda w: w.revive())
    dispatch(
        costs, pool, submit,
        lambda w, c, value: trace.append(f"{c}>{w}@{sim.now - start:.6g}"), depth=depth, revive_timeout=revive_timeout,
    )  # fmt: skip
    assert " ".join(trace) == expected
    assert tuple(sorted(pool.alive)) == alive and len(sim.cancelled) == cancelled


def test_fewer_chunks_per_worker_make_larger_chunks():
    costs = [10] * 1000
    first = cut(costs, [[i] for i in range(1000)], workers=3, max_tokens=10**6, min_tokens=1, per_worker=PER_WORKER // 2)
    assert len(first[0]) == math.ceil(10_000 / (PER_WORKER // 2 * 3)) // 10  # the budget's share of the tokens
    plain = cut(costs, [[i] for i in range(1000)], workers=3, max_tokens=10**6, min_tokens=1)
    assert len(first) < len(plain)


def test_intake_reads_each_piece_from_the_cache_and_cuts_only_what_it_lacks(tmp_path):
    """cluster.intake without a cluster: a streamed run's pieces, the real result cache and progress bar."""
    from cluster.intake import Intake, Stored
    from cluster.plan import cut_piece
    from cluster.schedule import Feed
    from driver.lm.cache import Cache
    from driver.lm.progress import Progress
    from worker.spec import Batching, Job

    requests = [((1, 2, i), (3, i)) for i in range(10)]
    job, batching = Job(kind="loglikelihood"), Batching(batch_size=4, max_batch_tokens=8)
    stored = Stored(Cache(tmp_path))
    stored.identify({"model": "m"})
    keys = stored.cache.keys(stored.prefix(job), job.kind, requests)
    stored.store([(keys[i], [-float(i), True]) for i in (0, 3, 4, 9)])  # an earlier run's results

    def cutter(*args, **kw):
        return cut_piece(*args, workers=2, batching=batching, max_length=64, **kw)

    intake = Intake(stored, Progress(), cutter, job, Feed([requests[:5], requests[5:]]), len(requests))
    costs = []
    while (new := intake.more(5.0)) is not None:
        costs += new
    assert intake.todo == requests and len(costs) == len(intake.chunks) > 1
    missing = sorted(i for chunk in intake.chunks for i in chunk)
    assert missing == [1, 2, 5, 6, 7, 8] and intake.merge.count == stored.cached == 4
    intake.store(missing, [[-float(i), False] for i in missing])  # what the workers would send back
    assert [r[0] for r in intake.merge.result()] == [-float(i) for i in range(10)]
    assert len(stored.cache.get(keys)) == 10  # the new results cached under the same keys
    stored.cache.close()


def test_generation_requests_sharing_a_prefix_are_cut_as_one_family():
    """Few-shot prompts (one long shared prefix) are one group for the cut, so one worker prefills the exemplars
    once; prompts sharing nothing, and with sharing off, stay single requests."""
    from cluster.plan import request_costs
    from worker.generate import GenRequest

    shots = tuple(range(10, 110))
    few_shot = [GenRequest(context=shots + (200 + i, 300 + i), max_gen_toks=8) for i in range(5)]
    loose = [GenRequest(context=(400 + i, 500 + i, 600 + i), max_gen_toks=8) for i in range(3)]
    costs, groups = request_costs("generate", few_shot + loose, 2048, True)
    assert costs == [102 + 8] * 5 + [3 + 8] * 3
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3, 4], [5], [6], [7]]
    chunks = cut(costs, groups, workers=4, max_tokens=4096, min_tokens=1)
    assert any(set(range(5)) <= set(c) for c in chunks)
    _, off = request_costs("generate", few_shot + loose, 2048, False)
    assert sorted(map(sorted, off)) == [[i] for i in range(8)]


# --- worker groups (cluster.groups.GroupPool) on the simulated cluster --------------------------------------------
# A group is K simulated ranks that run every chunk in lockstep (same speed); the scheduler sees one worker whose
# result is rank 0's; the other ranks' refs are watched. Killing a group fails every rank's pending refs at once.


class SimRank:
    def __init__(self, worker, costs):
        self.worker, self.costs = worker, costs
        self.run = self

    def remote(self, c):
        return self.worker.submit(c, self.costs[c])

    def kill(self):
        sim = self.worker.sim
        self.worker.dies_at = min(self.worker.dies_at, sim.now)
        for ref in self.worker.pending:
            if ref.at > sim.now and ref.error is None:
                ref.at, ref.error, ref.value = sim.now, RayActorError(self.worker.name), None


@pytest.fixture
def group_sim(sim, monkeypatch):
    import sys
    import types

    import cluster.groups.pool

    sys.modules["ray"].kill = lambda actor, no_restart=True: actor.kill()

    def sleep(s):
        sim.now += s

    monkeypatch.setattr(cluster.groups.pool, "time", types.SimpleNamespace(monotonic=lambda: sim.now, sleep=sleep))
    return sim


def run_groups(sim, speeds, costs, deaths=None, deadline=600.0):
    """Groups of ranks (speeds[g] per rank; deaths[(g, r)] = when that rank dies); (pool, results, groups)."""
    from cluster.groups import GroupHandle, GroupPool
    from cluster.schedule import dispatch

    deaths = deaths or {}
    groups = [
        GroupHandle([SimRank(SimWorker(sim, f"g{g}r{r}", s, dies_at=deaths.get((g, r), math.inf)), costs) for r in range(k)], g)
        for g, (s, k) in enumerate(speeds)
    ]
    pool = GroupPool(groups, deadline=deadline)
    got: list = []
    dispatch(costs, pool, lambda group, c: group.run.remote(c), lambda w, c, value: got.append((w, c, value)))
    return pool, got, groups


def test_a_groups_rank_dying_loses_the_whole_group_and_its_chunks_come_back(group_sim):
    pool, got, groups = run_groups(group_sim, [(1.0, 2), (1.0, 2)], [1.0] * 12, deaths={(1, 1): 2.5})
    assert sorted(c for _, c, _ in got) == list(range(12))  # every chunk once
    assert pool.alive == {0} and pool.reasons == ["group g1 lost: its ring broke"]
    assert all(r.worker.dies_at < math.inf for r in groups[1].ranks)  # rank 0 of the lost group killed with it
    # rank 0 (alive in this simulation) delivers until the group is killed, 2 s after the death is seen (the time
    # given to Ray to name the dead rank); what it delivered is kept, nothing is delivered twice
    assert [c for w, c, _ in got if w == 1] == [1, 3, 5, 7] and groups[1].ranks[0].worker.dies_at == pytest.approx(4.6)
    assert not group_sim.cancelled


def test_a_hung_group_is_lost_at_its_deadline_and_backups_on_groups_are_never_cancelled(group_sim):
    pool, got, groups = run_groups(group_sim, [(1.0, 2), (1000.0, 2)], [1.0] * 10, deadline=30.0)
    assert sorted(c for _, c, _ in got) == list(range(10)) and all(w == 0 for w, _, _ in got)
    assert pool.alive == {0, 1}  # backups finished the slow group's chunks before its deadline: it is not lost
    assert not group_sim.cancelled  # a group's copy just finishes: cancelling one rank's task would desync the ring
    from cluster.schedule import WorkersLost

    with pytest.raises(WorkersLost, match=r"^every worker group is lost \(group g0 lost: no rank answered within its 30 s deadline"):
        run_groups(group_sim, [(1000.0, 2)], [1.0] * 3, deadline=30.0)
