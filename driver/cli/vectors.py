"""`driver vectors`: steering vectors from contrastive pairs, one per layer, captured on the workers."""

from __future__ import annotations

import time
from pathlib import Path

import click

from driver.checks import settings
from driver.checks.cluster import check_address, check_address_syntax, check_workers
from driver.checks.errors import BadUsage, Refused
from driver.checks.files import check_cache, writable_file
from driver.checks.groups import for_command, tell_chosen
from driver.checks.model import check_model, check_site, check_tokenizer, model_config
from driver.cli.errors import one_line, usage_errors
from driver.cli.run import GROUP_HELP, SPLIT_HELP, WORKERS_HELP
from driver.lm.evaluation import lost_workers_line, on_workers, open_model
from driver.lm.quiet import doing_meanwhile, phase, say
from worker.spec import HEAD_SITES, SITES, head_shape, missing_sites

VECTORS_FLAGS = {"pretrained": "--model", "workers": "--workers", "address": "--address", "threads": "--threads",
                 "group_size": "--group-size", "split": "--split"}  # fmt: skip


@click.command()
@click.option("--model", "model", required=True, help="Local model folder or Hugging Face repo id (mlx-lm format).")
@click.option("--pairs", required=True, help='JSONL of contrastive pairs: {"positive": ..., "negative": ...} (+ optional "prompt").')
@click.option("--layers", default="all", show_default=True, help="Comma-separated layers (negative: from the end), or all.")
@click.option("--site", type=click.Choice(list(SITES)), default="resid_post", show_default=True,
              help="resid_pre / resid_mid / resid_post: the residual stream; attn_out / mlp_out: a branch output; "
                   "attn_head: each head's output before the output projection (one vector per head, see --heads).")
@click.option("--heads", default=None, help="With --site attn_head: comma-separated heads, or all (the default).")
@click.option("--method", type=click.Choice(["mean-diff", "pca-diff", "pca-center"]), default="mean-diff", show_default=True)
@click.option("--position", default="last", show_default=True, help="Token whose activations are read: last, or an index (-2: second to last).")
@click.option("--out", required=True, help="The .safetensors file to write.")
@click.option("--workers", default="all", show_default=True, help=WORKERS_HELP)
@click.option("--address", default=None, help="Ray cluster: auto, HOST:PORT, or local. Default: $RAY_ADDRESS, else local.")
@click.option("--model-args", "--model_args", "model_args", default="", help="More model settings, e.g. dtype=float16.")
@click.option("--threads", type=settings.WHOLE, default=None, help="BLAS/OpenMP threads per worker (several workers on one machine).")
@click.option("--cache", default=None, help="Result cache folder. Default: cache/ beside OUT.")
@click.option("--group-size", "--group_size", "group_size", default="1", show_default=True, help=GROUP_HELP)
@click.option("--split", default="auto", show_default=True, help=SPLIT_HELP)
def vectors(
    model: str, pairs: str, layers: str, site: str, heads: str | None, method: str, position: str, out: str, workers: str,
    address: str | None, model_args: str, threads: int | None, cache: str | None, group_size: str, split: str,
) -> None:  # fmt: skip
    """Extract steering vectors from contrastive PAIRS: one per layer (per layer and head at attn_head: keys
    `attn_head.L.h`), written to OUT (usable as a spec's `vector`).

    Every pair's two texts run on the workers; the activations at POSITION are combined in a fixed order
    (mean difference by default), so the vectors do not depend on the number of workers. Each text's
    activations are cached: a rerun computes nothing, a changed pair only that pair.
    """
    from worker.load import context_window

    from driver.steering import vectors as vec
    from driver.steering.spec import model_shape

    start = time.monotonic()
    with usage_errors():  # settings (exit 2), then what they name (exit 1), all before a worker starts
        threads = settings.threads(threads)
        args = {**settings.model_args(model_args, flags=VECTORS_FLAGS), "pretrained": model, "workers": workers}
        size, split = settings.group_size(group_size), settings.split(split)
    check_workers(workers, address, model, size if size != "auto" else 1)
    check_address_syntax(address)
    try:
        at = vec.parse_position(position)
    except ValueError as e:
        raise BadUsage(f"--position {position}: {one_line(str(e))}") from None
    if Path(out).suffix.lower() != ".safetensors":  # a spec reads a .npy (or any name) by its suffix: never a lie
        raise BadUsage(f"--out {out}: driver vectors writes a safetensors file: give a name ending in .safetensors "
                       f"(e.g. {Path(out).with_suffix('.safetensors').name})")  # fmt: skip
    writable_file(out, "--out")
    folder = check_model(model, args.get("revision"), args.get("adapter_path"))
    check_tokenizer(folder)
    args["cache"] = _cache(cache, args, out)
    try:
        read = vec.read_pairs(pairs)
    except ValueError as e:
        raise Refused(str(e).strip().splitlines()[0]) from None
    config = model_config(folder)
    try:
        resolved = vec.parse_layers(layers, model_shape(config)[0])
    except ValueError as e:
        raise BadUsage(f"--layers {layers}: {one_line(str(e))}") from None
    chosen_heads, head_dim = _heads(heads, site, config)
    try:  # the model's sites, and every pair tokenized on the head as the capture will be, before Ray starts
        with phase(f"checking {model}'s layers and tokenizing the pairs", after=1.0, transient=True):  # mlx-lm: seconds
            check_site(config, site, resolved)
            encode = vec.head_encoder(folder, bool(args.get("trust_remote_code")))
            vec.check_pairs(pairs, read, encode, method, at, context_window(config, args.get("max_length")))
    except ValueError as e:
        raise Refused(one_line(str(e))) from None
    check_address(address)
    grouping = for_command(size, split, workers, model=model, folder=folder, address=address)
    if site in HEAD_SITES and grouping.size > 1 and grouping.split == "tensor":
        raise BadUsage("--site attn_head: a tensor-split group holds each head on one node only: use --split pipeline")
    args |= {"group_size": grouping.size, "split": grouping.split}
    args |= {name: value for name, value in (("address", address), ("threads", threads)) if value is not None}
    with doing_meanwhile(None):  # no lm-eval requests to build
        lm = open_model(args)
    tell_chosen(size, split, grouping)
    try:
        capture = lambda requests, points: lm.executor.run(lm.job("capture", points=tuple(points)), requests)  # noqa: E731
        say(f"capturing {site} at {len(resolved)} layer{'s' * (len(resolved) != 1)} for {len(read)} pairs ({2 * len(read)} texts)")
        found = vec.extract(capture, encode, read, resolved, site, method, at, chosen_heads, head_dim)
        info = lm.executor.info()
    except ValueError as e:
        raise click.ClickException(str(e).strip().splitlines()[0]) from None
    except RuntimeError as e:  # cluster.ClusterError: workers lost (finished captures stay in a --model-args cache)
        raise click.ClickException(lost_workers_line(str(e), lm)) from None
    finally:
        lm.executor.close()
    meta = vec.metadata(
        model, method, site, at, read, weights=lm.identity["files"], pairs_file_sha256=_sha256(pairs), layers=",".join(map(str, resolved)),
        **({"heads": ",".join(map(str, chosen_heads)), "head_dim": str(head_dim)} if chosen_heads else {}),
    )
    vec.write_vectors(out, found, meta)
    seconds = time.monotonic() - start
    cached = f"{info['requests_cached']} of {2 * len(read)} texts from the cache, "
    click.echo(f"{len(found)} vectors from {len(read)} pairs ({cached}{args['cache']}) {on_workers(info)} in {seconds:.1f} s: {out}")


def _cache(cache: str | None, args: dict, out: str) -> str:
    """The result cache folder (--cache, else model_args' cache, else cache/ beside OUT), checked."""
    flag = "--cache" if cache or not args.get("cache") else "--model-args cache"
    folder = cache or args.get("cache") or str(Path(out).expanduser().absolute().parent / "cache")
    check_cache(folder, flag)
    return folder


def _heads(heads: str | None, site: str, config: dict) -> tuple[list[int], int | None]:
    """The heads --heads names at attn_head (all by default) and the model's head_dim; none at other sites."""
    from driver.steering import vectors as vec

    if site not in HEAD_SITES:
        if heads is not None:
            raise BadUsage(f"--heads {heads}: heads apply only to --site attn_head, not {site}: drop --heads")
        return [], None
    n_heads, head_dim = head_shape(config)
    if not n_heads or not head_dim:
        raise Refused(missing_sites(config).get("attn_head") or "--site attn_head: config.json does not tell the heads' width")
    try:
        return vec.parse_layers(heads or "all", n_heads, what="head"), head_dim
    except ValueError as e:
        raise BadUsage(f"--heads {heads}: {one_line(str(e))}") from None


def _sha256(path: str) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
