"""The pipeline schedule (worker.split.schedule, issue 26) as pure logic: every rank's steps pair up with its
neighbours' (each send meets the receive of the same micro-batch), only the last rank runs the head, and the
clock-step view is DeepSpeed's InferenceSchedule (stage s runs micro-batch t - s at step t)."""

from __future__ import annotations

import pytest

from worker.split.plan import answering_rank
from worker.spec import Grouping
from worker.split.schedule import Step, efficiency, rank_steps, timeline


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
