"""A judge in a sweep (`judge: {model, concept}`, issue 36 item 5) and repeated samples (`seeds: [..]`, item 7):
every generation's three ratings equal transformers' next-token probabilities of "0", "1", "2" on the logged rubric
prompt (Σ k·p_k, normalized over the three), the rows are their means over prompts and seeds, each seed draws its
own sample; bad judge, prompting and seeds blocks are refused in one line before any worker."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from driver.judge import pareto, rubric
from driver.sweep import report
from test_sweep import PROMPTS, sweep_cli, write_study

SEEDS = (0, 1)
CONCEPT = "happiness and joy"


@pytest.fixture(scope="module")
def judged(ray_cluster, llama_path, tasks_dir, stories_path, tmp_path_factory):
    """Layer 1 × alpha 2, sampled generations (temperature 0.9, 2 seeds), judged by the shipped TinyStories-260K, on
    2 workers: (the sweep file, its output folder)."""
    folder = tmp_path_factory.mktemp("judged")
    extra = f"judge: {{model: {stories_path}, concept: {CONCEPT}}}\n"
    sweep = write_study(folder / "study", llama_path, tasks_dir, tasks=False, alphas=(2.0,), extra=extra)
    text = sweep.read_text().replace("layers: all", "layers: [1]")
    sweep.write_text(text.replace("max_gen_toks: 6}", f"max_gen_toks: 6, temperature: 0.9, seeds: {list(SEEDS)}}}"))
    out = folder / "out"
    start = time.monotonic()
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    print(f"the judged sweep: {time.monotonic() - start:.1f} s")
    assert code == 0, output
    return sweep, out


def _generations(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "generations.jsonl")]


def test_judge_ratings_equal_transformers_next_token_probabilities_on_the_logged_prompt(judged, stories_path):
    """transformers (a test-only oracle) on the judge's weights: each logged rubric prompt, tokenized as lm-eval's hf
    backend does, its last position's probabilities of the digit tokens normalized over the three, Σ k·p_k."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = judged
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    model = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    digits = [tok.convert_tokens_to_ids(d) for d in "012"]
    gens = _generations(out)
    assert len(gens) == 2 * len(PROMPTS) * len(SEEDS)  # the baseline and one steering configuration
    want: dict[str, float] = {}
    for g in gens[:: len(SEEDS)]:  # every prompt of both configurations (one seed each: transformers is slow here)
        for scale in rubric.SCALES:
            prompt = g["judge_prompts"][scale]
            if prompt not in want:
                with torch.no_grad():
                    logits = model(torch.tensor([tok.encode(prompt)])).logits[0, -1].double()
                p = torch.softmax(logits[digits], 0)
                want[prompt] = float(sum(k * p[k] for k in range(3)))
            assert g["judge"][scale] == pytest.approx(want[prompt], abs=2e-4), (g["config"], scale)
        ratings = [g["judge"][s] for s in rubric.SCALES]
        assert g["judge"]["score"] == pytest.approx(3 / sum(1 / r for r in ratings), rel=1e-9)
        template = (rubric.SHIPPED / "fluency.txt").read_text().removesuffix("\n")
        assert g["judge_prompts"]["fluency"] == template.format(sentence=g["text"]) + "\n\nRating: [["
        assert CONCEPT in g["judge_prompts"]["concept"] and g["prompt"] in g["judge_prompts"]["instruction"]
    assert len({round(v, 4) for v in want.values()}) > 3  # the ratings tell prompts apart


def test_judge_and_generation_rows_are_means_over_prompts_and_seeds(judged):
    _, out = judged
    gens = _generations(out)
    rows = {(r["config"], r["metric"]): r for r in report.read_csv(out / "results.csv")}
    configs = {g["config"] for g in gens}
    assert configs == {"baseline", "v.resid_post.L1.add.all.a+2"}
    for config in configs:
        mine = [g for g in gens if g["config"] == config]
        assert sorted((g["line"], g["seed"]) for g in mine) == sorted((n + 1, s) for n in range(len(PROMPTS)) for s in SEEDS)
        for scale in (*rubric.SCALES, "score"):
            values = [g["judge"][scale] for g in mine]
            row = rows[(config, f"judge_{scale}")]
            assert row["value"] == pytest.approx(np.mean(values), rel=1e-9) and row["n"] == len(mine)
            assert row["stderr"] == pytest.approx(np.std(values, ddof=1) / np.sqrt(len(values)), rel=1e-6)
        said = [g["fluency_logprob"] for g in mine if g["text"]]
        assert rows[(config, "fluency_logprob")]["value"] == pytest.approx(np.mean(said), rel=1e-9)
    facts = json.loads((out / "run.json").read_text())["judge"]
    assert facts["concept"] == CONCEPT and facts["requests_computed"] + facts["requests_cached"] > 0


def test_each_seed_draws_its_own_sample_the_one_it_draws_in_process(judged):
    """Per prompt the seeds give distinct texts (for most prompts), and the baseline's (prompt, seed) text is the one
    the in-process model samples for that seed."""
    from driver.lm.mlx import MLXLM
    from driver.sweep import load_sweep

    sweep, out = judged
    gens = [g for g in _generations(out) if g["config"] == "baseline"]
    by_prompt = {}
    for g in gens:
        by_prompt.setdefault(g["line"], {})[g["seed"]] = g["text"]
    assert sum(len(set(texts.values())) == len(SEEDS) for texts in by_prompt.values()) >= len(PROMPTS) - 1
    lm = MLXLM(**{k: v for k, v in load_sweep(sweep).model_args.items() if k != "threads"})
    kwargs = {"until": [], "max_gen_toks": 6, "temperature": 0.9, "do_sample": True}
    for g in gens:
        request = lm.generation_request(g["prompt"], kwargs, g["seed"])
        assert lm.executor.run(lm.job("generate"), [request])[0] == g["text"], g


def test_a_pareto_plot_of_behaviour_against_judge_fluency(judged):
    import matplotlib.image

    _, out = judged
    image = matplotlib.image.imread(out / "plots" / "pareto-prompts.png")
    assert image.shape[:2] == (int(pareto.SIZE[1] * 100), int(pareto.SIZE[0] * 100)) and image.std() > 0.01
    text = (out / "summary.md").read_text()
    assert "plots/pareto-prompts.png" in text and "## Judge" in text and "## Repeated samples" in text
    assert pareto.front([(0, 1), (1, 0), (0.5, 0.5), (0.4, 0.4), (1, 0)]) == [0, 2, 1, 4]  # (0.4, 0.4) is dominated


def test_a_rating_is_the_expected_digit_and_the_score_their_harmonic_mean():
    """Pure: the rating of log-probabilities, normalized over the three digits, and AxBench's combination."""
    lp = np.log([0.1, 0.2, 0.3])
    assert rubric.rating(list(lp)) == pytest.approx((0.2 + 2 * 0.3) / 0.6)
    assert rubric.rating([0.0, float("-inf"), float("-inf")]) is None
    assert rubric.score({"concept": 1.0, "instruction": 2.0, "fluency": 2.0}) == pytest.approx(1.5)
    assert rubric.score({"concept": 0.0, "instruction": 2.0, "fluency": 2.0}) == 0.0


@pytest.mark.parametrize(
    "extra, message",
    [
        ("judge: {model: MODEL, concept: joy, rubric: rubric}", "rubric/concept.txt: no {sentence} (the generated text to rate)"),
        ("judge: {model: MODEL, concept: joy, rubric: nowhere}", "judge.rubric: "),
        ("judge: {model: MODEL, concept: ''}", "judge.concept: is empty"),
        ("judge: {model: MODEL, concept: joy, rubrik: x}", "judge.rubrik: unknown field (did you mean 'rubric'?"),
        ("prompting: {'bad name': hi}", "prompting: name 'bad name': use letters, digits"),
        ("prompting: {ok: ''}", "prompting: ok: the text to put before every prompt must be a non-empty string"),
        ("SEEDS", "prompts[0]: seeds: each seed draws another sample only when sampling: set temperature > 0"),
    ],
)
def test_bad_judge_prompting_and_seeds_are_refused_in_one_line_before_any_worker(llama_path, tasks_dir, stories_path, tmp_path,
                                                                                  extra, message):  # fmt: skip
    sweep = write_study(tmp_path, llama_path, tasks_dir, tasks=False, extra="" if extra == "SEEDS" else extra.replace("MODEL", str(stories_path)))
    if extra == "SEEDS":
        sweep.write_text(sweep.read_text().replace("max_gen_toks: 6}", "max_gen_toks: 6, seeds: [0, 1]}"))
    (tmp_path / "rubric").mkdir()
    for scale in rubric.SCALES:
        (tmp_path / "rubric" / f"{scale}.txt").write_text("Rate {concept}." if scale != "fluency" else "Rate it.")
    code, output = sweep_cli(sweep, "--workers", "1", "--address", "127.0.0.1:1", "--output", tmp_path / "out")
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert code == 1 and len(errors) == 1 and message in errors[0], output
    assert not (tmp_path / "out").exists()
