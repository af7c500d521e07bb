"""Joining an `mx.distributed` ring: one per process, for its whole life (MLX caches the first group).

The head picks every rank's "host:port" (`free_address` on each node) and hands every rank the same list;
`join` writes it as MLX's JSON hostfile and initialises the ring backend within a bounded wait.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from ..load import ModelLoadError

if TYPE_CHECKING:
    import mlx.core as mx


class RingError(ModelLoadError):
    """A ring that cannot form (a port taken, a rank that never joins); one line naming the rank and the fix."""


def free_address(host: str) -> str:
    """'host:port' with a TCP port free on `host` now (bound to port 0, then released for the ring to take)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            raise RingError(f"cannot bind a port on {host} ({e.strerror}): give this node's own address") from None
        return f"{host}:{s.getsockname()[1]}"


def _hostfile(hostfile: list[str]) -> str:
    """MLX's ring hostfile: a JSON list, in rank order, of each rank's list of addresses."""
    fd, path = tempfile.mkstemp(prefix="orchard-ring-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump([[address] for address in hostfile], fh)
    return path


# The watchdog of a join: MLX's ring init holds the GIL while it waits for its peers (a rank that accepts waits
# forever), so no Python thread or signal handler can end the wait. A tiny separate process does: it waits for
# its stdin to close (the join finished, or this process died) and otherwise, at the deadline, writes the one
# line to the shared stderr and SIGKILLs this process.
_WATCHDOG = """import os, select, signal, sys
ready, _, _ = select.select([sys.stdin], [], [], float(sys.argv[2]))
if not ready:
    sys.stderr.write(sys.argv[3] + "\\n")
    sys.stderr.flush()
    os.kill(int(sys.argv[1]), signal.SIGKILL)
"""


def _watchdog(timeout: float, line: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), str(timeout), line],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)  # fmt: skip


def join(hostfile: list[str], rank: int, timeout: float = 30.0) -> "mx.distributed.Group":
    """This process's ring as rank `rank` of `hostfile` ("host:port" per rank, rank order).

    A ring that cannot form raises RingError (one line) when MLX reports it (an address it cannot connect to);
    a ring that does not form within `timeout` (a rank that never joins) ENDS THIS PROCESS: one line
    "RingError: rank R (host:port): ..." on stderr, then SIGKILL, so the caller (the head) sees a dead rank.
    """
    import mlx.core as mx

    if not 0 <= rank < len(hostfile):
        raise RingError(f"rank {rank} is outside a ring of {len(hostfile)}: give a rank in 0..{len(hostfile) - 1}")
    path = _hostfile(hostfile)
    os.environ.update(MLX_RANK=str(rank), MLX_HOSTFILE=path)
    line = (f"RingError: rank {rank} ({hostfile[rank]}): the ring of {len(hostfile)} did not form within {timeout:g} s: "
            f"a rank did not join or cannot reach another ({', '.join(hostfile)})")  # fmt: skip
    watchdog = _watchdog(timeout, line)
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    except RuntimeError as e:  # the backend's own reason, first line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RingError(f"rank {rank} ({hostfile[rank]}) could not join the ring of {len(hostfile)}: {first}") from None
    finally:
        watchdog.stdin.close()
        watchdog.wait()
        os.unlink(path)
    return _checked(group, rank, len(hostfile))


def _checked(group: "mx.distributed.Group", rank: int, size: int) -> "mx.distributed.Group":
    if (group.rank(), group.size()) != (rank, size):
        raise RingError(f"joined as rank {group.rank()} of {group.size()}, not {rank} of {size}: this process "
                        "already joined another ring (a process keeps its first ring): start a fresh one")  # fmt: skip
    return group
