"""A sweep's evidence (issue 36 items 1, 2, 3, 6): samples.jsonl against a steered forward by hand in torch on the
same weights, steerability.csv against numpy.polyfit and scipy's Spearman, the held-out pick recomputed by hand,
every change's interval against a hand paired t, and the summary's rule (no "best" within noise). One small real
sweep (the session's cluster, 1 worker); the pure functions without Ray."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from driver.evidence import records, selection, stats, steerability
from driver.sweep import plots, report, summary
from driver.sweep.rows import BASELINE
from test_sweep import PROMPTS, sweep_cli, write_study

ALPHAS = (-2.0, 2.0, 4.0)
SELECT = "select: {fraction: 0.5, seed: 3}"
MC_DOCS = 6


@pytest.fixture(scope="module")
def study(tmp_path_factory, llama_path, tasks_dir) -> Path:
    """Layers 0 and 1 × alphas -2, 2, 4 of a unit vector; 4 prompts with targets (greedy 4-token generations) and
    6 documents of the multiple-choice task; half of each source's samples choose, half report."""
    sweep = write_study(tmp_path_factory.mktemp("evidence"), llama_path, tasks_dir, alphas=ALPHAS, max_gen_toks=4, extra=SELECT)
    text = sweep.read_text().replace("[orchard_mc, orchard_ppl, orchard_gen]", "[orchard_mc]").replace("limit: 4", f"limit: {MC_DOCS}")
    sweep.write_text(text)
    return sweep


@pytest.fixture(scope="module")
def out(ray_cluster, study, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("evidence-out")
    code, output = sweep_cli(study, "--workers", 1, "--output", folder)
    assert code == 0, output
    return folder


def _samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in open(folder / "samples.jsonl")]


def _csv(path: Path) -> list[dict]:
    return list(csv.DictReader(open(path)))


# --- per-sample values against a steered forward by hand -------------------------------------------------------


class Steered:
    """The model in torch (transformers, the same weights) with alpha · v added to a decoder layer's output (the
    residual stream after the block: resid_post) at every position."""

    def __init__(self, path: Path, vectors: dict[int, np.ndarray]) -> None:
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.vectors = {layer: torch.tensor(v / np.linalg.norm(v), dtype=torch.float32) for layer, v in vectors.items()}  # normalize: true

    def logprob(self, tokens: tuple, n_continuation: int, layer: int | None, alpha: float) -> float:
        torch = self.torch

        def add(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden + alpha * self.vectors[layer]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        handle = self.model.model.layers[layer].register_forward_hook(add) if layer is not None else None
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([list(tokens[:-1])])).logits[0].double()
        finally:
            if handle is not None:
                handle.remove()
        logp = torch.log_softmax(logits, -1)
        positions = range(len(tokens) - 1 - n_continuation, len(tokens) - 1)
        return float(sum(logp[i, tokens[i + 1]] for i in positions))


@pytest.fixture(scope="module")
def by_hand(study, llama_path):
    """(Steered model, lm-eval's tokenization of a (context, continuation) pair as the sweep's model does it)."""
    from driver.lm.mlx import MLXLM
    from driver.sweep import load_sweep

    lm = MLXLM(**{k: v for k, v in load_sweep(study).model_args.items() if k != "threads"})
    weights = load_file(str(study.parent / "v.safetensors"))
    model = Steered(llama_path, {i: weights[f"resid_post.{i}"] for i in range(2)})

    def score(context: str, continuation: str, layer, alpha) -> float:
        ctx, cont = lm._encode_pair(context, continuation)
        seen = (tuple(ctx) + tuple(cont))[-(lm.max_length + 1) :]  # a long few-shot context is left-truncated, as lm-eval does
        return model.logprob(seen, len(cont), layer, alpha)

    return score


def test_prompt_records_equal_a_steered_forward_by_hand(out, by_hand):
    """Every configuration's logprob_<target>, logprob_diff and p_positive per prompt equal torch's log-probs of the
    target under alpha · v added at the layer's output; the text the model saw is the prompt."""
    mine = [r for r in _samples(out) if r["source"] == "prompts"]
    assert len(mine) == len(PROMPTS) * (1 + 2 * len(ALPHAS))
    texts = {i + 1: p for i, p in enumerate(PROMPTS)}
    for r in mine:
        prompt, positive, negative = texts[r["sample"]]
        assert r["input"] == prompt and r["split"] in ("select", "report")
        layer, alpha = r["layer"], r["alpha"]
        pos, neg = by_hand(prompt, positive, layer, alpha), by_hand(prompt, negative, layer, alpha)
        assert r["logprob_positive"] == pytest.approx(pos, abs=2e-4), r["config"]
        assert r["logprob_negative"] == pytest.approx(neg, abs=2e-4), r["config"]
        assert r["logprob_diff"] == pytest.approx(pos - neg, abs=3e-4)
        assert r["p_positive"] == pytest.approx(1 / (1 + math.exp(neg - pos)), abs=1e-4)


def test_task_records_p_gold_equals_a_steered_forward_and_acc_averages_to_the_row(out, by_hand, tasks_dir):
    """Multiple choice: each document's p_gold is its gold choice's probability over the four choices (torch's
    log-probs, steered by hand); each configuration's per-document acc averages to results.csv's acc."""
    docs = [json.loads(line) for line in open(tasks_dir / "mc_test.jsonl")][:MC_DOCS]
    mine = [r for r in _samples(out) if r["source"] == "orchard_mc"]
    assert len(mine) == MC_DOCS * (1 + 2 * len(ALPHAS)) and {r["sample"] for r in mine} == set(range(MC_DOCS))
    checked = [r for r in mine if r["config"] == BASELINE or (r["layer"] == 0 and r["alpha"] == 4.0)]
    for r in checked:
        lls = np.array([by_hand(r["input"], f" {c}", r["layer"], r["alpha"]) for c in "ABCD"])
        p = np.exp(lls - lls.max())
        assert r["p_gold"] == pytest.approx(p[docs[r["sample"]]["answer"]] / p.sum(), abs=1e-4), (r["config"], r["sample"])
    acc = {r["config"]: r["value"] for r in report.read_csv(out / "results.csv") if r["metric"] == "acc"}
    for config in acc:
        assert np.mean([r["acc"] for r in mine if r["config"] == config]) == pytest.approx(acc[config], abs=1e-9)
    assert len({round(r["p_gold"], 6) for r in checked}) > MC_DOCS  # steering moved p_gold


# --- steerability: slopes against numpy.polyfit ---------------------------------------------------------------


def test_steerability_equals_polyfit_over_every_alpha_and_the_baseline(out):
    from scipy.stats import spearmanr

    samples = _samples(out)
    rows = _csv(out / "steerability.csv")
    assert {(r["source"], r["metric"]) for r in rows} == {("prompts", "logprob_diff"), ("orchard_mc", "p_gold")}
    assert len(rows) == 2 * 2  # 2 layers × 2 sources
    for row in rows:
        metric, layer = row["metric"], int(row["layer"])
        mine = [r for r in samples if r["source"] == row["source"] and (r["config"] == BASELINE or r["layer"] == layer)]
        slopes, rhos = [], []
        for sample in sorted({r["sample"] for r in mine}):
            points = sorted((r["alpha"], r[metric]) for r in mine if r["sample"] == sample)
            assert [a for a, _ in points] == [-2.0, 0.0, 2.0, 4.0]  # every alpha and the baseline's 0
            slopes.append(np.polyfit(*zip(*points), 1)[0])
            rhos.append(spearmanr(*zip(*points))[0])
        assert float(row["slope"]) == pytest.approx(np.mean(slopes), rel=1e-6, abs=1e-9)
        assert float(row["slope_stderr"]) == pytest.approx(np.std(slopes, ddof=1) / math.sqrt(len(slopes)), rel=1e-6)
        assert float(row["anti_steerable"]) == pytest.approx(np.mean(np.array(slopes) < 0))
        assert float(row["spearman"]) == pytest.approx(np.nanmean(rhos), abs=1e-9)
        assert int(row["n"]) == len(slopes)
    image = (out / "plots" / "steerability-prompts.png").read_bytes()
    assert image.startswith(b"\x89PNG") and (out / "plots" / "steerability-orchard_mc.png").exists()


def test_slope_and_spearman_equal_numpy_and_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.integers(-3, 4, 7).astype(float), rng.standard_normal(7).round(1)
        if len(set(x)) < 2:
            continue
        assert stats.slope(x, y) == pytest.approx(np.polyfit(x, y, 1)[0], abs=1e-9)
        assert stats.spearman(x, y) == pytest.approx(spearmanr(x, y)[0], abs=1e-9)


# --- held-out selection, recomputed by hand --------------------------------------------------------------------


def _split_by_hand(ids: list, fraction: float, seed: int) -> set:
    ids = sorted(set(ids))
    k = min(max(round(fraction * len(ids)), 1), len(ids) - 1)
    return {ids[i] for i in np.random.default_rng(seed).permutation(len(ids))[:k]}


def test_the_held_out_pick_is_chosen_on_one_part_and_reported_on_the_other(out):
    samples = _samples(out)
    facts = json.loads((out / "run.json").read_text())
    unfluent = set(facts["not_fluent"])
    assert facts["select"] == {"fraction": 0.5, "seed": 3}
    for source in ("prompts", "orchard_mc"):
        mine = [r for r in samples if r["source"] == source]
        chosen = _split_by_hand([r["sample"] for r in mine], 0.5, 3)
        assert {r["sample"] for r in mine if r["split"] == "select"} == chosen
        assert {r["sample"] for r in mine if r["split"] == "report"} == {r["sample"] for r in mine} - chosen
        for metric, higher in (("logprob_diff", True), ("logprob_negative", False), ("p_gold", True)):
            if metric not in mine[0]:
                continue
            entry = next(e for e in facts["selection"] if (e["source"], e["metric"]) == (source, metric))
            means = {}
            for r in mine:
                if r["config"] != BASELINE and r["config"] not in unfluent:  # "best" is among fluent configurations
                    means.setdefault(r["config"], {"select": [], "report": []})[r["split"]].append(r[metric])
            pick = (max if higher else min)(means, key=lambda c: np.mean(means[c]["select"]))
            assert entry["config"] == pick
            assert entry["select_value"] == pytest.approx(np.mean(means[pick]["select"]))
            report_values = means[pick]["report"]
            assert entry["report_value"] == pytest.approx(np.mean(report_values))
            assert entry["report_stderr"] == pytest.approx(np.std(report_values, ddof=1) / math.sqrt(len(report_values)))
            assert (entry["n_select"], entry["n_report"]) == (len(chosen), len(report_values))
    text = (out / "summary.md").read_text()
    assert "chosen on the select part" in text and "reported on the report part" in text


def test_a_split_depends_only_on_the_samples_fraction_and_seed():
    ids = list(range(1, 21))
    a = selection.split_samples(ids, 0.3, 7)
    assert a == selection.split_samples(list(reversed(ids)) + ids[:3], 0.3, 7)  # order and repeats do not matter
    assert {s for s, p in a.items() if p == "select"} == _split_by_hand(ids, 0.3, 7)
    assert a != selection.split_samples(ids, 0.3, 8)
    assert list(selection.split_samples([5, 9], 0.01, 0).values()).count("select") == 1  # each part keeps a sample


# --- paired intervals --------------------------------------------------------------------------------------------


def test_every_change_has_the_hand_paired_t_interval(out):
    from scipy.stats import t

    samples = _samples(out)
    rows = report.read_csv(out / "results.csv")
    checked = 0
    for r in rows:
        mine = [s for s in samples if s["source"] == r["task"] and r["metric"] in s]
        if r["config"] == BASELINE or not mine:
            continue
        base = {s["sample"]: s[r["metric"]] for s in mine if s["config"] == BASELINE}
        d = np.array([s[r["metric"]] - base[s["sample"]] for s in mine if s["config"] == r["config"]])
        half = t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
        assert (r["delta_low"], r["delta_high"]) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-9), (r["config"], r["metric"])
        checked += 1
    assert checked == 2 * len(ALPHAS) * 5  # logprob_positive, _negative, _diff, p_positive and acc per configuration
    fluency_rows = [r for r in rows if r["metric"] == "fluency_logprob" and r["config"] != BASELINE]
    assert all(r["delta_low"] is not None for r in fluency_rows)  # generation metrics: paired by prompt


def test_t_critical_equals_scipy():
    from scipy.stats import t

    for df in (1, 2, 3, 4, 7, 30, 500, 5000):
        assert stats.t_critical(df) == pytest.approx(t.ppf(0.975, df), rel=1e-7)
    iv = stats.paired([3.0, 5.0, 4.0], [1.0, 2.0, 2.0])
    d = np.array([2.0, 3.0, 2.0])
    half = t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert (iv["low"], iv["high"], iv["n"]) == pytest.approx((d.mean() - half, d.mean() + half, 3))


# --- summary.md and the plots say what is within noise -------------------------------------------------------------


def _rows(*changes: tuple[str, float, float, float]) -> list[dict]:
    rows = [{"config": BASELINE, "op": None, "value": 1.0, "delta": 0.0, "fluent": True}]
    return rows + [{"config": c, "op": "add", "value": 1.0 + d, "delta": d, "delta_low": lo, "delta_high": hi, "fluent": True}
                   for c, d, lo, hi in changes]  # fmt: skip


def test_best_and_largest_are_named_only_beyond_noise():
    within = _rows(("a", 0.12, -0.05, 0.3), ("b", -0.02, -0.1, 0.06))
    assert summary.named(within, True) == (summary.NOISE, summary.NOISE)
    mixed = _rows(("a", 0.5, -0.1, 1.1), ("b", 0.2, 0.1, 0.3), ("c", -0.3, -0.4, -0.2))
    best, largest = summary.named(mixed, True)
    assert best["config"] == "b" and largest["config"] == "c"  # a is higher but within noise
    assert summary.named(mixed, False)[0]["config"] == "c"
    assert summary.named(_rows(("c", -0.3, -0.4, -0.2)), True) == (summary.NO_GAIN, _rows(("c", -0.3, -0.4, -0.2))[1])
    prompt = _rows(("b", 0.2, 0.1, 0.3)) + [{"config": "prompt:x", "op": "prompt", "value": 9.0, "delta": 8.0, "delta_low": 7.0,
                                             "delta_high": 9.0, "fluent": True}]  # fmt: skip
    assert summary.named(prompt, True)[0]["config"] == "b"  # a prompting baseline is never "best"
    assert plots.within_noise(within[1]) and not plots.within_noise(mixed[2])


def test_summary_and_plots_of_the_sweep(out):
    text = (out / "summary.md").read_text()
    for section in ("## Steerability", "## Held-out selection", "plots/steerability-prompts.png"):
        assert section in text
    rows = report.read_csv(out / "results.csv")
    noisy = [r for r in rows if plots.within_noise(r)]
    line = next(x for x in text.splitlines() if x.startswith("| prompts | logprob_diff |"))
    grid = [r for r in rows if r["task"] == "prompts" and r["metric"] == "logprob_diff" and r["config"] != BASELINE]
    if all(plots.within_noise(r) for r in grid):
        assert summary.NOISE in line
    else:
        assert summary.NOISE not in line
    assert noisy  # with 4 prompts some change is within noise: its heatmap cell is muted, and the title says so
    image = plots.heatmap("orchard_mc", "acc", [r for r in rows if r["metric"] == "acc"])
    assert image.startswith(b"\x89PNG")


def test_a_feature_activation_gets_its_unsteered_value_as_alpha_zero():
    rows = [{"config": f"f.L0.a{a}", "vector": "s-f3", "site": "resid_post", "layer": 0, "op": "add", "positions": "all", "alpha": a,
             "value": 2.0 + a, "delta": a, "stderr": 0.1, "n": 4, "task": "p", "metric": "feature_activation"} for a in (-1.0, 1.0)]  # fmt: skip
    own = plots._own_baselines(rows)
    assert own[0]["value"] == 2.0 and own[0]["alpha"] == 0.0
    assert plots.panel_axes(rows)[1] == [-1.0, 0.0, 1.0]
    assert plots.lines("p", "feature_activation", rows).startswith(b"\x89PNG")
    metrics = plots.by_metric(rows)
    assert summary._unsteered(rows, metrics) == ["| p | feature_activation (s-f3 at L0 resid_post, unsteered) | 2 | – | 4 |"]


# --- records: p_gold as lm-eval reads a target ----------------------------------------------------------------


def test_p_gold_reads_an_index_a_choice_text_and_leaves_mutual_information_out():
    lls = [(-1.0, False), (-2.0, False), (-0.5, True)]
    args = [("Q:", " yes"), ("Q:", " no"), ("Q:", " maybe")]
    p = np.exp([-1.0, -2.0, -0.5]) / np.exp([-1.0, -2.0, -0.5]).sum()
    assert records.p_gold({"filtered_resps": lls, "arguments": args, "target": 1}) == pytest.approx(p[1])
    assert records.p_gold({"filtered_resps": lls, "arguments": args, "target": "maybe"}) == pytest.approx(p[2])
    assert records.p_gold({"filtered_resps": lls, "arguments": args, "target": 7}) is None
    mutual = {"filtered_resps": lls + [(-9.0, False)] * 3, "arguments": args * 2, "target": 0, "metrics": ["acc", "acc_mutual_info"]}
    assert records.p_gold(mutual) == pytest.approx(p[0])


def test_steerability_leaves_out_ablation_and_prompting_and_clamp_keeps_its_own_zero():
    def rec(config, op, alpha, sample, v):
        return {"config": config, "vector": "v", "layer": 0, "site": "resid_post", "head": None, "op": op, "positions": "all",
                "alpha": alpha, "threshold": None, "source": "s", "sample": sample, "logprob_diff": v}  # fmt: skip

    recs = [rec(BASELINE, None, 0.0, s, 10.0) for s in (1, 2)]
    recs += [rec(f"c{a}", "clamp", a, s, a * s) for a in (1.0, 2.0) for s in (1, 2)]
    recs += [rec("abl", "ablate", None, s, 0.0) for s in (1, 2)] + [rec("prompt:x", "prompt", None, s, 5.0) for s in (1, 2)]
    rows = steerability.steerability(recs)
    assert len(rows) == 1 and rows[0]["op"] == "clamp" and rows[0]["slopes"] == pytest.approx([1.0, 2.0])


# --- `select:` in the file -----------------------------------------------------------------------------------------


def test_a_bad_select_is_refused_in_one_line_before_any_worker(llama_path, tasks_dir, tmp_path):
    sweep = write_study(tmp_path, llama_path, tasks_dir, tasks=False, extra="select: {fraction: 1.5, seed: 1}")
    out = tmp_path / "out"
    code, output = sweep_cli(sweep, "--workers", "1", "--address", "127.0.0.1:1", "--output", out)  # unreachable: never tried
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert code == 1 and len(errors) == 1, output
    assert "select.fraction: 1.5 is not between 0 and 1" in errors[0] and "Traceback" not in output
    assert not out.exists()


def test_without_select_summary_says_best_was_chosen_and_reported_on_the_same_samples():
    from driver.evidence.analysis import Evidence

    entry = {"source": "s", "metric": "m", "config": "c", "select_value": 1.0, "report_value": 1.0, "report_stderr": 0.1,
             "n_select": 4, "n_report": 4, "report_change": {"mean": 0.5, "low": 0.1, "high": 0.9}, "prompting": None}  # fmt: skip
    rows = [{"config": "c", "vector": "v", "layer": 0, "site": "resid_post", "op": "add", "alpha": 2.0, "positions": "all"}]
    text = "\n".join(summary._selection(Evidence([], [], [entry], held_out=False), rows))
    assert "chosen and reported on the same samples" in text and "| s | m | v L0 resid_post add α=2 (all) (1, 4) |" in text
    assert "| yes |" in text
