"""Guards for the hook manager's "did every installed hook run" check (worker.hooks.HookManager.installed): a hook
idle through exactly one kernel forward is an error, a hook that ran exactly once is not, no forward at all is
not; the same across a group's ring (a one-rank ring here). Each fails on an off-by-one in those thresholds.

Real random llama from the session fixtures (its instrumented blocks run the hooks)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker.hooks import HookError, Rows
from worker.load import load

TOKENS = [[1, 5, 9, 20, 30]]


@pytest.fixture(scope="module")
def lm(llama_path):
    return load(str(llama_path))


class Count:
    """A hook that counts its calls and changes nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: mx.array, ctx) -> mx.array:
        self.calls += 1
        return x


def _forward(lm) -> None:
    with lm.hooks.forward(Rows()):
        mx.eval(lm.head.body(mx.array(TOKENS)))


def _skipping_forward(lm) -> None:
    """A kernel forward whose model runs no block (as a family that calls its blocks' parts directly would)."""
    with lm.hooks.forward(Rows()):
        pass


@pytest.fixture(params=["alone", "ring"])
def hooks(request, lm):
    """The model's hooks, alone or on a one-rank ring (idle hooks then counted with all_sum across it)."""
    saved = lm.hooks.group
    lm.hooks.group = mx.distributed.init() if request.param == "ring" else None
    yield lm.hooks
    lm.hooks.group = saved


def test_a_hook_idle_through_one_forward_is_an_error(lm, hooks):
    hook = Count()
    with pytest.raises(HookError, match=r"^hook resid_post\.1 never ran although the llama model ran forward"):
        with hooks.installed([("resid_post.1", hook)]):
            _skipping_forward(lm)
    assert hook.calls == 0 and not hooks.active


def test_a_hook_that_ran_once_in_one_forward_is_not_idle(lm, hooks):
    hook = Count()
    with hooks.installed([("resid_post.1", hook)]):
        _forward(lm)
    assert hook.calls == 1


def test_no_forward_at_all_is_not_an_error(lm, hooks):
    with hooks.installed([("resid_post.1", Count())]):
        pass


def test_the_idle_one_of_two_hooks_is_named(lm, hooks):
    ran, idle = Count(), Count()
    with pytest.raises(HookError, match=r"^hook resid_post\.0 never ran"):
        with hooks.installed([("resid_post.1", ran), ("resid_post.0", idle)]):
            with hooks.forward(Rows()):  # a forward that runs block 1's hook point only
                hooks.run("resid_post.1", mx.zeros((1, 2, 64)), 1)
    assert ran.calls == 1 and idle.calls == 0


def test_a_hook_of_a_layer_this_rank_does_not_run_is_not_idle(lm, hooks):
    saved = hooks.owned
    hooks.owned = range(1, 2)  # a pipeline rank holding layer 1 only: layer 0's hook runs on another rank
    try:
        with hooks.installed([("resid_post.0", Count())]):
            _skipping_forward(lm)
    finally:
        hooks.owned = saved
