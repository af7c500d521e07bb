"""Reruns and resumed runs on a real loopback cluster: a cache that holds every result starts no worker, one
that holds some starts them at the first request it lacks, and the numbers are the in-process model's."""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle

from cluster import ClusterError, WorkerActor
from driver.lm.mlx_ray import MLXRayLM
from test_cluster import MC, MODEL_ARGS, assert_same, evaluate, reference, run_ray, tasks  # noqa: F401

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module


def computed(info: dict) -> int:
    return sum(info["requests_computed"].values())


def test_a_fully_cached_rerun_starts_no_worker(ray_cluster, llama_path, tasks, reference, tmp_path):  # noqa: F811
    cache = str(tmp_path / "cache")
    first, info = run_ray(llama_path, tasks, workers=2, cache=cache)
    total = computed(info)
    assert info["workers"] == 2 and info["requests_cached"] == 0 and total > 0
    again, info = run_ray(llama_path, tasks, workers=2, cache=cache)
    assert (info["workers"], info["address"], info["facts"]) == (0, None, [])
    assert (computed(info), info["requests_cached"]) == (0, total)
    assert_same(first, reference)
    assert_same(again, reference)


def test_a_resumed_run_starts_workers_at_the_first_request_the_cache_lacks(ray_cluster, llama_path, tasks, reference, tmp_path):  # noqa: F811
    cache = str(tmp_path / "cache")
    _, info = run_ray(llama_path, tasks, MC, workers=2, cache=cache)  # the multiple-choice task only
    mc = computed(info)
    lm = MLXRayLM.create_from_arg_obj({"pretrained": str(llama_path), **MODEL_ARGS, "workers": 2, "cache": cache})
    try:
        assert lm.executor.connection is None  # the cache holds this model's results: nothing started yet
        ours = evaluate(lm, None, tasks)  # the multiple-choice task again, then perplexity and generation
        info = lm.executor.info()
    finally:
        lm.executor.close()
    assert info["workers"] == 2 and info["requests_cached"] == mc and computed(info) > 0
    assert_same(ours, reference)


class OtherCopy(WorkerActor):
    """A worker whose node holds other bytes under the model's path than the head does."""

    def facts(self) -> dict:
        return {**super().facts(), "model_files": "0" * 32}


def test_workers_holding_other_files_than_the_head_are_refused_in_one_line(ray_cluster, llama_path):
    model = type("OtherCopyRayLM", (MLXRayLM,), {"actor_cls": OtherCopy})
    lm = model(pretrained=str(llama_path), workers=2, **MODEL_ARGS)
    try:
        with pytest.raises(ClusterError) as e:
            lm.executor.wait_ready()
    finally:
        lm.executor.close()
    message = str(e.value)
    assert "\n" not in message and message.startswith("the workers hold other weights files than the head (000000000000 on ")
    assert f"`driver stage --model {llama_path}` (or `driver run --stage`) copies the head's" in message
