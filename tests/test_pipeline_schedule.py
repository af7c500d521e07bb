"""The pipeline schedule (worker.split.schedule, issue 26) as pure logic: every rank's steps pair up with its
neighbours' (each send meets the receive of the same micro-batch), only the last rank runs the head, and the
clock-step view is DeepSpeed's InferenceSchedule (stage s runs micro-batch t - s at step t)."""

from __future__ import annotations

import pytest

from worker.split.plan import answering_rank
from worker.spec import Grouping
from worker.split.schedule import Step, decode_steps, efficiency, rank_steps, round_opening, round_steps, simulate, timeline


@pytest.mark.parametrize("size,micros", [(2, 1), (2, 5), (3, 4), (4, 7), (8, 3)])
def test_every_send_meets_the_next_rank_s_receive_in_the_same_order(size, micros):
    plans = [rank_steps(r, size, micros) for r in range(size)]
    for r in range(size - 1):
        sends = [(s.micro, s.peer) for s in plans[r] if s.op == "send"]
        recvs = [(s.micro, r + 1) for s in plans[r + 1] if s.op == "recv" and s.peer == r]
        assert sends == recvs == [(m, r + 1) for m in range(micros)]
    assert not any(s.op == "recv" for s in plans[0])
    assert not any(s.op == "send" for s in plans[-1])


@pytest.mark.parametrize("size", [2, 3, 5])
def test_only_the_last_rank_runs_the_head_and_each_micro_batch_once_in_order(size):
    micros = 6
    for r in range(size):
        steps = rank_steps(r, size, micros)
        heads = [s.micro for s in steps if s.op == "head"]
        assert heads == (list(range(micros)) if r == size - 1 else [])
        assert [s.micro for s in steps if s.op == "forward"] == list(range(micros))
        for s in steps:  # a micro-batch is received before its forward, which comes before its send or head
            order = [x.op for x in steps if x.micro == s.micro]
            assert order == (["recv"] if r else []) + ["forward", "send" if r < size - 1 else "head"]


def test_a_rank_outside_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="outside a pipeline of 2"):
        rank_steps(2, 2, 3)


def test_timeline_is_stage_s_on_micro_batch_t_minus_s():
    assert timeline(3, 4) == [[0, None, None], [1, 0, None], [2, 1, 0], [3, 2, 1], [None, 3, 2], [None, None, 3]]
    steps = timeline(4, 10)
    assert len(steps) == 4 + 10 - 1
    for t, row in enumerate(steps):  # every micro-batch once per stage; the pipe is full in the middle
        assert row == [t - s if 0 <= t - s < 10 else None for s in range(4)]
    assert all(None not in row for row in steps[3:10])


def test_efficiency_is_fill_and_drain_over_the_whole():
    assert efficiency(1, 5) == 1.0
    assert efficiency(2, 1) == 0.5
    assert efficiency(4, 97) == pytest.approx(97 / 100)
    busy = sum(m is not None for row in timeline(3, 8) for m in row)
    assert efficiency(3, 8) == pytest.approx(busy / (3 * len(timeline(3, 8))))


def test_the_last_rank_answers_a_pipeline_group_rank_0_a_tensor_one():
    assert answering_rank(Grouping(size=3, split="pipeline")) == 2
    assert answering_rank(Grouping(size=2, split="tensor")) == 0
    assert answering_rank(None) == 0
    assert Step("send", 0, 1) != Step("send", 0, 2)


# --- decoding round the ring (round_opening / round_steps / decode_steps, run by worker.split.decode) -----------

ROUNDS = [(2, [3]), (2, [1, 4, 2]), (3, [5, 1, 3]), (3, [2, 2, 2, 2]), (4, [6, 3, 1, 4, 2]), (5, [1])]


def _link_messages(plans: list[list[Step]], kind: str) -> tuple[dict, dict]:
    """Per (sender, receiver): the micro-batches sent and received, in order ("hidden": send/recv, "ids")."""
    send, recv = ("send", "recv") if kind == "hidden" else ("send_ids", "recv_ids")
    sent: dict = {}
    got: dict = {}
    for r, plan in enumerate(plans):
        for s in plan:
            if s.op == send:
                sent.setdefault((r, s.peer), []).append(s.micro)
            elif s.op == recv:
                got.setdefault((s.peer, r), []).append(s.micro)
    return sent, got


@pytest.mark.parametrize("size,rounds", ROUNDS)
def test_every_decode_send_meets_its_receive_in_the_same_order(size, rounds):
    plans = [decode_steps(r, size, rounds) for r in range(size)]
    for kind in ("hidden", "ids"):
        sent, got = _link_messages(plans, kind)
        assert sent == got
        assert all(dst in ((src + 1) % size,) for src, dst in sent)  # ring neighbours only, K-1 -> 0 among them
    sent, _ = _link_messages(plans, "ids")
    assert {dst for src, dst in sent if src == size - 1} == {0}  # the new ids go from the last rank to rank 0


@pytest.mark.parametrize("size,rounds", ROUNDS)
def test_the_last_rank_samples_each_round_and_every_rank_runs_each_forward(size, rounds):
    for r in range(size):
        plan = decode_steps(r, size, rounds)
        for m, n in enumerate(rounds):
            assert sum(s.op == "forward" and s.micro == m for s in plan) == n
            assert sum(s.op == "sample" and s.micro == m for s in plan) == (n if r == size - 1 else 0)
            # the ids of every round after the prefill reach every rank but the last (the closing round's too)
            assert sum(s.op == "recv_ids" and s.micro == m for s in plan) == (n if r < size - 1 else 0)
    assert round_opening(0, 3, 0, first=True) == [] and round_opening(2, 3, 0, first=False) == []
    assert round_steps(1, 3, 4, first=False, done=True) == []  # closing: rank 1 of 3 has no one to pass ids to
    assert round_steps(0, 3, 4, first=False, done=True) == [Step("send_ids", 4, 1)]


def _runs_to_the_end(plans: list[list[Step]], ids_wait: bool = False) -> bool:
    """Run the plans as processes would: a hidden-state send waits until its receiver took it (a large tensor), an
    ids send never waits (a few bytes in the socket's buffer) unless `ids_wait`; True when every rank finishes,
    False on a deadlock."""
    at, waiting = [0] * len(plans), [0] * len(plans)  # waiting: the number of the send this rank waits on (0: none)
    queued: dict = {}
    taken: dict = {}
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            while at[r] < len(plan):
                s = plan[at[r]]
                if s.peer is None:  # forward, sample: this rank's own work
                    at[r] += 1
                    moved = True
                    continue
                sender, receiver = (r, s.peer) if s.op.startswith("send") else (s.peer, r)
                link = (s.op.removeprefix("send").removeprefix("recv"), sender, receiver)  # "" (hidden) or "_ids"
                box = queued.setdefault(link, [])
                if s.op.startswith("recv"):
                    if not box:
                        break
                    assert box.pop(0) == s.micro
                    taken[link] = taken.get(link, 0) + 1
                elif s.op == "send_ids" and not ids_wait:
                    box.append(s.micro)
                elif not waiting[r]:
                    box.append(s.micro)
                    waiting[r] = taken.get(link, 0) + len(box)  # taken once the receiver took every send before it
                    moved = True
                    break
                else:
                    if taken.get(link, 0) < waiting[r]:
                        break
                    waiting[r] = 0
                at[r] += 1
                moved = True
    return all(a == len(p) for a, p in zip(at, plans))


@pytest.mark.parametrize("size,rounds", ROUNDS)
def test_the_decode_plan_cannot_deadlock_with_blocking_sends(size, rounds):
    assert _runs_to_the_end([decode_steps(r, size, rounds) for r in range(size)])
    if len(rounds) > 1:  # why the ids must be a few bytes: rank 0 sending m + 1 and the last rank m's ids wait on each other
        assert not _runs_to_the_end([decode_steps(r, size, rounds) for r in range(size)], ids_wait=True)


PREFILLS = [(2, [3, 1], [2, 1]), (3, [1, 4, 2], [3, 1, 2]), (4, [2, 2], [1, 4])]


@pytest.mark.parametrize("size,rounds,prefills", PREFILLS)
def test_a_prefill_of_several_parts_runs_a_forward_each_on_every_rank_and_samples_once(size, rounds, prefills):
    """A micro-batch whose prefill joins parts (rows after different shared prefixes) runs one forward per part round
    the ring, each sent on and received in order, and the last rank samples once per round."""
    plans = [decode_steps(r, size, rounds, prefills) for r in range(size)]
    assert _runs_to_the_end(plans)
    for kind in ("hidden", "ids"):
        sent, got = _link_messages(plans, kind)
        assert sent == got
    for r, plan in enumerate(plans):
        for m, (n, parts) in enumerate(zip(rounds, prefills)):
            forwards = [s.forward for s in plan if s.op == "forward" and s.micro == m]
            assert forwards == list(range(parts)) + [0] * (n - 1)
            assert sum(s.op == "sample" and s.micro == m for s in plan) == (n if r == size - 1 else 0)
            if 0 < r:  # each part's hidden state comes from the rank before, tagged with its forward
                assert [s.forward for s in plan if s.op == "recv" and s.micro == m][:parts] == list(range(parts))
    assert round_steps(1, 2, 0, first=True, forwards=2) == [Step("recv", 0, 0, 0), Step("forward", 0, forward=0),
                                                            Step("recv", 0, 0, 1), Step("forward", 0, forward=1),
                                                            Step("sample", 0), Step("send_ids", 0, 0)]  # fmt: skip


def test_simulate_is_the_scoring_pipe_for_one_round_and_fills_the_ring_with_k_micro_batches():
    for size, micros in [(2, 1), (3, 4), (4, 7)]:
        assert simulate([1.0] * size, 0.0, micros) == pytest.approx(efficiency(size, micros))
    assert simulate([1.0] * 3, 0.0, 3, rounds=200) > 0.98  # M = K: every stage busy once the ring is full
    assert simulate([1.0] * 3, 0.0, 1, rounds=200) == pytest.approx(1 / 3, rel=0.02)  # one micro-batch: one stage at a time
    assert simulate([1.0] * 2, 0.5, 2, rounds=200) < simulate([1.0] * 2, 0.5, 4, rounds=200)  # links want more in flight
    assert simulate([1.0, 2.0], 0.0, 4, rounds=100) == pytest.approx(0.75, rel=0.02)  # the slow stage sets the pace
