"""Guards for a sweep's fluency verdicts and report (driver.sweep.fluency, summary, report): each test fails on a
one-line slip that once survived.

- a configuration not fluent on one prompt set is not fluent, however it does on the others (`and`, not `or`);
- "largest change from baseline" is the largest |delta|, a fall as much as a rise;
- `not_fluent` (run.json, summary.md) lists the configurations judged not fluent, never those with no verdict
  (a configuration set aside before it generated anything).

The verdict and the extremes are pure logic over plain rows; the report is written by `report.write_outputs` for a
real sweep file checked by `load_sweep` against the session's random llama.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from driver.sweep import fluency, report
from driver.sweep.plan import load_sweep
from driver.sweep.rows import BASELINE, EMPTY, add_deltas
from driver.sweep.running import Outcome
from driver.sweep.summary import extremes

# --- the verdict: every prompt set must pass ----------------------------------------------------------------------


def _fluency_rows(config: str, sets: dict[str, float]) -> list[dict]:
    """fluency_logprob (the given value per prompt set) and repetition_rate 0 rows of one configuration."""
    out = []
    for name, logprob in sets.items():
        out += [{"config": config, "task": name, "metric": "fluency_logprob", "value": logprob},
                {"config": config, "task": name, "metric": "repetition_rate", "value": 0.0}]  # fmt: skip
    return out


def _generations(config: str, sets) -> list[dict]:
    return [{"config": config, "prompt_set": name, "text": "some words here"} for name in sets]


FAR = -2 * fluency.LOGPROB_MARGIN  # far enough below the baseline's 0.0 to be degenerate


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_a_configuration_not_fluent_on_one_prompt_set_is_not_fluent(order):
    sets = {"a": 0.0, "b": FAR}
    sets = {name: sets[name] for name in order}  # whichever prompt set is judged first
    rows = _fluency_rows(BASELINE, {n: 0.0 for n in sets}) + _fluency_rows("c1", sets) + _fluency_rows("c2", {n: 0.0 for n in sets})
    gens = _generations(BASELINE, sets) + _generations("c1", sets) + _generations("c2", sets)
    fluency.mark(rows, gens)
    verdicts = {r["config"]: r["fluent"] for r in rows}
    assert verdicts == {BASELINE: True, "c1": False, "c2": True}
    assert {g["config"]: g["fluent"] for g in gens} == verdicts


def test_a_configuration_not_fluent_on_its_only_prompt_set_is_not_fluent():
    rows = _fluency_rows(BASELINE, {"a": 0.0}) + _fluency_rows("c1", {"a": FAR})
    fluency.mark(rows, _generations(BASELINE, "a") + _generations("c1", "a"))
    assert {r["config"]: r["fluent"] for r in rows} == {BASELINE: True, "c1": False}


# --- the largest change: by its size ---------------------------------------------------------------------------


def _metric_rows(values: dict[str, float]) -> list[dict]:
    rows = [{"config": c, "task": "t", "metric": "m", "value": v} for c, v in values.items()]
    add_deltas(rows)
    return rows


@pytest.mark.parametrize("higher_is_better", [True, False, None])
def test_the_largest_change_is_the_largest_fall_when_it_outweighs_every_rise(higher_is_better):
    rows = _metric_rows({BASELINE: 1.0, "up": 2.0, "down": -4.0, "still": 1.0})
    assert extremes(rows, higher_is_better)[1]["config"] == "down"
    rows = _metric_rows({BASELINE: 1.0, "up": 7.0, "down": -4.0})
    assert extremes(rows, higher_is_better)[1]["config"] == "up"


# --- not_fluent in run.json and summary.md: judged configurations only ------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, llama_path):
    """A checked sweep: layer 0 of the random llama, alphas -2, 2, 4, one prompt set generating."""
    folder = tmp_path_factory.mktemp("guard-sweep")
    save_file({"resid_post.0": np.random.default_rng(3).standard_normal(64).astype(np.float32)}, str(folder / "v.safetensors"))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a", "The cat")))
    (folder / "sweep.yaml").write_text(f"""model: {{pretrained: {llama_path}, max_length: 64}}
vectors:
  v: {{file: v.safetensors}}
grid:
  layers: [0]
  alphas: [-2.0, 2.0, 4.0]
prompts:
  - {{file: prompts.jsonl, max_gen_toks: 4}}
""")
    return load_sweep(folder / "sweep.yaml")


def _outcome(sweep) -> tuple[Outcome, dict[str, str]]:
    """Rows as a sweep gives them: the baseline, a fluent configuration, a degenerate one and one set aside before
    generating (its rows carry the failure, it has no generations)."""
    base, fine, bad, failed = sweep.configs
    name = next(iter(sweep.prompt_sets))
    rows, gens = [], []
    for config, logprob in ((base, -1.0), (fine, -1.2), (bad, -1.0 + FAR)):
        for metric, value in (("fluency_logprob", logprob), ("repetition_rate", 0.1)):
            rows.append({**config.fields, "task": name, "metric": metric, "value": value, "stderr": None, "n": 2, "error": None})
        gens += [{**config.fields, "prompt_set": name, "index": i, "line": i + 1, "prompt": "p", "text": "a b c d",
                  "fluency_logprob": logprob, "repetition_rate": 0.1, "error": None} for i in range(2)]  # fmt: skip
    why = "non-finite log-likelihood: while generating"
    rows += [{**failed.fields, "task": name, "metric": m, "value": None, "stderr": None, "n": 0, "error": why} for m in fluency.METRICS]
    add_deltas(rows)
    fluency.mark(rows, gens)
    better = {(name, m): hib for m, hib in fluency.METRICS.items()}
    ids = {"fine": fine.id, "bad": bad.id, "failed": failed.id}
    ids.update({f"{k} alpha": f"α={c.alpha:g} " for k, c in (("fine", fine), ("bad", bad), ("failed", failed))})
    return Outcome(sweep, rows, gens, {}, {}, 1.0, better), ids


def test_not_fluent_lists_judged_configurations_only(sweep, tmp_path):
    outcome, ids = _outcome(sweep)
    verdicts = {r["config"]: r["fluent"] for r in outcome.rows}
    assert (verdicts[ids["fine"]], verdicts[ids["bad"]], verdicts[ids["failed"]]) == (True, False, None)
    report.write_outputs(outcome, tmp_path)
    facts = json.loads((tmp_path / "run.json").read_text())
    assert facts["not_fluent"] == [ids["bad"]]
    assert list(facts["failed"]) == [ids["failed"]]
    summary = (tmp_path / "summary.md").read_text()
    fluent_part = summary.split("## Fluency", 1)[1].split("\n## ", 1)[0]
    assert "1 of 3 configurations are not fluent" in fluent_part
    assert ids["bad alpha"] in fluent_part
    assert ids["fine alpha"] not in fluent_part and ids["failed alpha"] not in fluent_part
