"""One lm-eval evaluation on an open `mlx-ray` model: open it, evaluate, save — the pieces `driver run` and
`driver sweep` share. Errors surface as one-line `click.ClickException`s."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from driver.checks.datasets import dataset_hint  # lm-eval's late dataset errors say what would fix them (re-exported)
from driver.checks.files import write_atomic

DATASET_HINT = dataset_hint()  # the generic words (kept for callers that know no error yet)


def parse_seeds(value: str) -> dict[str, int | None]:
    """lm-eval's --seed: one integer for all four seeds, or four comma-separated values (None keeps one unset)."""
    parts = [p.strip() for p in value.split(",")]
    if len(parts) == 1:
        parts *= 4
    if len(parts) != 4:
        raise click.BadParameter(f"{value!r}: give one integer or four comma-separated ones", param_hint="--seed")
    from driver.checks.settings import integer

    seeds = [None if p == "None" else integer(p) for p in parts]  # ASCII digits only, as every whole number
    if any(s is None for s, p in zip(seeds, parts) if p != "None"):
        raise click.BadParameter(f"{value!r} is not a list of integers in ASCII digits", param_hint="--seed")
    if any(s is not None and not 0 <= s < 2**32 for s in seeds):  # numpy's seed range, which lm-eval seeds with each
        raise click.BadParameter(f"{value!r}: each seed must be in 0..{2**32 - 1}", param_hint="--seed")
    return dict(zip(("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seeds))


def per_worker(info: dict) -> dict[str, dict]:
    """Every worker (group, by name) with the requests it computed and its rate, 0 included; one that computed
    none says why (lost, or idle: the others took every chunk), one lost after computing some says lost."""
    computed, rates, lost = info.get("requests_computed") or {}, info.get("requests_per_s") or {}, set(info.get("lost", []))
    names = list(info.get("names") or []) or sorted(computed)
    out = {}
    for name in names + sorted(set(computed) - set(names)):  # a worker that left the pool still counts what it did
        row = {"requests": computed.get(name, 0), "requests_per_s": rates.get(name, 0.0)}
        if name in lost:
            row["lost"] = True
        if not row["requests"]:
            row["why_none"] = "lost before it finished a chunk" if name in lost else "idle: the other workers took every chunk"
        out[name] = row
    return out


def _summary(info: dict, seconds: float) -> dict:
    return {
        "address": info["address"],
        "workers": info["workers"],
        "workers_alive": info["workers_alive"],
        "nodes": info["nodes"],
        "requests": sum(info["requests_computed"].values()) + info["requests_cached"],
        "requests_cached": info["requests_cached"],
        "per_worker": per_worker(info),
        "scoring_s": info["seconds"],
        "wall_s": round(seconds, 3),
        "cache": info["cache"],
        "worker_facts": info["facts"],
        "prefix_store": info.get("prefix_store", []),  # per worker: hits, tokens reused, peak bytes vs budget, evictions
        **({"groups": info["groups"]} if "groups" in info else {}),  # worker groups: each rank's node, layers, peak memory
    }


def on_workers(facts: dict, ray: bool = False) -> str:
    """'on N workers on M nodes' (`ray`: and Ray's address), or why none ran; `facts`: an executor's info() or a
    summary made from it."""
    if not facts["workers"]:
        return "on no workers (every result came from the cache)"
    where = f" (Ray at {facts['address']})" if ray else ""
    workers, nodes, groups = facts["workers"], facts["nodes"], facts.get("groups")
    what = f"group{'s' * (workers != 1)} of {len(groups[0]['ranks'])}" if groups else f"worker{'s' * (workers != 1)}"
    return f"on {workers} {what} on {nodes} node{'s' * (nodes != 1)}{where}"


def _print_summary(summary: dict) -> None:
    click.echo(
        f"\n{summary['requests']} requests ({summary['requests_cached']} from cache) {on_workers(summary, ray=True)} "
        f"in {summary['wall_s']:.1f} s"
    )
    for name, row in summary["per_worker"].items():
        why = f"  ({row['why_none']})" if "why_none" in row else "  (lost)" if row.get("lost") else ""
        click.echo(f"  {name:<24} {row['requests']:>8} requests {row['requests_per_s']:>10.1f} req/s{why}")
    if any(s["peak_bytes"] for s in summary["prefix_store"]):  # only when generation stored prefixes: else noise
        click.echo(prefix_store_line(summary["prefix_store"]))


def prefix_store_line(stores: list[dict]) -> str:
    """The workers' prefix KV stores in one line: hits, tokens reused, the highest peak against the budget, evictions."""
    total = {k: sum(s[k] for s in stores) for k in ("hits", "extended", "tokens_reused", "evicted")}
    peak, budget = max(s["peak_bytes"] for s in stores), stores[0]["budget"]
    return (f"  prefix KV store: {total['hits']} hits, {total['extended']} extended, {total['tokens_reused']} tokens reused, "
            f"peak {peak / 2**20:.1f} of {budget / 2**20:.0f} MiB per worker, {total['evicted']} evicted")


@dataclass
class Plan:
    """How lm-eval runs the tasks: everything `simple_evaluate` takes besides the model."""

    seeds: dict[str, int | None]
    limit: float | int | None = None
    num_fewshot: int | None = None
    batch_size: str = "32"
    log_samples: bool = False
    apply_chat_template: bool = False
    gen_kwargs: str | dict | None = None  # the CLI passes settings.gen_kwargs (checked, typed)
    manager: Any = None
    names: list[str] = field(default_factory=list)
    system_instruction: str | None = None  # before every context (a sweep's prompting baseline, driver.judge.prompting)


def open_model(args: dict[str, Any]):
    """The `mlx-ray` lm-eval model, workers started; bad settings and cluster problems as one-line errors."""
    from cluster import ClusterError

    from driver.lm.quiet import phase

    try:  # seconds (MLX and mlx-lm imported, the files hashed): until the next phase line, Ray's
        with phase(f"opening {args['pretrained']} on this machine (MLX, its tokenizer and its files' fingerprints)"):
            from driver.lm.mlx_ray import MLXRayLM

            return MLXRayLM.create_from_arg_obj(args)
    except ValueError as e:  # ModelLoadError, SteeringError, bad model_args
        raise click.ClickException(str(e).strip().splitlines()[0]) from None
    except ClusterError as e:
        raise click.ClickException(str(e)) from None


@dataclass
class Evaluation:
    results: dict  # what simple_evaluate returned
    info: dict  # the executor's facts: workers, requests per worker, seconds
    tracker: Any  # lm-eval's EvaluationTracker, which knows where and how to write the results
    steered: str | None = None  # the line naming the run's steering, printed above its table


def results_name(model: str, steering: dict | None = None) -> str:
    """The results folder's name under the output path, one rule for every command: a local model folder by its
    path from here when it lies below this folder (else its own name), a Hub id as lm-eval writes it (`/` -> `__`);
    a steered run's carries `+steer-` and its steering key, so it never shares the unsteered run's folder."""
    path = Path(model).expanduser()
    if path.exists():
        try:
            below = path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            below = Path()
        model = str(below) if below.parts else path.resolve().name  # not below here, or here itself: its own name
    name = "__".join(part for part in model.replace("\\", "/").split("/") if part not in ("", "."))
    return name + (f"+steer-{steering['key'][:12]}" if steering else "")


def condition_text(gate) -> str:
    """'cos>0.1 at L2' (CAST's similarity against its threshold), joined by 'or' / 'and'."""
    sign = {"greater": ">", "smaller": "<"}
    parts = [f"cos{sign[c.compare]}{c.threshold:g} at L{','.join(map(str, c.layers))}" + (" (last)" if c.pool == "last" else "")
             for c in gate.conditions]  # fmt: skip
    return f" {'or' if gate.rule == 'any' else 'and'} ".join(parts)


def steered_line(lm) -> str | None:
    """'steered by SPEC (key ...): L3 resid_post add α=4, ...' for a steered model; None for an unsteered one."""
    record = lm.steering_record
    if not record:
        return None
    parts = [f"L{i.layer} {i.site}{'' if i.head is None else f'.{i.head}'} {i.op}"
             + ("" if i.op == "ablate" else f" α={i.alpha:g}") + ("" if i.positions == "all" else f" ({i.positions})")
             + (f" if {condition_text(i.condition)}" if i.condition else "") for i in lm.steering.interventions]  # fmt: skip
    source = record.get("source") or "an inline spec"
    return f"steered by {source} (key {record['key'][:12]}): {', '.join(parts)}"


def evaluate(lm, model_args: dict[str, Any], plan: Plan, output_path: str) -> Evaluation:
    """lm-eval's `simple_evaluate` on an open model (a sweep calls this once per steering configuration)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from cluster import ClusterError
    from worker.load import ModelLoadError

    from driver.lm.finite import NonFiniteScore
    from driver.lm.quiet import quiet_lm_eval

    quiet_lm_eval()
    # HF's sampling draws from torch's generator, which lm-eval seeds with torch_random_seed: ours takes that seed
    lm.sampling_seed = plan.seeds.get("torch_random_seed")
    tracker = EvaluationTracker(output_path=output_path)
    lm.fire_counts.clear()
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=plan.names,
            num_fewshot=plan.num_fewshot,
            batch_size=plan.batch_size,
            limit=plan.limit,
            log_samples=plan.log_samples,
            evaluation_tracker=tracker,
            apply_chat_template=plan.apply_chat_template,
            system_instruction=plan.system_instruction,
            gen_kwargs=plan.gen_kwargs,
            task_manager=plan.manager,
            verbosity="WARNING",
            **plan.seeds,
        )
    except ClusterError as e:
        raise click.ClickException(lost_workers_line(str(e), lm)) from None
    except (ModelLoadError, NonFiniteScore) as e:  # a worker cannot load the model; a NaN/inf log-likelihood
        raise click.ClickException(str(e)) from None
    except ConnectionError as e:  # `datasets` cannot fetch a task's data (offline, or the Hub unreachable)
        raise click.ClickException(f"a task's dataset cannot be loaded: {e}: {dataset_hint(e)}") from None
    results["config"]["model"] = "mlx-ray"
    if lm.steering and lm.steering.conditional:  # how many rows the condition steered, per task (table and JSON)
        lm.fire_counts.into(results)
    tracker.general_config_tracker.model_name_sanitized = results_name(str(model_args["pretrained"]), lm.steering_record)
    return Evaluation(results, lm.executor.info(), tracker, steered_line(lm))


def lost_workers_line(message: str, lm) -> str:
    """'every worker is lost' + which worker died where and why (Ray's actor table), while Ray is still up."""
    lost = "every worker is lost"
    if lost not in message:
        return message
    try:
        from cluster.failures import lost_workers

        why = lost_workers(lm.executor.actors)
    except Exception:  # the explanation is a courtesy: never hide the error itself
        why = ""
    return message.replace(lost, f"{lost} ({why})", 1) if why else message


def save(done: Evaluation, output_path: str, seconds: float) -> Path:
    """Write lm-eval's results JSON (and samples) and Orchard's summary; print the tables. Returns the folder."""
    from lm_eval.utils import handle_non_serializable, make_table

    results, tracker = dict(done.results), done.tracker
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])
    summary = _summary(done.info, seconds)
    folder = Path(output_path) / tracker.general_config_tracker.model_name_sanitized
    write_atomic(folder / f"summary_{tracker.date_id}.json", json.dumps(summary, indent=2, default=handle_non_serializable))
    if done.steered:  # the table below is the steered model's: say so above it
        click.echo(done.steered)
    click.echo(make_table(results))
    if "groups" in results:
        click.echo(make_table(results, "groups"))
    _print_summary(summary)
    click.echo(f"results: {folder}")
    return folder
