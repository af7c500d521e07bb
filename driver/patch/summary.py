"""summary.md of a patch run: the effect, the top components by |recovered|, what the top 5 recover, the run."""

from __future__ import annotations

from collections.abc import Sequence

from driver.patch.rows import of_metric
from driver.sweep.rows import mean_stderr

TOP = 10


def _where(r: dict, labels: Sequence[str]) -> str:
    if r["head"] is not None:
        return f"head {r['head']}"
    token = labels[r["position"]] if r["position"] < len(labels) else ""
    return f"position {r['position']} `{token}`"


def _pm(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")


def _top(rows: Sequence[dict], method: str, labels: Sequence[str]) -> list[str]:
    mine = sorted((r for r in of_metric(rows, "recovered", method=method) if r["value"] is not None), key=lambda r: -abs(r["value"]))
    ld = {(r["site"], r["layer"], r["position"], r["head"]): r for r in of_metric(rows, "logit_diff", method=method)}
    out = [f"### {method}", "", "| rank | site | layer | where | recovered | logit_diff |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(mine[:TOP], 1):
        d = ld[(r["site"], r["layer"], r["position"], r["head"])]
        out.append(f"| {i} | {r['site']} | {r['layer']} | {_where(r, labels)} | {_pm(r['value'], r['stderr'])} | {_pm(d['value'], d['stderr'])} |")
    return out + [""]


def _top5(rows: Sequence[dict], methods: Sequence[str], sites: Sequence[str]) -> list[str]:
    out = ["| method | site | best cell | top 5 together |", "|---|---|---|---|"]
    for method in methods:
        for site in sites:
            values = sorted((r["value"] for r in of_metric(rows, "recovered", method, site) if r["value"] is not None), key=abs, reverse=True)
            if values:
                out.append(f"| {method} | {site} | {values[0]:.3f} | {sum(values[:5]):.3f} |")
    return out


def summary_md(outcome, rows: Sequence[dict], facts: dict) -> str:
    p = outcome.patch
    clean, corrupt = (mean_stderr([ld[i] for ld in outcome.lds]) for i in (0, 1))
    methods, sites = list(p.spec.method), list(p.spec.sites)
    lines = [f"# Activation patching: {p.path.name}", "",
             f"Model `{p.model_args['pretrained']}`, {len(p.pairs)} pairs from `{p.pairs_file.name}`, {len(p.cells)} cells "
             f"(sites {', '.join(sites)}; methods {', '.join(methods)}).", "",
             f"Logit difference (correct − wrong, last position), mean over pairs: clean {_pm(*clean)}, corrupt {_pm(*corrupt)}.",
             "`recovered` = (patched − corrupt) / (clean − corrupt): 1 is the whole clean behaviour back, 0 none.", "",
             f"## Top {TOP} components by |recovered|", ""]  # fmt: skip
    for method in methods:
        lines += _top(rows, method, p.labels)
    lines += ["## What the top 5 recover", "",
              "Per site: the best cell's mean `recovered` and the top 5 cells' (by |recovered|) summed. Cells of one site "
              "overlap (a residual-stream cell carries everything computed below it), so a sum can pass 1.", ""]  # fmt: skip
    lines += _top5(rows, methods, sites) + ["", "## Run", ""] + _run_lines(outcome, facts)
    return "\n".join(lines) + "\n"


def _run_lines(outcome, facts: dict) -> list[str]:
    computed, total = outcome.grid_computed, len(outcome.patch.cells) * len(outcome.patch.pairs)
    rate = computed / outcome.grid_seconds if outcome.grid_seconds > 0 and computed else 0.0
    workers = facts.get("workers")
    said = "1 (in process)" if workers is None else f"{workers} ({', '.join(facts['per_worker'])})" if workers else "none (every cell from the cache)"
    return [f"- workers: {said}",
            f"- cells: {total} (pair × cell requests), {computed} computed, {total - computed} from the cache",
            f"- cells/s: {rate:.1f} (the grid's {outcome.grid_seconds:.1f} s)", f"- wall: {outcome.seconds:.1f} s"]  # fmt: skip
