"""`driver cluster`: a local multi-node Ray cluster (`up`, `down`, `status`) and `check` for a `ray up` cluster YAML."""

# Every error is a `click.ClickException` (one `Error:` line, exit 1) or a usage error (exit 2), printed by the
# `driver` group; this module never imports `driver.cli` (which registers it).

from __future__ import annotations

import contextlib
import io
import logging
import shlex
from pathlib import Path

import click

from driver.checks import settings
from driver.lm.quiet import phase

# What `ray start` needs on every Mac of a `ray up` cluster (checked by `check`; deploy/README.md says why).
START_NEEDS = {
    "--resources": "--resources='{\"mlx\": 1}' (Orchard places one worker per `mlx` unit)",
    "--node-ip-address": "--node-ip-address=<the Mac's LAN address> (else Ray may advertise a loopback or VPN address)",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1": "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (Ray refuses multi-node clusters on macOS without it)",
    "RAY_AUTH_MODE=token": "RAY_AUTH_MODE=token (token authentication)",
}
TOKEN_MOUNT = "~/.ray/auth_token"


@click.group("cluster")
def cluster() -> None:
    """A multi-node Ray cluster on this machine (loopback only, token auth), for trying Orchard without Macs."""


def _fail(e: Exception) -> click.ClickException:
    return click.ClickException(" ".join(str(e).split()))


def exports(state: dict) -> str:
    """The `export` line a shell evaluates to use the local cluster: its address (RAY_ADDRESS, so every command
    without --address joins it) and its token."""
    from cluster.local import driver_env

    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in {"RAY_ADDRESS": state["address"], **driver_env(state)}.items())


def _describe(state: dict, alive: int | None = None) -> None:
    count = state["nodes"] if alive is None else alive
    click.echo(f"Local Ray cluster: {count} node{'s' * (count != 1)} on 127.0.0.1, one `mlx` unit each, token authentication on.")
    click.echo(f"address: {state['address']}")
    click.echo(f"token:   {state['token_file']} (mode 0600; never printed)")
    click.echo("Use it from this shell:")
    click.echo(f"  {exports(state)}")
    click.echo(f"  driver nodes --address {state['address']}")
    click.echo("Stop it: driver cluster down")


@cluster.command()
@click.option("--nodes", default=3, show_default=True, type=settings.WholeNumber(1, 32), help="Ray nodes, one `mlx` unit each.")
@click.option("--cpus", default=1, show_default=True, type=settings.WholeNumber(1, 256), help="CPUs each node offers Ray.")
def up(nodes: int, cpus: int) -> None:
    """Start N `ray start` nodes on 127.0.0.1 with token authentication; print the address for --address."""
    from cluster import ClusterError, local

    try:
        nodes_text = f"{nodes} Ray node{'s' * (nodes != 1)}"
        with phase(f"starting {nodes_text} on 127.0.0.1, one at a time (token authentication, one `mlx` unit each)"):
            state = local.up(nodes, cpus)
    except ClusterError as e:
        raise _fail(e) from None
    _describe(state)


@cluster.command()
def down() -> None:
    """Stop the cluster `driver cluster up` started (only its processes; the token is kept for the next `up`)."""
    from cluster import local

    known = local.read_state()
    with phase(f"stopping the local cluster at {known['address']} (its processes only)") if known else contextlib.nullcontext():
        state = local.down()
    if state is None:
        click.echo("no local cluster is running (nothing to stop)")
        return
    click.echo(f"stopped the local cluster at {state['address']}")


@cluster.command()
@click.option("--env", "env_only", is_flag=True, help="Print only the `export ...` line (RAY_ADDRESS and the token), for eval \"$(driver cluster status --env)\".")
def status(env_only: bool) -> None:
    """Whether the local cluster runs, its address and how to use it."""
    from cluster import ClusterError, local

    state = local.read_state()
    if state is None or not local.answers(state):
        stale = " (its record is stale: `driver cluster down` clears it)" if state else ""
        raise click.ClickException(f"no local cluster is running{stale}: start one with `driver cluster up --nodes 3`")
    if env_only:
        click.echo(exports(state))
        return
    try:
        with phase(f"asking the local cluster at {state['address']} which of its nodes are alive", after=1.0):
            alive = len(local.alive_nodes(state))
    except ClusterError as e:
        raise _fail(e) from None
    except OSError as e:  # its token file is gone
        raise click.ClickException(f"cannot read the local cluster's token ({e.strerror}): `driver cluster down`, then up") from None
    _describe(state, alive)


@cluster.command()
@click.argument("config", type=click.Path(dir_okay=False))
def check(config: str) -> None:
    """Check a `ray up` cluster YAML: Ray's own validation, then Orchard's settings for Macs (deploy/cluster.yaml)."""
    problem = check_config(config)
    if problem:
        raise click.ClickException(problem)
    click.echo(f"{config}: valid for `ray up` (Ray's validation) and has Orchard's settings for Macs")


# --- cluster.yaml -------------------------------------------------------------------------------------------------


def load_config(path: str) -> dict:
    """The YAML as a dict; a ValueError in one line (file, line) when it is not one."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or type(e).__name__}): pass the cluster YAML, e.g. deploy/cluster.yaml") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"{path}:{where}: not valid YAML ({problem}): fix the syntax (compare deploy/cluster.yaml)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster YAML is a mapping (cluster_name, provider, auth, ...): compare deploy/cluster.yaml")
    return data


def ray_validate(config: dict) -> dict:
    """What `ray up` does before it touches a machine: `prepare_config` (defaults, the local provider's node
    type), then `validate_config` (Ray's JSON schema). Returns the prepared config; raises ValueError in one line."""
    import click as _click
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    quiet = logging.getLogger("ray.autoscaler")  # its INFO lines (defaults it fills in) are not news here
    level = quiet.level
    try:
        quiet.setLevel(logging.WARNING)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # Ray's cli_logger
            prepared = prepare_config(config)
            validate_config(prepared)
    except jsonschema.ValidationError as e:
        field = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ValueError(f"{field}: {' '.join(e.message.split())[:300]}") from None
    except (_click.ClickException, ValueError, KeyError, TypeError, RuntimeError) as e:
        message = e.format_message() if isinstance(e, _click.ClickException) else str(e)
        raise ValueError(" ".join(message.split())[:300].rstrip(".") or type(e).__name__) from None
    finally:
        quiet.setLevel(level)
    return prepared


def orchard_problem(config: dict) -> str | None:
    """What an Orchard cluster of Macs needs beyond Ray's schema, as one line naming the fix; None if all there."""
    provider = config.get("provider") or {}
    if provider.get("type") != "local":
        return f"provider.type is {provider.get('type')!r}: Macs use Ray's on-premises provider, `type: local`"
    for key in ("ssh_user", "ssh_private_key"):
        if not (config.get("auth") or {}).get(key):
            return f"auth.{key} is missing: set the macOS account and the ssh key every Mac accepts"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config.get(key) or [] if "ray start" in c]
        if not starts:
            return f"{key} has no `ray start`: copy it from deploy/cluster.yaml"
        for needle, fix in START_NEEDS.items():
            if not all(needle in c for c in starts):
                return f"{key}: `ray start` lacks {needle}: add {fix}"
    mounts = config.get("file_mounts") or {}
    if TOKEN_MOUNT not in mounts:
        return f"file_mounts has no {TOKEN_MOUNT}: add `{TOKEN_MOUNT}: {TOKEN_MOUNT}` so every Mac gets the head's token"
    return None


def check_config(path: str) -> str | None:
    """One line naming the first problem of a `ray up` cluster YAML, prefixed by its file; None if it is fine."""
    try:
        config = load_config(path)
        ray_validate(config)
    except ValueError as e:
        text = str(e)
        return text if text.startswith(path) else f"{path}: {text}: compare deploy/cluster.yaml"
    problem = orchard_problem(config)
    return f"{path}: {problem}" if problem else None
