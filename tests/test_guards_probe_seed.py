"""Issue 27.8: the run's seed reaches sampling and the result-cache key. `--seed 8` once gave exactly `--seed 7`'s
texts: each request's seed came from its text alone. Now the run seed (lm-eval's torch seed, which HF's sampling
draws from) is part of a sampled request's seed, so of its GenRequest and its cache key; greedy requests keep
one seed for all runs (their text does not depend on it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from driver.lm import cache
from driver.lm.evaluation import Plan, parse_seeds

SAMPLED = {"do_sample": True, "temperature": 1.5, "top_k": 0, "max_gen_toks": 12, "until": ["\n\n"]}
PROMPTS = ["Once upon a time", "The cat sat on", "A small red"]


@pytest.fixture(scope="module")
def lm(llama_path):
    from driver.lm.mlx import MLXLM

    return MLXLM(pretrained=str(llama_path), batch_size=4)


def _texts(lm, seed, gen_kwargs=SAMPLED):
    lm.sampling_seed = seed
    return lm.generate_until([SimpleNamespace(args=(p, dict(gen_kwargs))) for p in PROMPTS])


def test_two_seeds_sample_differently_and_one_seed_repeats(lm):
    seven, eight = _texts(lm, 7), _texts(lm, 8)
    assert seven != eight  # 3 prompts x 12 tokens at temperature 1.5 on random weights: equal only by a bug
    assert _texts(lm, 7) == seven and _texts(lm, 8) == eight


def test_greedy_text_and_key_do_not_depend_on_the_seed(lm):
    greedy = {"do_sample": False, "max_gen_toks": 6, "until": ["\n\n"]}
    assert _texts(lm, 7, greedy) == _texts(lm, 8, greedy)
    assert lm.generation_request(PROMPTS[0], greedy, 0, 7) == lm.generation_request(PROMPTS[0], greedy, 0, 8)


def test_the_cache_keeps_seed_7_rows_from_seed_8(lm):
    prefix = cache.job_prefix(cache.identity(lm.identity), lm.job("generate"))
    seven = [lm.generation_request(p, SAMPLED, 0, 7) for p in PROMPTS]
    eight = [lm.generation_request(p, SAMPLED, 0, 8) for p in PROMPTS]
    assert not set(cache.keys(prefix, "generate", seven)) & set(cache.keys(prefix, "generate", eight))
    assert cache.keys(prefix, "generate", seven) == cache.keys(prefix, "generate", [lm.generation_request(p, SAMPLED, 0, 7) for p in PROMPTS])


def _lm_eval_texts(lm, tasks_dir, tmp_path, seed: str) -> list:
    from driver.checks.tasks import task_manager
    from driver.lm.evaluation import evaluate

    plan = Plan(seeds=parse_seeds(seed), limit=4, log_samples=True, names=["orchard_gen"],
                gen_kwargs={"do_sample": True, "temperature": 1.5, "top_k": 0},
                manager=task_manager(["orchard_gen"], str(tasks_dir)))  # fmt: skip
    samples = evaluate(lm, {"pretrained": lm.spec.model}, plan, str(tmp_path)).results["samples"]["orchard_gen"]
    return [s["resps"] for s in samples]


def test_lm_eval_s_seed_reaches_sampling(lm, tasks_dir, tmp_path):
    # `driver run --seed 8` sets all four of lm-eval's seeds; the torch one is what HF's sampling draws from
    seven = _lm_eval_texts(lm, tasks_dir, tmp_path, "7")
    assert lm.sampling_seed == 7
    assert _lm_eval_texts(lm, tasks_dir, tmp_path, "8") != seven
    assert _lm_eval_texts(lm, tasks_dir, tmp_path, "0,1234,7,1234") == seven
