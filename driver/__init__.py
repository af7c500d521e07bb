"""Orchard's head node, as rooms: `cli`, `checks`, `lm` (the lm-eval models `mlx`, `mlx-ray`), `steering`, `sweep`.

`import driver` registers the models with lm-eval, by name: lm-eval imports `driver.lm.mlx` (MLX, mlx-lm) when
a run first asks for one, so `driver --help` and a command's first phase line come within a second. lm-eval's own
backends are registered (lazily too) when `lm_eval.models` is first imported; importing it first keeps them
visible next to ours.
"""

import lm_eval.models  # noqa: F401  (must precede our registrations)
from lm_eval.api.registry import model_registry

model_registry.register("mlx", target="driver.lm.mlx:MLXLM")
model_registry.register("mlx-ray", target="driver.lm.mlx_ray:MLXRayLM")
