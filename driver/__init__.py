"""Orchard's head node, as rooms: `cli`, `checks`, `lm` (the lm-eval models `mlx`, `mlx-ray`), `steering`, `sweep`.

`import driver` registers the models with lm-eval, by name: lm-eval imports `driver.lm.mlx` (MLX, mlx-lm) when
a run first asks for one, so `driver --help` and a command's first phase line come within a second. lm-eval's own
backends are registered (lazily too) when `lm_eval.models` is first imported; importing it first keeps them
visible next to ours.

A Ctrl-C while `driver` imports (its first 1-2 s) is one line and exit 130, not a traceback: its handler is set
here, the first of the command's code to run, only when this process is the `driver` command (or `python -m driver`).
"""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"\ndriver: interrupted\n")  # nothing started yet: nothing to stop or keep
    os._exit(130)


if os.path.basename(sys.argv[0]) == "driver" or sys.orig_argv[1:3] == ["-m", "driver"]:  # never a host's import
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (imports run on the main thread)
        signal.signal(signal.SIGINT, _interrupted_while_starting)

import lm_eval.models  # noqa: E402, F401  (must precede our registrations)
from lm_eval.api.registry import model_registry

model_registry.register("mlx", target="driver.lm.mlx:MLXLM")
model_registry.register("mlx-ray", target="driver.lm.mlx_ray:MLXRayLM")
