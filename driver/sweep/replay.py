"""lm-eval in a sweep: its requests recorded once, then replayed per configuration from the grid's answers.

The unsteered run records the token-level requests lm-eval sends (`Recorder`); each
configuration's run is answered from the grid's results for those requests (`Replay`), so lm-eval computes
its own metrics per configuration without the workers scoring anything twice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from worker.spec import Job, Steering

from cluster.schedule import gather


class Recorder:
    """An executor that passes jobs through and remembers each call's (kind, requests)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        requests = gather(requests, total)
        self.calls.append((job.kind, requests))
        return self.inner.run(job, requests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Replay:
    """An executor that answers the recorded calls, in order, from a configuration's grid results; anything else
    (lm-eval asked for different requests) goes to the real executor, which serves it from the cache or computes it."""

    def __init__(self, inner, calls: list, answers: list, steering: Steering) -> None:
        self.inner, self.calls, self.answers, self.steering = inner, calls, answers, steering
        self.next, self.missed = 0, 0

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        requests = gather(requests, total)
        i, self.next = self.next, self.next + 1
        if i < len(self.calls) and job.steering == self.steering and self.calls[i] == (job.kind, list(requests)):
            return list(self.answers[i])
        self.missed += len(requests)
        return self.inner.run(job, requests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def swapped_executor(lm, executor):
    """Inside the block, `lm` sends its requests to `executor`."""
    saved, lm.executor = lm.executor, executor
    try:
        yield executor
    finally:
        lm.executor = saved


def lm_eval_per_config(lm, args, sweep, calls, answers, results, output, echo, failed: dict[int, str]) -> None:
    """lm-eval's results per configuration into `results`, its recorded `calls` answered from the grid's
    `answers`; a `failed` configuration (non-finite scores) is skipped: its rows are failed cells."""
    from driver.judge.prompting import PROMPT, task_plan
    from driver.lm.evaluation import evaluate

    offsets: dict[str, int] = {"loglikelihood": 0, "generate": 0}
    spans = []
    for kind, requests in calls:
        spans.append((kind, offsets[kind], len(requests)))
        offsets[kind] += len(requests)
    for c, config in enumerate(sweep.configs[1:], 1):
        if c in failed:
            continue  # a non-finite score: lm-eval would fail on it (or score empty texts); its rows are failed cells
        if config.op == PROMPT:  # other contexts, other requests: its own lm-eval run, unsteered, computed or cached
            results[config.id] = evaluate(lm, args, task_plan(sweep.plan, config), str(output)).results
            continue
        if config.steering.conditional:  # as `driver run --steer` runs it, counting the rows fired per task; its
            with lm.steered(config.steering, config.record):  # requests come from the cache its own jobs filled
                results[config.id] = evaluate(lm, args, sweep.plan, str(output)).results
            continue
        per_call = [answers[kind][c][o : o + n] for kind, o, n in spans]
        replay = Replay(lm.executor, calls, per_call, config.steering)
        with lm.steered(config.steering, config.record), swapped_executor(lm, replay):
            results[config.id] = evaluate(lm, args, sweep.plan, str(output)).results
        if replay.missed:
            echo(f"sweep: {config.id}: lm-eval sent {replay.missed} requests the baseline did not; computed them apart")
