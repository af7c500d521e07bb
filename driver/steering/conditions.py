"""CAST conditions as written in a steering spec (`condition:` on an intervention) turned into `worker.spec.Gate`s:
each condition's vector read as an intervention's vector is (a .npy, {file, key}, an SAE feature; its default
safetensors key `resid_pre.L` of its first layer: the condition reads that layer's input), checked finite."""

from __future__ import annotations

from pathlib import Path

from worker.spec import Condition, Gate

from driver.steering.schema import AllOf, AnyOf, ConditionSpec, InterventionSpec


def conditions_of(iv: InterventionSpec) -> tuple[tuple[ConditionSpec, ...], str]:
    """(the conditions as written, how they combine)."""
    c = iv.condition
    if isinstance(c, AnyOf):
        return c.any, "any"
    if isinstance(c, AllOf):
        return c.all, "all"
    return (c,), "any"


def load_gate(iv: InterventionSpec, field: str, load_vector, base: Path, where: str, memo: dict) -> tuple[Gate | None, list[dict]]:
    """The intervention's Gate (None without a condition) and a record entry per condition vector. `load_vector` is
    driver.steering.spec's `_load_vector` (an intervention's vector loader), handed in to keep one loader."""
    if iv.condition is None:
        return None, []
    written, rule = conditions_of(iv)
    conditions, records = [], []
    for k, c in enumerate(written):
        name = f"{field}.condition" + (f".{rule}[{k}]" if not isinstance(iv.condition, ConditionSpec) else "")
        # read as a clamp's vector at the condition's first layer input: a direction (all zeros refused), resid_pre.L's key
        proxy = InterventionSpec(layer=c.layers[0], site="resid_pre", op="clamp", vector=c.vector)
        vector, record = load_vector(proxy, f"{name}.vector", base, where, memo)
        conditions.append(Condition(vector=tuple(vector.tolist()), layers=c.layers, threshold=c.threshold, compare=c.compare, pool=c.pool))
        records.append(record)
    return Gate(conditions=tuple(conditions), rule=rule), records


class FireCounts(dict):
    """{task: [rows fired, rows]} of conditional steering over one evaluation: the workers' results of a conditional
    job end with whether the row fired (worker.jobs); `take` strips that flag and counts it per lm-eval task."""

    def take(self, kind: str, requests, results: list, steering, owners: list[int] | None = None) -> list:
        """`results` as lm-eval wants them; `owners[j]`: which of `requests` result j belongs to (rolling windows:
        a document fired when any of its windows did). Unconditional steering: `results` as they are."""
        if not (steering and steering.conditional):
            return results
        owners = owners if owners is not None else list(range(len(results)))
        fired = [False] * len(requests)
        for n, r in zip(owners, results):
            fired[n] = fired[n] or bool(r[-1])
        for request, flag in zip(requests, fired):
            row = self.setdefault(getattr(request, "task_name", None) or "?", [0, 0])
            row[0], row[1] = row[0] + flag, row[1] + 1
        return [tuple(r[:2]) if kind == "loglikelihood" else r[0] for r in results]

    def into(self, results: dict) -> None:
        """Into lm-eval's results: `orchard_fired` {task: {fired, rows, rate}}, and a `fired` row in each task's table."""
        results["orchard_fired"] = {task: {"fired": f, "rows": n, "rate": f / n if n else 0.0} for task, (f, n) in self.items()}
        for task, (f, n) in self.items():
            if task in results.get("results", {}):
                results["results"][task]["fired,none"] = f"{f}/{n} rows"
