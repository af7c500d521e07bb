"""The cluster a command names: --workers (count, what this machine holds), --address; checked without Ray."""

from __future__ import annotations

from driver.checks.errors import BadUsage, Refused


def check_workers(workers: str, address: str | None = None, model: str | None = None, group_size: int = 1) -> None:
    """--workers: a count or all (exit 2); with a model, no more than this machine holds when Ray runs here (exit 1):
    N groups of `group_size` are N*K worker processes, each holding a 1/K share of the weights."""
    from cluster import ClusterError, parse_workers
    from cluster.limits import check_local

    try:
        n = parse_workers(workers)
    except ClusterError as e:
        raise BadUsage(str(e)) from None
    if model is None:
        return
    try:
        check_local(n, address, model, group_size)
    except ClusterError as e:
        raise Refused(str(e)) from None


def check_address_syntax(address: str | None) -> None:
    """auto | local | HOST:PORT | ray://...: exit 2 for --address (a settings error), 1 for RAY_ADDRESS."""
    from cluster.connect import AddressError, check_syntax, source_of

    value, source = source_of(address)
    try:
        check_syntax(value, source)
    except AddressError as e:
        raise (BadUsage if source == "--address" else Refused)(str(e)) from None


def check_address(address: str | None) -> None:
    """Syntax, then reachability and token authentication (exit 1); no `ray.init`."""
    from cluster.connect import ClusterError, resolve, source_of

    check_address_syntax(address)
    value, _ = source_of(address)
    if value == "local" or value.startswith("ray://"):
        return
    try:
        resolve(address)
    except ClusterError as e:
        raise Refused(str(e)) from None
