"""The judge: a second model rating every generation of a sweep on AxBench's three 0–2 scales (driver.judge.rubric).

It loads on the same workers once the steered model has let them go (one model per worker at a time), through the
same result cache: each rubric prompt is three loglikelihood requests of one-token continuations (the digits
"0", "1", "2"), which the worker scores in one row, and the prompts of one scale share their long rubric prefix,
which the executor keeps together and the worker runs once per chunk (its prefix KV store). Cached, resumable,
on every worker, as any request."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.judge.rubric import SCALES, RubricError, digit_ids, judge_prompt, load_rubric, rating, score
from driver.sweep.rows import EMPTY, finite, mean_stderr
from driver.sweep.schema import SweepError, SweepFile, one_line

__all__ = ["JudgePlan", "Judged", "METRICS", "check_judge", "judge_generations", "rate", "rows", "fields"]

METRICS = {"judge_concept": True, "judge_instruction": True, "judge_fluency": True, "judge_score": True}  # higher is better
FAILED = "the judge's log-probabilities of the rating digits are not finite"


@dataclass(frozen=True)
class JudgePlan:
    """The sweep file's judge, checked: its model_args, concept and rubric templates."""

    args: dict
    concept: str
    rubric: dict[str, str]


@dataclass(frozen=True)
class Judged:
    """One generation's ratings ({scale: expected rating}, and `score`) and the exact rubric prompts read."""

    ratings: dict[str, float | None]
    prompts: dict[str, str]


def check_judge(spec: SweepFile, base: Path, where: str) -> JudgePlan | None:
    """The file's `judge:` checked before any worker: its config and tokenizer read, the digits in its vocabulary,
    the rubric templates; a generating prompt set to judge."""
    from driver.lm.model_setup import load_tokenizer, model_config, tokenizer_folder

    j = spec.judge
    if j is None:
        return None
    if not any(ps.generate for ps in spec.prompts):
        raise SweepError(f"{where}: judge: no prompt set generates text to judge: add a prompt set with generate: true")
    near = base / Path(j.model).expanduser()
    pretrained = str(near.resolve()) if not Path(j.model).is_absolute() and near.exists() else j.model
    try:
        model_config(pretrained)
        tokenizer = load_tokenizer(tokenizer_folder(pretrained, None), False)
        rubric = load_rubric(None if j.rubric is None else base / Path(j.rubric).expanduser())
    except RubricError as e:
        raise SweepError(one_line(f"{where}: judge.rubric: {e}")) from None
    except (OSError, ValueError) as e:
        raise SweepError(one_line(f"{where}: judge.model: cannot read the judge's config.json or tokenizer ({e})")) from None
    ids = digit_ids(tokenizer)
    if isinstance(ids, str):
        raise SweepError(f"{where}: judge.model: cannot rate 0–2: {ids}; choose a judge whose tokenizer has the digits")
    return JudgePlan({"pretrained": pretrained}, j.concept, rubric)  # `driver run`'s batching: the model block's is the steered model's


def judge_generations(plan: JudgePlan, run_args: dict, items: Sequence[tuple[str, str]], echo: Callable[[str], None] = print) -> tuple[list[Judged], dict]:
    """Each (instruction, generated text) of `items` rated by the judge, opened on the steered model's workers
    (`run_args`: its workers, address, cache, threads, stage); (ratings in order, the judge executor's facts)."""
    from driver.lm.evaluation import open_model

    lm = open_model({**plan.args, **{k: run_args[k] for k in ("workers", "address", "cache", "threads", "stage") if k in run_args}})
    try:
        echo(f"sweep: the judge {Path(plan.args['pretrained']).name} rates {len(items)} generations on {len(SCALES)} scales")
        judged = rate(lm, plan, items)
        info = lm.executor.info()
    finally:
        lm.executor.close()
    return judged, info


def rate(lm, plan: JudgePlan, items: Sequence[tuple[str, str]]) -> list[Judged]:
    """The ratings of every (instruction, text) on an open judge model (an OrchardLM): three one-token
    loglikelihood requests per distinct rubric prompt, in one executor run."""
    digits = digit_ids(lm.tokenizer)
    texts: dict[str, int] = {}  # each distinct rubric prompt once
    prompts = [{s: judge_prompt(lm.tokenizer, plan.rubric[s], concept=plan.concept, instruction=i, sentence=t) for s in SCALES} for i, t in items]
    for p in prompts:
        for text in p.values():
            texts.setdefault(text, len(texts))
    contexts = [tuple(lm.tok_encode(text)) for text in texts]
    _warn_long(contexts, lm.max_length)
    requests = [(ctx, (d,)) for ctx in contexts for d in digits]
    answers = lm.executor.run(lm.job("loglikelihood"), requests) if requests else []
    rated = [rating([answers[3 * n + k][0] for k in range(3)]) for n in range(len(contexts))]
    out = []
    for p in prompts:
        ratings = {s: rated[texts[p[s]]] for s in SCALES}
        out.append(Judged({**ratings, "score": score(ratings)}, p))
    return out


def _warn_long(contexts: Sequence[tuple], window: int) -> None:
    long = sum(1 for ctx in contexts if len(ctx) > window)
    if long:
        print(f"warning: the judge: {long} of {len(contexts)} rubric prompts are longer than its context window ({window} tokens) "
              "and are left-truncated (their rubric's start is cut): use a judge with a longer window, shorter generations "
              "(max_gen_toks) or a shorter rubric", file=sys.stderr)  # fmt: skip


def rows(judged: Sequence[Judged | None], failed: str | None = None) -> list[tuple]:
    """(metric, value, stderr, n, error) of one configuration's judged generations on one prompt set (over every
    prompt and seed); `failed`: why it has none."""
    if failed or not judged:
        return [(m, None, None, 0, failed or EMPTY) for m in METRICS]
    out = []
    for metric in METRICS:
        values = [j.ratings[metric.removeprefix("judge_")] for j in judged]
        ok = all(finite(v) for v in values)
        out.append((metric, *(mean_stderr(values) if ok else (None, None)), len(values), None if ok else FAILED))
    return out


def fields(judged: Judged | None) -> dict[str, Any]:
    """A generation record's `judge` ({concept, instruction, fluency, score}) and `judge_prompts` (the texts read)."""
    if judged is None:
        return {}
    return {"judge": dict(judged.ratings), "judge_prompts": dict(judged.prompts)}
