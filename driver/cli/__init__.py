"""`driver`: run lm-eval benchmarks over Ray workers, one per Mac (`driver run`), offline demo, cluster nodes.

Heavy imports (lm-eval, Ray, MLX) happen inside the commands, so `--help` is instant.

Every mistake is one line on stderr (a usage error adds one hint line), never a traceback. Exit codes: 2 when
the command line itself is wrong (a flag's value, an unknown key or task name: `preflight.BadUsage`, click's own
errors), 1 when it names something that is not usable or something failed (a file, folder, model, cache,
cluster, worker: `preflight.Refused` and every other error). Everything that can be checked is checked before
the expensive part (lm-eval's task index, Ray, a model load), in `driver.checks.preflight`'s order.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import click

from driver.checks import preflight
from driver.lm import quiet
from driver.checks import settings
from driver.lm.evaluation import Plan, evaluate, lost_workers_line, on_workers, open_model, parse_seeds, save
from driver.checks.preflight import BadUsage, Refused

# model_args keys that have a flag of their own (a flag and a model_arg must never silently disagree)
RUN_FLAGS = {
    "pretrained": "--model", "batch_size": "--batch-size", "max_length": "--max-length", "workers": "--workers",
    "address": "--address", "cache": "--cache", "dashboard": "--dashboard", "threads": "--threads", "steer": "--steer",
    "stage": "--stage",
}  # fmt: skip
VECTORS_FLAGS = {"pretrained": "--model", "workers": "--workers", "address": "--address", "threads": "--threads"}


@contextlib.contextmanager
def _usage():
    """Settings errors are usage errors (exit 2)."""
    try:
        yield
    except settings.SettingError as e:
        raise BadUsage(str(e)) from None


def _limit(value: str | None) -> float | int | None:
    with _usage():
        return settings.limit(value)


def _task_manager(tasks: str, include_path: str | None):
    """(lm-eval's TaskManager, the task names): the quick checks first, then the index (the expensive part)."""
    names = preflight.check_tasks(tasks, include_path)
    return preflight.task_manager(names, include_path), names


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class _OneLineErrors(click.Group):
    """Click's group, but every error is `Error: <one line>` on stderr (a usage error adds one hint line), with
    exit code 2 for usage errors and 1 for the rest; never a traceback (ORCHARD_TRACEBACK=1 shows an
    unexpected one)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        quiet.install()
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            click.echo(f"Error: {_one_line(e.format_message())}", err=True)
            if e.ctx is not None:
                click.echo(f"Try '{e.ctx.command_path} --help' for help.", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"Error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except Exception as e:  # a bug: still one line, unless asked for the traceback
            if os.environ.get("ORCHARD_TRACEBACK"):
                raise
            detail = (str(e).strip().splitlines() or [""])[0]
            click.echo(f"Error: internal error ({type(e).__name__}: {detail}); rerun with ORCHARD_TRACEBACK=1 for the traceback", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Orchard: lm-eval benchmarks across a Ray cluster of Apple-silicon Macs, one MLX model per Mac.

    Each Mac joins the cluster with `ray start --address HEAD:6379 --resources='{"mlx": 1}'`; `driver run`
    places one worker per such node. With no --address (and no RAY_ADDRESS) Ray runs on this machine only.
    """


@main.command()
@click.option("--model", "model", required=True, help="Local model folder or Hugging Face repo id (mlx-lm format).")
@click.option("--tasks", required=True, help="Comma-separated lm-eval task or group names, e.g. mmlu.")
@click.option("--workers", default="all", show_default=True, help="Number of workers (one per `mlx` node), or all.")
@click.option(
    "--address",
    default=None,
    help="Ray cluster: auto (the one running here), HOST:PORT, or local (embedded). Default: $RAY_ADDRESS, else local.",
)
@click.option("--num-fewshot", "--num_fewshot", "num_fewshot", type=int, default=None, help="Few-shot examples per question.")
@click.option("--limit", default=None, help="Documents per task: a count, or a fraction if < 1 (for testing).")
@click.option("--batch-size", "--batch_size", "batch_size", default="32", show_default=True, help="Rows per forward pass on a worker.")
@click.option("--max-length", "--max_length", "max_length", type=int, default=None, help="Context window (default: the model's).")
@click.option(
    "--model-args", "--model_args", "model_args", default="", help="More model settings, e.g. dtype=float16,revision=main."
)
@click.option(
    "--output-path",
    "--output_path",
    "output_path",
    default="orchard-out",
    show_default=True,
    help="Folder for results JSON, samples and the run summary.",
)
@click.option("--log-samples", "--log_samples", "log_samples", is_flag=True, help="Also write every sample's inputs and outputs.")
@click.option("--include-path", "--include_path", "include_path", default=None, help="Extra folder of task YAMLs.")
@click.option("--gen-kwargs", "--gen_kwargs", "gen_kwargs", default=None, help="Generation settings, e.g. temperature=0,max_gen_toks=64.")
@click.option("--apply-chat-template", "--apply_chat_template", "apply_chat_template", is_flag=True, help="Wrap prompts in the model's chat template.")
@click.option("--seed", default="0,1234,1234,1234", show_default=True, help="Python,numpy,torch,fewshot seeds (or one for all).")
@click.option(
    "--cache",
    "cache",
    default=None,
    help="Result cache folder: a rerun reuses every finished request. Default: OUTPUT_PATH/cache.",
)
@click.option("--threads", type=int, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--dashboard", is_flag=True, help="Start Ray's dashboard with the embedded Ray (off by default).")
@click.option("--steer", default=None, help="Steering spec (YAML/JSON): interventions active for every request.")
@click.option("--stage", is_flag=True, help="Copy the model to every node first (driver stage); workers load that copy.")
def run(
    model: str,
    tasks: str,
    workers: str,
    address: str | None,
    num_fewshot: int | None,
    limit: str | None,
    batch_size: str,
    max_length: int | None,
    model_args: str,
    output_path: str,
    log_samples: bool,
    include_path: str | None,
    gen_kwargs: str | None,
    apply_chat_template: bool,
    seed: str,
    cache: str | None,
    threads: int | None,
    dashboard: bool,
    steer: str | None,
    stage: bool,
) -> Any:
    """Evaluate MODEL on lm-eval TASKS with its requests spread over Ray workers.

    Prints lm-eval's table and writes lm-eval's results JSON (and samples) plus summary_*.json under OUTPUT_PATH.
    """
    start = time.monotonic()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _usage():  # 0. every setting, in the user's words (exit 2)
        plan = Plan(
            seeds=parse_seeds(seed),
            limit=settings.limit(limit),
            num_fewshot=settings.num_fewshot(num_fewshot),
            batch_size=str(settings.batch_size(batch_size)),
            log_samples=log_samples,
            apply_chat_template=apply_chat_template,
            gen_kwargs=settings.gen_kwargs(gen_kwargs),
        )
        max_length, threads = settings.max_length(max_length), settings.threads(threads)
        extra = settings.model_args(model_args, flags=RUN_FLAGS)
    _check_workers(workers, address, model)
    preflight.check_address_syntax(address)
    plan.names = _preflight(
        model, extra, output_path=output_path, cache=cache, apply_chat_template=apply_chat_template, tasks=tasks,
        include_path=include_path, steer=steer, address=address,
    )  # fmt: skip
    args: dict[str, Any] = {
        **extra,
        "pretrained": model,
        "workers": workers,
        "batch_size": int(plan.batch_size),
        "cache": cache or str(Path(output_path) / "cache"),
        "dashboard": dashboard,
        "stage": stage,
    }
    for name, value in (("address", address), ("max_length", max_length), ("threads", threads), ("steer", steer)):
        if value is not None:
            args[name] = value
    # The expensive part starts here: lm-eval indexes its task YAMLs (Python, seconds) while Ray starts (mostly
    # waiting on processes) and the workers load the model.
    indexing = in_background(preflight.task_manager, plan.names, include_path)
    if plan.num_fewshot:  # how many examples each task has is known once its documents load: still before Ray
        from driver.lm.evaluation import DATASET_HINT
        from driver.checks.fewshot import check_fewshot

        check_fewshot(indexing.result(), plan.names, plan.num_fewshot, DATASET_HINT)
    with resumable(args["cache"]):
        lm = open_model(args)
        try:
            plan.manager = indexing.result()
            done = evaluate(lm, args, plan, output_path)
        finally:
            lm.executor.close()
    save(done, output_path, time.monotonic() - start)
    return done


@contextlib.contextmanager
def resumable(cache: str | os.PathLike):
    """Ctrl-C (or SIGTERM, driver.lm.quiet) stops the command in one line: what finished is in the cache."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"interrupted: finished requests are cached in {cache}; rerun the same command to resume", err=True)
        raise SystemExit(130) from None


def in_background(fn, *args) -> Future:
    """fn(*args) on a daemon thread: a failure elsewhere meanwhile does not wait for it."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # raised by .result() in the caller's thread
            future.set_exception(e)

    threading.Thread(target=work, daemon=True, name="orchard-background").start()
    return future


def _check_workers(workers: str, address: str | None = None, model: str | None = None) -> None:
    """--workers: a count or all (exit 2); with a model, no more than this machine holds when Ray runs here (exit 1)."""
    from cluster import ClusterError, parse_workers
    from cluster.limits import check_local

    try:
        n = parse_workers(workers)
    except ClusterError as e:
        raise BadUsage(str(e)) from None
    if model is None:
        return
    try:
        check_local(n, address, model)
    except ClusterError as e:
        raise Refused(str(e)) from None


def _preflight(model: str, extra: dict[str, Any], *, output_path: str, cache: str | None, apply_chat_template: bool,
               tasks: str, include_path: str | None, steer: str | None, address: str | None) -> list[str]:  # fmt: skip
    """driver.checks.preflight's checks in its order, before lm-eval's task index, Ray or a model; the task names."""
    preflight.writable_folder(output_path, "--output-path")
    preflight.check_cache(cache or Path(output_path) / "cache", "--cache" if cache else "the result cache")
    folder = preflight.check_model(model, extra.get("revision"), extra.get("adapter_path"))
    preflight.check_tokenizer(folder, apply_chat_template)
    names = preflight.check_tasks(tasks, include_path)
    if steer:
        preflight.check_steering(steer, preflight.model_config(folder))
    preflight.check_address(address)
    return names


@main.command()
@click.option("--workers", default=4, show_default=True, type=int, help="Workers on the embedded local Ray.")
@click.option(
    "--dir",
    "folder",
    default="orchard-out/demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the demo's tasks, results and cache go.",
)
@click.pass_context
def demo(ctx: click.Context, workers: int, folder: str) -> None:
    """Offline end-to-end run: the shipped TinyStories-260K model on three story tasks, WORKERS local workers.

    Writes the tasks (examples/tinystories: pick the coherent continuation, perplexity of short stories, finish
    a sentence) under DIR/tasks, runs `driver run` on the embedded Ray and shows a few of the model's
    continuations. Needs no network.
    """
    if workers < 1:
        raise BadUsage(f"--workers {workers}: at least 1 worker is needed")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from testbed.stories import MODEL, TASKS, write_story_tasks

    if not (MODEL / "config.json").is_file():
        raise Refused(f"the demo model is not at {MODEL}: run the demo from a clone of the project (pip install -e .)")
    root = Path(folder)
    preflight.writable_folder(root, "--dir")
    tasks = write_story_tasks(root / "tasks")
    done = ctx.invoke(
        run, model=str(MODEL), tasks=",".join(TASKS), workers=str(workers), address="local", include_path=str(tasks),
        output_path=str(root / "out"), log_samples=True, batch_size="8", threads=1, steer=None,
    )  # fmt: skip
    click.echo("\nthe model's own words (tinystories_gen, greedy):")
    for sample in done.results["samples"]["tinystories_gen"][:3]:
        click.echo(f"  ...{sample['doc']['prompt'][-48:]} → {sample['resps'][0][0].strip()}")
    click.echo(f"\ntasks: {tasks} (try: driver run --model {MODEL} --include-path {tasks} --tasks tinystories_mc)")


@main.command()
@click.option("--model", "model", required=True, help="Local model folder or Hugging Face repo id (mlx-lm format).")
@click.option("--pairs", required=True, help='JSONL of contrastive pairs: {"positive": ..., "negative": ...} (+ optional "prompt").')
@click.option("--layers", default="all", show_default=True, help="Comma-separated layers (negative: from the end), or all.")
@click.option("--site", type=click.Choice(["resid_pre", "resid_post"]), default="resid_post", show_default=True)
@click.option("--method", type=click.Choice(["mean-diff", "pca-diff", "pca-center"]), default="mean-diff", show_default=True)
@click.option("--position", default="last", show_default=True, help="Token whose activations are read: last, or an index (-2: second to last).")
@click.option("--out", required=True, help="The .safetensors file to write.")
@click.option("--workers", default="all", show_default=True, help="Number of workers (one per `mlx` node), or all.")
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--model-args", "--model_args", "model_args", default="", help="More model settings, e.g. dtype=float16.")
@click.option("--threads", type=int, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--cache", default=None, type=click.Path(file_okay=False), help="Result cache folder. Default: cache/ beside OUT.")
def vectors(
    model: str, pairs: str, layers: str, site: str, method: str, position: str, out: str, workers: str,
    address: str | None, model_args: str, threads: int | None, cache: str | None,
) -> None:  # fmt: skip
    """Extract steering vectors from contrastive PAIRS: one per layer, written to OUT (usable as a spec's `vector`).

    Every pair's two texts run on the workers; the activations at POSITION are combined in a fixed order
    (mean difference by default), so the vectors do not depend on the number of workers. Each text's
    activations are cached: a rerun computes nothing, a changed pair only that pair.
    """
    from worker.load import context_window

    from driver.steering import vectors as vec
    from driver.steering.spec import model_shape

    start = time.monotonic()
    with _usage():  # settings (exit 2), then what they name (exit 1), all before a worker starts
        threads = settings.threads(threads)
        args = {**settings.model_args(model_args, flags=VECTORS_FLAGS), "pretrained": model, "workers": workers}
    _check_workers(workers, address, model)
    preflight.check_address_syntax(address)
    try:
        at = vec.parse_position(position)
    except ValueError as e:
        raise BadUsage(f"--position {position}: {_one_line(str(e))}") from None
    preflight.writable_file(out, "--out")
    folder = preflight.check_model(model, args.get("revision"), args.get("adapter_path"))
    preflight.check_tokenizer(folder)
    flag = "--cache" if cache or not args.get("cache") else "--model-args cache"
    args["cache"] = cache or args.get("cache") or str(Path(out).expanduser().absolute().parent / "cache")
    preflight.check_cache(args["cache"], flag)
    try:
        read = vec.read_pairs(pairs)
    except ValueError as e:
        raise Refused(str(e).strip().splitlines()[0]) from None
    config = preflight.model_config(folder)
    try:
        resolved = vec.parse_layers(layers, model_shape(config)[0])
    except ValueError as e:
        raise BadUsage(f"--layers {layers}: {_one_line(str(e))}") from None
    encode = vec.head_encoder(folder, bool(args.get("trust_remote_code")))
    try:  # every pair tokenized on the head as the capture will be, before Ray starts
        vec.check_pairs(pairs, read, encode, method, at, context_window(config, args.get("max_length")))
    except ValueError as e:
        raise Refused(_one_line(str(e))) from None
    preflight.check_address(address)
    for name, value in (("address", address), ("threads", threads)):
        if value is not None:
            args[name] = value
    lm = open_model(args)
    try:
        capture = lambda requests, points: lm.executor.run(lm.job("capture", points=tuple(points)), requests)  # noqa: E731
        found = vec.extract(capture, encode, read, resolved, site, method, at)
        info = lm.executor.info()
    except ValueError as e:
        raise click.ClickException(str(e).strip().splitlines()[0]) from None
    except RuntimeError as e:  # cluster.ClusterError: workers lost (finished captures stay in a --model-args cache)
        raise click.ClickException(lost_workers_line(str(e), lm)) from None
    finally:
        lm.executor.close()
    meta = vec.metadata(
        model, method, site, at, read, weights=lm.identity["files"], pairs_file_sha256=_sha256(pairs), layers=",".join(map(str, resolved))
    )
    vec.write_vectors(out, found, meta)
    seconds = time.monotonic() - start
    cached = f"{info['requests_cached']} of {2 * len(read)} texts from the cache, "
    click.echo(f"{len(found)} vectors from {len(read)} pairs ({cached}{args['cache']}) {on_workers(info)} in {seconds:.1f} s: {out}")


@main.command("sweep")
@click.argument("sweep_file", type=click.Path(dir_okay=False))
@click.option("--workers", default="all", show_default=True, help="Number of workers (one per `mlx` node), or all.")
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option(
    "--output", default=None, type=click.Path(file_okay=False), help="Output folder. Default: orchard-out/<sweep file name>."
)
@click.option("--cache", default=None, type=click.Path(file_okay=False), help="Result cache folder. Default: OUTPUT/cache.")
@click.option("--threads", type=int, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--stage", is_flag=True, help="Copy the model to every node first (driver stage); workers load that copy.")
def sweep_command(
    sweep_file: str, workers: str, address: str | None, output: str | None, cache: str | None, threads: int | None, stage: bool
) -> None:
    """Run a steering sweep: every configuration of SWEEP_FILE's grid (layers × alphas × ...) on its tasks and
    prompt sets, the model loaded once per worker. Writes results.csv/.jsonl, generations.jsonl, summary.md,
    heatmaps and line plots, and lm-eval's JSON per configuration under OUTPUT.

    The whole file (model, vectors, layers, tasks, prompts) is checked before any worker starts. Every finished
    request is cached under OUTPUT/cache: rerun an interrupted or grown sweep and only what is missing runs.
    One sweep writes to OUTPUT at a time; a rerun replaces the outputs of the previous one (never the cache).
    """
    from driver.sweep import outdir
    from driver.sweep import report
    from driver.sweep import SweepError, load_sweep
    from driver.sweep import run as run_sweep

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _check_workers(workers)
    folder = Path(output) if output else Path("orchard-out") / Path(sweep_file).stem
    preflight.writable_folder(folder, "--output")
    try:
        outdir.refuse_if_busy(folder)  # one writer per folder: a second sweep is refused before any work
        plan = load_sweep(sweep_file)
    except (SweepError, outdir.FolderBusy) as e:
        raise click.ClickException(str(e)) from None
    preflight.check_cache(cache or folder / "cache", "--cache" if cache else "the result cache")
    preflight.check_address(address)
    try:
        held = outdir.lock(folder)  # until this process exits
    except outdir.FolderBusy as e:
        raise click.ClickException(str(e)) from None
    try:
        outcome = run_sweep(
            plan, workers=workers, address=address, output=folder, cache=cache, threads=threads, stage=stage, echo=click.echo
        )
        written = report.write_outputs(outcome, folder)
    except KeyboardInterrupt:
        kept = cache or folder / "cache"
        click.echo(f"interrupted: finished requests are cached in {kept}; rerun the same command to resume", err=True)
        raise SystemExit(130) from None
    except ValueError as e:  # a request the model refuses (e.g. a prompt longer than the context window)
        raise click.ClickException(" ".join(str(e).split())) from None
    finally:
        outdir.unlock(held)
    facts = report.run_facts(outcome.info, outcome.seconds)
    click.echo(
        f"{len(plan.grid)} configuration{'s' * (len(plan.grid) != 1)} + baseline, {len(outcome.rows)} result rows {on_workers(facts)} in "
        f"{facts['wall_s']:.1f} s ({facts['requests_computed']} requests computed, {facts['requests_cached']} from cache)"
    )
    for line in report.problems(outcome.rows, written):
        click.echo(line, err=True)
    click.echo(f"results: {folder} (summary.md, results.csv, {2 * len(written['plots'])} plots)")


def _sha256(path: str) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@main.command()
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object ({address, nodes, warnings}) instead of lines.")
def nodes(address: str | None, as_json: bool) -> None:
    """One line per node: id, host, OS/arch, chip, memory, MLX device and the memory it recommends for models,
    BLAS, versions, `mlx` units, alive. Exit 1 when no node offers `mlx` or the `mlx` nodes' versions differ."""
    import json

    from cluster import ClusterError, connect, node_facts
    from cluster.facts import mismatch, node_line, node_rows, slow_blas

    preflight.check_address(address)  # syntax (exit 2), reachable, token authentication: no Ray yet
    try:
        connection = connect(address)  # imports Ray (in the mode the address needs)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    import ray

    try:
        facts, table = node_facts(), ray.nodes()
    finally:
        connection.close()
    if not facts:
        raise click.ClickException(
            f"no alive node offers the `mlx` resource ({len(table)} node{'s' * (len(table) != 1)} without it): "
            "start each Mac with ray start --resources='{\"mlx\": 1}' (deploy/ray-mac.sh does)"
        )
    rows, warning, differ = node_rows(table, facts), slow_blas(facts), mismatch(facts, who="nodes")
    if as_json:
        warnings = [w for w in (warning, differ) if w]
        click.echo(json.dumps({"address": connection.address, "nodes": rows, "warnings": warnings}, indent=1))
    else:
        for row in rows:
            click.echo(node_line(row))
    if warning:
        click.echo(warning, err=True)
    if differ:  # `driver run` refuses such a cluster: say so now, in one line, with the fix
        raise click.ClickException(differ)


from driver.cli.stage import stage as stage_command
main.add_command(stage_command)


from driver.cli.cluster import cluster as cluster_group  # noqa: E402  (the `cluster` group: up, down, status)

main.add_command(cluster_group)
