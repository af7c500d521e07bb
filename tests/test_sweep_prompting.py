"""Prompting baselines in a sweep (`prompting: {NAME: TEXT}`, issue 36 item 4): each `prompt:NAME` configuration's
target scores, generations and lm-eval documents equal the same text prefixed by hand and scored directly by the
in-process model; it is reported beside the steering configurations, never drawn as a grid cell; and the chat
template's system message where a tokenizer has one."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from driver.judge import prompting
from driver.sweep import report
from test_sweep import PROMPTS, sweep_cli, write_study

TEXTS = {"happy": "Write about joy and happy days.", "sad": "Write a sad story."}


@pytest.fixture(scope="module")
def prompted(ray_cluster, llama_path, tasks_dir, tmp_path_factory):
    """A sweep of layer 1 × alpha 2 with two prompting baselines, on a prompt set and orchard_mc (4 documents, 1-shot),
    on 2 workers: (the sweep file, its output folder)."""
    folder = tmp_path_factory.mktemp("prompted")
    extra = f"""prompting:
  happy: {TEXTS['happy']}
  sad: {TEXTS['sad']}
tasks:
  names: [orchard_mc]
  limit: 4
  num_fewshot: 1
  include_path: {tasks_dir}
"""
    sweep = write_study(folder / "study", llama_path, tasks_dir, tasks=False, alphas=(2.0,), extra=extra)
    sweep.write_text(sweep.read_text().replace("max_length: 64", "max_length: 256").replace("layers: all", "layers: [1]"))
    out = folder / "out"
    start = time.monotonic()
    code, output = sweep_cli(sweep, "--workers", 2, "--output", out)
    print(f"the prompted sweep: {time.monotonic() - start:.1f} s")
    assert code == 0, output
    assert "2 prompting baselines" in output, output
    return sweep, out


def _model(sweep):
    from driver.lm.mlx import MLXLM
    from driver.sweep import load_sweep

    return MLXLM(**{k: v for k, v in load_sweep(sweep).model_args.items() if k != "threads"})


def test_a_prompting_row_equals_the_text_prefixed_by_hand(prompted):
    """Each baseline's logprob_* / p_positive rows and its greedy generations equal the in-process model's on
    TEXT + blank line + prompt (this tokenizer has no chat template), scored directly; they differ from the baseline's."""
    from lm_eval.api.instance import Instance

    sweep, out = prompted
    lm = _model(sweep)
    rows = {(r["config"], r["metric"]): r for r in report.read_csv(out / "results.csv") if r["task"] == "prompts"}
    gens = [json.loads(line) for line in open(out / "generations.jsonl")]
    for name, text in TEXTS.items():
        config = f"prompt:{name}"
        seen = [f"{text}\n\n{p}" for p, _, _ in PROMPTS]
        scores = lm.loglikelihood([Instance("loglikelihood", {}, (s, t), 0) for s, (_, a, b) in zip(seen, PROMPTS) for t in (a, b)], disable_tqdm=True)
        pos, neg = np.array([s for s, _ in scores[0::2]]), np.array([s for s, _ in scores[1::2]])
        want = {"logprob_positive": pos.mean(), "logprob_negative": neg.mean(), "logprob_diff": (pos - neg).mean(),
                "p_positive": (1 / (1 + np.exp(neg - pos))).mean()}  # fmt: skip
        for metric, value in want.items():
            row = rows[(config, metric)]
            assert row["value"] == pytest.approx(value, abs=1e-4), (config, metric)
            assert (row["op"], row["layer"], row["alpha"], row["site"]) == ("prompt", None, None, None), row
            assert row["value"] != pytest.approx(rows[("baseline", metric)]["value"], abs=1e-3), (config, metric)
        mine = [g for g in gens if g["config"] == config]
        texts = lm.generate_until([Instance("generate_until", {}, (s, {"until": [], "max_gen_toks": 6}), 0) for s in seen], disable_tqdm=True)
        assert [g["input"] for g in mine] == seen and [g["prompt"] for g in mine] == [p for p, _, _ in PROMPTS]
        assert [g["text"] for g in mine] == texts, config


def test_a_prompting_baselines_lm_eval_documents_equal_the_context_prefixed_by_hand(prompted, tasks_dir):
    """orchard_mc under a prompting baseline is its own lm-eval run: each document's context is the baseline's with
    TEXT and a blank line before it, and its gold choice's probability over the choices (samples.jsonl `p_gold`) and
    `acc` equal the in-process model's scores of those contexts, computed here."""
    from lm_eval.api.instance import Instance

    sweep, out = prompted
    lm = _model(sweep)
    docs = [json.loads(line) for line in open(tasks_dir / "mc_test.jsonl")]
    records = [json.loads(line) for line in open(out / "samples.jsonl")]
    plain = {r["sample"]: r for r in records if r["config"] == "baseline" and r["source"] == "orchard_mc"}
    assert sorted(plain) == [0, 1, 2, 3]
    for name, text in TEXTS.items():
        mine = {r["sample"]: r for r in records if r["config"] == f"prompt:{name}" and r["source"] == "orchard_mc"}
        assert sorted(mine) == sorted(plain)
        correct = []
        for doc, r in mine.items():
            context = f"{text}\n\n{plain[doc]['input']}"
            assert r["input"] == context
            lls = np.array([s for s, _ in lm.loglikelihood([Instance("loglikelihood", {}, (context, f" {c}"), 0) for c in "ABCD"], disable_tqdm=True)])
            p = np.exp(lls - lls.max())
            gold = docs[doc]["answer"]
            assert r["p_gold"] == pytest.approx(p[gold] / p.sum(), rel=1e-3, abs=1e-9), (name, doc)
            assert r["p_gold"] != pytest.approx(plain[doc]["p_gold"], rel=1e-2), (name, doc)
            correct.append(float(np.argmax(lls) == gold))
        acc = next(r for r in report.read_csv(out / "results.csv") if r["config"] == f"prompt:{name}" and r["metric"] == "acc")
        assert acc["value"] == pytest.approx(np.mean(correct))


def test_prompting_baselines_are_reported_beside_never_drawn_or_chosen(prompted):
    sweep, out = prompted
    rows = report.read_csv(out / "results.csv")
    configs = [c["config"] for c in json.loads((out / "run.json").read_text())["configurations"]]
    assert configs[-2:] == ["prompt:happy", "prompt:sad"] and len(configs) == 1 + 1 + 2
    assert {r["config"] for r in rows} == set(configs)
    assert (out / "lm-eval" / "prompt_happy.json").exists()
    text = (out / "summary.md").read_text()
    per_metric = text[text.index("## Per metric") :].split("\n## ", 1)[0]
    assert "prompt:" not in per_metric  # best and largest change: steering configurations only
    assert "prompt:happy" in text  # ... the prompting baselines beside them


def test_the_prefix_is_the_chat_templates_system_message_where_the_tokenizer_has_one(llama_path):
    """Pure: a tokenizer with a chat template gets TEXT as its system message; one whose template refuses a system
    message gets TEXT, a blank line and the prompt as the user's turn; lm-eval's system instruction likewise."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    assert prompting.prefixed(tok, "Be kind.", "Hello") == "Be kind.\n\nHello"
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    assert prompting.prefixed(tok, "Be kind.", "Hello") == "<system>Be kind.<user>Hello<assistant>"
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                         "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")  # fmt: skip
    assert prompting.prefixed(tok, "Be kind.", "Hello") == "<user>Be kind.\n\nHello<assistant>"
    assert prompting.system_instruction("Be kind.", chat=True) == "Be kind."
    assert prompting.system_instruction("Be kind.", chat=False) == "Be kind.\n\n"
