"""The run of a checked sweep on one `mlx-ray` model, and its outcome (the rows the report is written from).

How a sweep runs (`run`): everything in the file is checked first (`driver.sweep.plan.load_sweep`: the schema,
the model's shape, every vector, the tasks, the prompt set), before any worker starts or any output is written.
Then one `mlx-ray` model is opened (the model loads once per worker) with its result cache under the output folder:

1. lm-eval runs once, unsteered (the baseline); the token-level requests it sends are recorded.
2. The executor's `run_grid` computes every (configuration, request) cell of those requests and of the prompt
   set's requests (target log-probabilities, generations) in one chunked dispatch per request kind, each cell
   cached as it arrives under the key a per-configuration `run` uses: a rerun computes only what is missing.
3. lm-eval runs once per configuration with that steering, its requests answered from step 2, for lm-eval's
   own metrics (driver.sweep.replay).
4. The unsteered model scores every configuration's generations (driver.sweep.fluency), through the same grid.

A configuration whose scores are non-finite is set aside (driver.sweep.grid) and recorded as failed cells
(driver.sweep.rows), never as numbers. `driver.sweep.report` writes the outcome into the output folder.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.spec import Grouping

from driver.checks.groups import tell
from driver.judge import prompting
from driver.judge import rate as judging
from driver.judge.schema import sample_seeds
from driver.evidence.records import prompt_records, task_records
from driver.sweep import fluency
from driver.sweep.grid import run_grids
from driver.sweep.configs import measure_features
from driver.sweep.plan import BASELINE, Sweep, choose_top
from driver.sweep.replay import Recorder, lm_eval_per_config, swapped_executor
from driver.sweep.rows import (FIRED, PROMPT_HIGHER, add_deltas, count_long, fired_rows, lm_eval_failure, lm_eval_rows, prompt_rows, truncated,
                               unequal_lengths)  # fmt: skip
from driver.sweep.rows import score as target_score

__all__ = ["Outcome", "run"]


@dataclass
class Outcome:
    """What a sweep produced, for `driver.sweep.report`."""

    sweep: Sweep
    rows: list[dict]  # tidy: one per configuration × metric
    generations: list[dict]
    lm_eval: dict[str, dict]  # configuration id -> lm-eval's results (without samples)
    info: dict  # the executor's facts
    seconds: float
    higher_is_better: dict[tuple[str, str], bool | None]
    samples: list[dict] = field(default_factory=list)  # per-sample records (driver.evidence.records)


def _encode_target(lm, context: str, continuation: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """lm-eval's tokenization of a (context, continuation) pair (TemplateLM.loglikelihood)."""
    ctx, cont = lm._encode_pair(context, continuation)
    return tuple(ctx), tuple(cont)


def _prompt_requests(lm, sweep: Sweep, text: str | None = None) -> tuple[list, list, list, list]:
    """The prompt sets' requests: (targets [(set, prompt index, target, tokens)], their token pairs, gens [(set,
    prompt index, seed)], their generation requests: one per prompt and seed), with one warning per set for unequal
    targets and truncation; `text`: a prompting baseline's, before every prompt (driver.judge.prompting; no warnings)."""
    targets, pairs, gens, gen_requests = [], [], [], []
    for name, (ps, prompts) in sweep.prompt_sets.items():
        lengths, long_prompts, first = [], 0, len(pairs)
        for i, p in enumerate(prompts):
            seen = p.text if text is None else prompting.prefixed(lm.tokenizer, text, p.text)
            lengths.append({})
            for t, continuation in p.targets.items():
                pairs.append(_encode_target(lm, seen, continuation))
                targets.append((name, i, t, len(pairs[-1][1])))
                lengths[-1][t] = (continuation, len(pairs[-1][1]))
            if ps.generate:
                gen_kwargs = {"until": list(ps.until), "max_gen_toks": ps.max_gen_toks, "temperature": ps.temperature,
                              "do_sample": ps.temperature > 0}  # fmt: skip
                for seed in sample_seeds(ps):  # greedy: one text (None), drawn as `seed` always was
                    gens.append((name, i, seed))
                    gen_requests.append(lm.generation_request(seen, gen_kwargs, ps.seed if seed is None else seed))
                long_prompts += len(gen_requests[-1].context) < len(lm.tok_encode(seen))
        if text is None:
            unequal_lengths(name, lengths, ps.target_score)
            truncated(name, count_long(pairs[first:], lm.max_length), long_prompts, len(prompts), lm.max_length)
    return targets, pairs, gens, gen_requests


def run(sweep: Sweep, *, workers: str = "all", address: str | None = None, output: Path, cache: str | None = None,
        threads: int | None = None, stage: bool = False, grouping: Grouping | None = None, notes: Sequence[str] = (),
        echo=print) -> Outcome:  # fmt: skip
    """Run a checked sweep on one `mlx-ray` model; returns the rows (nothing is written here but the cache
    and lm-eval's results JSON per configuration). `grouping`: the worker groups, resolved (default: the file's
    model.group_size and model.split, resolved when the model opens); `notes`: lines for stderr once it opens."""
    from driver.lm.evaluation import evaluate, open_model

    start = time.monotonic()
    args = {**sweep.model_args, "workers": workers, "cache": cache or str(output / "cache"), "stage": stage}
    model = sweep.spec.model
    size, split = (grouping.size, grouping.split) if grouping else (model.group_size, model.split)
    args |= {"group_size": size, "split": split}
    for name, value in (("address", address), ("threads", threads)):
        if value is not None:
            args[name] = value
    lm = open_model(args)
    tell(notes)  # what auto chose: said once the workers start, so a refusal stays one line
    try:
        if sweep.tops:  # `top: K`: the features each SAE ranks highest on its prompts, captured on the workers
            choose_top(sweep, lm, echo)
        configs, steerings = sweep.configs, [c.steering for c in sweep.configs]
        placed = lm.executor.info()["workers"]  # none yet when the cache holds this model's results
        n, k = len(sweep.grid), len(sweep.prompting)
        said = f"sweep: {n} configuration{'s' * (n != 1)} + the baseline" + (f" + {k} prompting baseline{'s' * (k != 1)}" if k else "")
        echo(said + (f" on {placed} worker{'s' * (placed != 1)}" if placed else ""))
        # 1. lm-eval, unsteered: the baseline's metrics, and the requests every configuration sends
        calls: list = []
        results: dict[str, dict] = {}
        if sweep.plan is not None:
            recorder = Recorder(lm.executor)
            with swapped_executor(lm, recorder):
                results[BASELINE] = evaluate(lm, args, sweep.plan, str(output)).results
            calls = recorder.calls
        # 2. every (configuration, request) cell, one dispatch per request kind
        wanted: dict[str, list] = {"loglikelihood": [], "generate": []}
        for kind, requests in calls:
            wanted[kind].extend(requests)
        targets, target_pairs, gens, gen_requests = _prompt_requests(lm, sweep)
        wanted["loglikelihood"] += target_pairs
        wanted["generate"] += gen_requests
        steering = steerings[: len(configs) - len(sweep.prompting)]  # the prompting baselines (last) are not grid cells
        answers, failed, fired = run_grids(lm.executor, steering, wanted, echo)  # a non-finite configuration is set aside
        if sweep.prompting:
            prompted = [_prompt_requests(lm, sweep, c.text)[1::2] for c in sweep.prompting]  # (target pairs, generations) each
            counts = {kind: sum(len(r) for k, r in calls if k == kind) for kind in wanted}
            prompting.answer(lm.executor, prompted, answers, failed, counts, len(steering), echo)
        measured = measure_features(sweep, lm, echo)  # an SAE feature's activation under its configuration, on its prompts
        # 3. lm-eval per configuration, answered from the grid
        if sweep.plan is not None:
            lm_eval_per_config(lm, args, sweep, calls, answers, results, output, echo, failed)
        # 4. the unsteered model's log-likelihood of every configuration's generations (their fluency)
        texts = _texts(sweep, configs, answers, gens, calls)
        scores = fluency.baseline_scores(lm.executor, lambda p, t: _encode_target(lm, p, t), [x for ts in texts for x in ts])
        info = lm.executor.info()
    finally:
        lm.executor.close()
    judged = _judged(sweep, args, texts, gens, failed, info, echo)  # the judge, on the workers the model left
    generated = (texts, scores, failed, fired, measured, judged, _inputs(lm, sweep))
    return _outcome(sweep, results, answers, targets, gens, calls, generated, info, time.monotonic() - start)


def _inputs(lm, sweep) -> dict[str, dict[str, list]]:
    """{prompting baseline: {prompt set: its prompts as that baseline shows them}} (its text before each)."""
    return {c.id: {name: [dataclasses.replace(p, text=prompting.prefixed(lm.tokenizer, c.text, p.text)) for p in prompts]
                   for name, (_, prompts) in sweep.prompt_sets.items()} for c in sweep.prompting}  # fmt: skip


def _judged(sweep, args, texts, gens, failed, info, echo) -> dict[tuple[int, int], judging.Judged]:
    """{(configuration, generation): its ratings} by the file's judge (none without one, nor for a failed
    configuration); the judge's executor facts go into `info` ("judge")."""
    if sweep.judge is None or not gens:
        return {}
    cells = [(c, j) for c in range(len(texts)) if c not in failed for j in range(len(gens))]
    rated, info["judge"] = judging.judge_generations(sweep.judge, args, [texts[c][j] for c, j in cells], echo)
    return dict(zip(cells, rated))


def _texts(sweep, configs, answers, gens, calls) -> list[list[tuple[str, str]]]:
    """[configuration][generation] (prompt, generated text) of the prompt sets."""
    skip = sum(len(r) for k, r in calls if k == "generate")
    return [[(sweep.prompt_sets[s][1][i].text, answers["generate"][c][skip + j]) for j, (s, i, _) in enumerate(gens)]
            for c in range(len(configs))]  # fmt: skip


def _outcome(sweep, results, answers, targets, gens, calls, generated, info, seconds) -> Outcome:
    texts, scores, failed, fired, measured, judged, inputs = generated
    rows, generations, better, samples = [], [], {}, []
    n_task_ll = sum(len(r) for k, r in calls if k == "loglikelihood")
    for c, config in enumerate(sweep.configs):
        if sweep.plan is not None:
            own = n_task_ll and config.op != prompting.PROMPT  # a prompting baseline's lm-eval requests are its own run's
            why = (lm_eval_failure(answers["loglikelihood"][c][:n_task_ll]) if own else None) or failed.get(c)
            found, hib = lm_eval_rows(results.get(config.id, results[BASELINE]), why)  # failed: the baseline's metrics
            found += fired_rows((results.get(config.id) or {}).get("orchard_fired", {}))
            better.update({(t, m): None for t, m, *_ in found if m == FIRED})
            better.update(hib)
            rows += [{**config.fields, "task": t, "metric": m, "value": v, "stderr": s, "n": n, "error": e} for t, m, v, s, n, e in found]
            samples += task_records(config.fields, results.get(config.id) if not why else None)  # lm-eval's per-document values
        rows += [{**config.fields, **row} for row in measured.get(c, [])]
        for name, (ps, prompts) in sweep.prompt_sets.items():
            logprobs = {(i, t): target_score(float(answers["loglikelihood"][c][n_task_ll + j][0]), k, ps.target_score or "sum")
                        for j, (s, i, t, k) in enumerate(targets) if s == name}  # fmt: skip
            seen = inputs.get(config.id, {}).get(name, prompts)  # the prompts as this configuration's model read them
            samples += prompt_records(config.fields, name, seen, logprobs)
            mine = [j for j, (s, *_) in enumerate(gens) if s == name]
            found = prompt_rows(prompts, logprobs, ps.file) + (fluency.rows([texts[c][j] for j in mine], scores, failed.get(c)) if mine else [])
            found += judging.rows([judged.get((c, j)) for j in mine], failed.get(c)) if mine and sweep.judge else []
            found += _fired_in_set(fired.get(c), name, targets, gens, n_task_ll, calls)
            for metric, value, stderr, n, error in found:
                rows.append({**config.fields, "task": name, "metric": metric, "value": value, "stderr": stderr, "n": n, "error": error})
                better[(name, metric)] = {**PROMPT_HIGHER, **fluency.METRICS}.get(metric, True)
            for j in mine:
                i, seed = gens[j][1:]
                generations.append({**config.fields, "prompt_set": name, "index": i, "line": prompts[i].line, "seed": seed,
                                    "prompt": prompts[i].text, "input": seen[i].text, "text": texts[c][j][1],
                                    "fluency_logprob": scores.get(texts[c][j]),
                                    "repetition_rate": fluency.repetition_rate(texts[c][j][1]), "error": failed.get(c),
                                    **judging.fields(judged.get((c, j)))})  # fmt: skip
    add_deltas(rows)
    fluency.mark(rows, generations)
    lm_eval_results = {k: {key: v for key, v in r.items() if key != "samples"} for k, r in results.items()}
    return Outcome(sweep, rows, generations, lm_eval_results, info, seconds, better, samples)


def _fired_in_set(flags: dict | None, name: str, targets, gens, n_task_ll: int, calls) -> list[tuple]:
    """A conditional configuration's `fired` row on prompt set `name`: its target and generation rows that fired."""
    if flags is None:
        return []
    skip = sum(len(r) for k, r in calls if k == "generate")
    mine = [flags["loglikelihood"][n_task_ll + j] for j, t in enumerate(targets) if t[0] == name]
    mine += [flags["generate"][skip + j] for j, g in enumerate(gens) if g[0] == name and "generate" in flags]
    return [row[1:] for row in fired_rows({name: {"fired": sum(mine), "rows": len(mine)}})] if mine else []
