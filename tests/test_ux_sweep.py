"""What a sweep shows: its phases on stderr (the grid, writing the outputs), stdout its result lines only, and
summary.md saying why each configuration is not fluent (the measure, its value, the threshold)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from driver.cli import main
from driver.sweep import fluency
from driver.sweep.rows import BASELINE
from test_sweep import write_study


def _rows(config: str, logprob: float, rep: float) -> list[dict]:
    return [{"config": config, "task": "p", "metric": "fluency_logprob", "value": logprob},
            {"config": config, "task": "p", "metric": "repetition_rate", "value": rep}]  # fmt: skip


def _gens(config: str, texts: list[str]) -> list[dict]:
    return [{"config": config, "prompt_set": "p", "text": t} for t in texts]


@pytest.mark.parametrize(
    "logprob, rep, texts, said",
    [(-2.0, 0.1, ["a", "b"], []),
     (-4.0, 0.1, ["a", "b"], ["p: fluency_logprob -4.00 < -3.50 (the baseline's -2.00 − 1.5)"]),
     (-2.0, 0.4, ["a", "b"], ["p: repetition_rate 0.40 > 0.30 (the baseline's 0.10 + 0.2)"]),
     (-2.0, 0.1, ["a", "", "", ""], ["p: empty generations 75% > 25% (the baseline's 0% + 25%)"]),
     (-4.0, 0.4, ["a", "b"], ["p: fluency_logprob -4.00 < -3.50 (the baseline's -2.00 − 1.5)",
                              "p: repetition_rate 0.40 > 0.30 (the baseline's 0.10 + 0.2)"])],
)  # fmt: skip
def test_each_reason_names_the_measure_its_value_and_the_threshold(logprob, rep, texts, said):
    rows = _rows(BASELINE, -2.0, 0.1) + _rows("c1", logprob, rep)
    gens = _gens(BASELINE, ["x", "y"]) + _gens("c1", texts)
    assert fluency.why_not(rows, gens) == ({"c1": said} if said else {})
    marked = [dict(r) for r in rows]
    fluency.mark(marked, [dict(g) for g in gens])
    assert {r["config"]: r["fluent"] for r in marked} == {BASELINE: True, "c1": not said}  # one rule for both


def test_a_sweep_tells_its_phases_and_summary_says_why_not_fluent(ray_cluster, llama_path, tasks_dir, tmp_path):
    study = write_study(tmp_path / "study", llama_path, tasks_dir, tasks=False, alphas=(1.0, 400.0), max_gen_toks=8)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["sweep", str(study), "--workers", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output
    phases = [line for line in result.stderr.splitlines() if line.startswith("driver: ") and not line.startswith("driver: checking ")]
    assert phases[0].startswith("driver: opening ")
    assert phases[1] == f"driver: using the Ray cluster this process is connected to, at {ray_cluster.address}: 1 worker", phases
    assert any(p.startswith("driver: sweep: 4 configurations + the baseline") for p in phases), phases
    assert f"driver: writing the tables, summary.md and plots under {out}" in phases
    assert "driver:" not in result.stdout and result.stdout.splitlines()[-1].startswith(f"results: {out}")
    text = (out / "summary.md").read_text()
    bad = [line for line in text.splitlines() if line.startswith("| v L")]
    verdicts = {}
    import json

    for line in open(out / "generations.jsonl"):
        g = json.loads(line)
        verdicts[g["config"]] = g["fluent"]
    assert sum(v is False for v in verdicts.values()) == len(bad), text
    assert bad, "alpha 400 on a normalized vector is expected to break fluency"
    for line in bad:
        assert "prompts: " in line and (" < " in line or " > " in line), line
