"""Per-sample records (samples.jsonl): one per (configuration, source, sample), for a prompt set's targets and for
each document lm-eval scored, and the per-sample values of every metric they and the generations hold.

A record: the configuration's fields (config, vector, layer, site, head, op, positions, alpha, threshold), `source`
(the prompt set's name or the task), `sample` (the prompt's line number, or lm-eval's doc_id), `split` (set by
driver.evidence.selection), `input` (the text the model saw, before tokenization) and the sample's metrics; a
non-finite number is None."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from driver.evidence.stats import finite, sigmoid

__all__ = ["BASELINE", "prompt_records", "task_records", "p_gold", "values", "metrics_of", "GENERATION_METRICS"]

BASELINE = "baseline"  # the unsteered configuration's id (every sweep's first)
GENERATION_METRICS = ("fluency_logprob", "repetition_rate")  # per generation (generations.jsonl), besides a judge's
JUDGE = ("concept", "instruction", "fluency", "score")  # a judged generation's `judge` ratings: metric judge_<name>
_NOT_METRICS = frozenset(("config", "vector", "layer", "site", "head", "op", "positions", "alpha", "threshold", "source",
                          "sample", "split", "input", "seed"))  # fmt: skip


def _number(x) -> float | None:
    return float(x) if finite(x) else None


def prompt_records(fields: dict, source: str, prompts: Sequence, logprobs: dict[tuple[int, str], float]) -> list[dict]:
    """One record per prompt with targets: `logprob_<target>` per target and, with positive and negative targets,
    `logprob_diff` (positive − negative) and `p_positive` (sigmoid of it); `logprobs[(i, target)]`: the target
    scores (summed or per-token mean, as the prompt set asks), as the rows' means are taken over."""
    out = []
    for i, p in enumerate(prompts):
        if not p.targets:
            continue
        record = {**fields, "source": source, "sample": p.line, "split": None, "input": p.text}
        record |= {f"logprob_{t}": _number(logprobs[(i, t)]) for t in p.targets}
        pos, neg = record.get("logprob_positive"), record.get("logprob_negative")
        if "positive" in p.targets and "negative" in p.targets:
            diff = None if pos is None or neg is None else pos - neg
            record |= {"logprob_diff": diff, "p_positive": None if diff is None else sigmoid(diff)}
        out.append(record)
    return out


def _gold(target, continuations: Sequence[str]) -> list[int] | None:
    """The gold choices' indices, as lm-eval's multiple choice reads its target: an index, a list of them, or a
    choice's text (matched to the continuations, which are the choices after the target delimiter)."""
    if isinstance(target, bool):
        return None
    if isinstance(target, int):
        return [target] if 0 <= target < len(continuations) else None
    if isinstance(target, str):
        found = [i for i, c in enumerate(continuations) if c == target or c.strip() == target.strip()]
        return found[:1] or None
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, int) and 0 <= t < len(continuations) for t in target):
        return list(target)
    return None


def p_gold(sample: dict) -> float | None:
    """A multiple-choice document's gold probability normalized over its choices: softmax of the choices'
    log-likelihoods (lm-eval's filtered responses, the unconditional ones of acc_mutual_info left out), summed over
    the gold choices; None when the target names no choice or a log-likelihood is not finite."""
    lls = [float(r[0]) for r in sample["filtered_resps"]]
    n = len(lls) // 2 if "acc_mutual_info" in sample.get("metrics", ()) else len(lls)
    lls = lls[:n]
    gold = _gold(sample.get("target"), [a[1] for a in sample["arguments"][:n]])
    if gold is None or not all(math.isfinite(x) for x in lls):
        return None
    a = np.asarray(lls)
    p = np.exp(a - a.max())
    return float(p[gold].sum() / p.sum())


def _label(metric: str, filt: str) -> str:
    return metric if filt == "none" else f"{metric},{filt}"  # as driver.sweep.rows.lm_eval_rows names it


def _doc_metrics(sample: dict) -> dict:
    """A document's own metrics (lm-eval's per-document values, a pair such as perplexity's (log-likelihood,
    weight) as a list)."""
    out = {}
    for name in sample.get("metrics", ()):
        v = sample.get(name)
        if isinstance(v, (tuple, list)):
            out[_label(name, sample["filter"])] = [_number(x) if isinstance(x, (int, float)) else x for x in v]
        elif isinstance(v, (int, float)):
            out[_label(name, sample["filter"])] = _number(v)
    return out


def task_records(fields: dict, results: dict | None) -> list[dict]:
    """One record per (task, document) of lm-eval's logged samples (results["samples"], log_samples), its metrics
    from every filter, and `p_gold` for multiple choice."""
    out = []
    configs = (results or {}).get("configs", {})
    for task, samples in ((results or {}).get("samples") or {}).items():
        mc = (configs.get(task) or {}).get("output_type") == "multiple_choice"
        docs: dict[int, dict] = {}
        for s in samples:
            args = s["arguments"][0] if s["arguments"] else ()
            record = docs.setdefault(s["doc_id"], {**fields, "source": task, "sample": s["doc_id"], "split": None,
                                                   "input": args[0] if args and isinstance(args[0], str) else None})  # fmt: skip
            record |= _doc_metrics(s)
            if mc and s.get("filter", "none") == "none":
                record["p_gold"] = p_gold(s)
        out += [docs[d] for d in sorted(docs)]
    return out


def metrics_of(record: dict) -> list[str]:
    """The keys of a record that are its metrics (every key but the configuration's and the sample's fields)."""
    return [k for k in record if k not in _NOT_METRICS and not k.startswith("_")]


def _generation_metrics(g: dict) -> dict:
    out = {m: g.get(m) for m in GENERATION_METRICS}
    judge = g.get("judge")
    if isinstance(judge, dict):
        out |= {f"judge_{k}": judge.get(k) for k in JUDGE}
    return out


def values(records: Iterable[dict], generations: Iterable[dict] = ()) -> dict[tuple[str, str], dict[str, dict]]:
    """{(source, metric): {config: {(sample, seed): value}}}: every finite scalar per-sample value, the generations'
    (prompt_set, line, seed) too, for pairing each configuration's samples with the baseline's."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in records:
        for m in metrics_of(r):
            if finite(r[m]):
                out.setdefault((r["source"], m), {}).setdefault(r["config"], {})[(r["sample"], None)] = float(r[m])
    for g in generations:
        for m, v in _generation_metrics(g).items():
            if finite(v):
                out.setdefault((g["prompt_set"], m), {}).setdefault(g["config"], {})[(g["line"], g.get("seed"))] = float(v)
    return out
